"""Which worker serves a request: the one whose prefix cache holds most of its prompt, with load as the
tie-breaker and the override (SGLang's cache-aware policy, on what the workers say they hold).

Each worker publishes the keys of the blocks in its prefix cache to a set in Redis
(workers/serving/routing.py), the size of its blocks, and its batch size to its model's load hash; the
API keys a prompt's blocks as the worker does, in the worker's block size (schemas/blocks.py, cache salt
included, so routing never crosses tenants), and asks each live worker's set which it holds, in one
pipelined round trip. A worker's load is its batch plus the requests waiting on its own queue.

The policy, in order:
1. Unbalanced loads (max − min > `balance_abs` and max > `balance_rel` × min): the least loaded worker.
2. A worker holds at least `cache_threshold` of the prompt's tokens: of the workers with the longest
   match, the least loaded.
3. Otherwise the model's shared queue, which RQ hands to whichever worker asks first: an idle one.
A routed request goes on its worker's own queue, which the worker serves before the shared one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from rq import Queue

from app.admission import live_worker_names
from schemas.blocks import block_keys
from schemas.config import Settings
from schemas.keys import queue_name, worker_block_size_key, worker_blocks_key, worker_load_key, worker_queue_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerState:
    name: str  # the worker process, `<host>.<pid>`
    load: int  # requests in its batch and on its own queue
    matched: int  # leading tokens of the prompt in its prefix cache (whole blocks of its size)


@dataclass(frozen=True)
class Decision:
    worker: str | None  # None: the model's shared queue
    by: str  # prefix, load or shared
    matched: int = 0  # tokens of the prompt the chosen worker holds
    reusable: int = 0  # tokens of the prompt a worker could reuse (whole blocks, not the last token)


@dataclass(frozen=True)
class Policy:
    cache_threshold: float = 0.5
    balance_abs: int = 4
    balance_rel: float = 1.5

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(settings.routing_cache_threshold, settings.routing_balance_abs, settings.routing_balance_rel)

    def unbalanced(self, loads: Sequence[int]) -> bool:
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs and high > self.balance_rel * low

    def choose(self, workers: Sequence[WorkerState], reusable: int, prompt_tokens: int) -> Decision:
        """The decision for a prompt of `prompt_tokens` tokens whose first `reusable` tokens a worker
        could reuse, among the model's live `workers`."""
        if not workers:
            return Decision(None, "shared", 0, reusable)
        if len(workers) > 1 and self.unbalanced([w.load for w in workers]):
            least = min(workers, key=lambda w: (w.load, w.name))
            return Decision(least.name, "load", least.matched, reusable)
        longest = max(w.matched for w in workers)
        if longest and longest >= self.cache_threshold * prompt_tokens:
            best = min((w for w in workers if w.matched == longest), key=lambda w: (w.load, w.name))
            return Decision(best.name, "prefix", longest, reusable)
        return Decision(None, "shared", longest, reusable)


class PromptBlocks:
    """A prompt's block keys in each block size the workers use (the engine computes at least the
    last token, so it is never in a reusable block)."""

    def __init__(self, tokens: Sequence[int], salt: str | None) -> None:
        self.tokens, self.salt = tokens, salt
        self.keys: dict[int, list[bytes]] = {}

    def of_size(self, size: int) -> list[bytes]:
        if size not in self.keys:
            usable = (len(self.tokens) - 1) // size
            self.keys[size] = block_keys(self.tokens[: usable * size], size, self.salt)
        return self.keys[size]


class Router:
    """Decides each request's queue from what the model's live workers hold and how loaded they are."""

    def __init__(self, connection: redis.Redis, settings: Settings) -> None:
        self.connection = connection
        self.enabled = settings.routing == "cache"
        self.policy = Policy.from_settings(settings)
        self.block_sizes = BlockSizes()

    def route(self, model: str, tokens: Sequence[int], salt: str | None) -> tuple[str, Decision]:
        """The queue for the request, and why. Routing off: the shared queue."""
        shared = queue_name(model)
        if not self.enabled:
            return shared, Decision(None, "shared")
        prompt = PromptBlocks(tokens, salt)
        workers = worker_states(self.connection, model, prompt, self.block_sizes)
        reusable = max((len(keys) * size for size, keys in prompt.keys.items()), default=0)
        decision = self.policy.choose(workers, reusable, len(tokens))
        return (shared if decision.worker is None else worker_queue_name(model, decision.worker)), decision


class BlockSizes:
    """Each worker process's block size, as it published it: read once per process name (a process
    keeps its size), for the names not seen yet; a worker that has published none (not yet, or its
    prefix cache is off) is asked again after RETRY_SECONDS, not on every request."""

    LIMIT = 4096  # names kept; past it the table starts again (workers come and go)
    RETRY_SECONDS = 2.0

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.unpublished: dict[str, float] = {}  # name → when it was last found without a size

    def of(self, connection: redis.Redis, names: Sequence[str]) -> dict[str, int]:
        now = time.monotonic()

        def due(name: str) -> bool:  # never asked, or asked too long ago to trust the answer "none"
            last = self.unpublished.get(name)
            return last is None or now - last >= self.RETRY_SECONDS

        unknown = [name for name in names if name not in self.sizes and due(name)]
        if unknown:
            if len(self.sizes) + len(self.unpublished) + len(unknown) > self.LIMIT:
                self.sizes.clear()
                self.unpublished.clear()
            for name, size in zip(unknown, connection.mget([worker_block_size_key(n) for n in unknown]), strict=True):
                if size is None:  # nothing to match in its cache for now
                    self.unpublished[name] = now
                else:
                    self.sizes[name] = int(size)
                    self.unpublished.pop(name, None)
        return {name: self.sizes[name] for name in names if name in self.sizes}


def worker_states(
    connection: redis.Redis, model: str, prompt: PromptBlocks | None = None, sizes: BlockSizes | None = None
) -> list[WorkerState]:
    """The model's live workers, each with its load and how many of the `prompt`'s leading tokens its
    prefix cache holds (keyed in its own block size): two round trips (three when a worker is new)."""
    names = sorted(live_worker_names(connection, model))
    if not names:
        return []
    block_size = (sizes or BlockSizes()).of(connection, names) if prompt is not None else {}
    # Each worker's reusable block keys, in its own size (none: nothing to ask its set).
    keys = {name: prompt.of_size(size) for name, size in block_size.items()} if prompt is not None else {}
    with connection.pipeline(transaction=False) as pipe:
        pipe.hgetall(worker_load_key(model))
        for name in names:
            pipe.llen(Queue(worker_queue_name(model, name), connection=connection).key)
            if keys.get(name):
                pipe.smismember(worker_blocks_key(name), keys[name])
        replies = iter(pipe.execute())
    running = {_text(k): int(v) for k, v in next(replies).items()}
    states = []
    for name in names:
        waiting = int(next(replies))
        held = next(replies) if keys.get(name) else []
        matched = next((i for i, hit in enumerate(held) if not hit), len(held)) * block_size.get(name, 0)
        states.append(WorkerState(name, running.get(name, 0) + waiting, matched))
    return states


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
