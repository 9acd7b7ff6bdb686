"""Which worker serves a request: the one whose prefix cache holds most of its prompt, with load as the
tie-breaker and the override (SGLang's cache-aware policy, on what the workers say they hold).

Each worker publishes the keys of the blocks in its prefix cache to a set in Redis
(workers/serving/routing.py) and its batch size to its model's load hash; the API keys a prompt's blocks as
the worker does (schemas/blocks.py, cache salt included, so routing never crosses tenants) and asks each
live worker's set which it holds, in one pipelined round trip. A worker's load is its batch plus the
requests waiting on its own queue.

The policy, in order:
1. Unbalanced loads (max − min > `balance_abs` and max > `balance_rel` × min): the least loaded worker.
2. A worker holds at least `cache_threshold` of the prompt's tokens: of the workers with the longest
   match, the least loaded.
3. Otherwise the model's shared queue, which RQ hands to whichever worker asks first: an idle one.
A routed request goes on its worker's own queue, which the worker serves before the shared one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from rq import Queue

from app.admission import live_worker_names
from schemas.blocks import block_keys
from schemas.config import Settings
from schemas.keys import queue_name, worker_blocks_key, worker_load_key, worker_queue_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerState:
    name: str  # the worker process, `<host>.<pid>`
    load: int  # requests in its batch and on its own queue
    matched: int  # leading blocks of the prompt in its prefix cache


@dataclass(frozen=True)
class Decision:
    worker: str | None  # None: the model's shared queue
    by: str  # prefix, load or shared
    matched: int = 0  # blocks of the prompt the chosen worker holds
    blocks: int = 0  # blocks of the prompt a worker could reuse


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

    def choose(self, workers: Sequence[WorkerState], blocks: int, block_size: int, prompt_tokens: int) -> Decision:
        """The decision for a prompt of `prompt_tokens` tokens whose first `blocks` blocks a worker could
        reuse, among the model's live `workers`."""
        if not workers:
            return Decision(None, "shared", 0, blocks)
        if len(workers) > 1 and self.unbalanced([w.load for w in workers]):
            least = min(workers, key=lambda w: (w.load, w.name))
            return Decision(least.name, "load", least.matched, blocks)
        longest = max(w.matched for w in workers)
        if longest and longest * block_size >= self.cache_threshold * prompt_tokens:
            best = min((w for w in workers if w.matched == longest), key=lambda w: (w.load, w.name))
            return Decision(best.name, "prefix", longest, blocks)
        return Decision(None, "shared", longest, blocks)


class Router:
    """Decides each request's queue from what the model's live workers hold and how loaded they are."""

    def __init__(self, connection: redis.Redis, settings: Settings) -> None:
        self.connection = connection
        self.enabled = settings.routing == "cache"
        self.block_size = settings.cache_block_size
        self.policy = Policy.from_settings(settings)

    def route(self, model: str, tokens: Sequence[int], salt: str | None) -> tuple[str, Decision]:
        """The queue for the request, and why. Routing off: the shared queue."""
        shared = queue_name(model)
        if not self.enabled:
            return shared, Decision(None, "shared")
        usable = (len(tokens) - 1) // self.block_size  # the engine computes at least the last token
        keys = block_keys(tokens[: usable * self.block_size], self.block_size, salt)
        workers = worker_states(self.connection, model, keys)
        decision = self.policy.choose(workers, len(keys), self.block_size, len(tokens))
        return (shared if decision.worker is None else worker_queue_name(model, decision.worker)), decision


def worker_states(connection: redis.Redis, model: str, keys: Sequence[bytes] = ()) -> list[WorkerState]:
    """The model's live workers, each with its load and how many of `keys` lead its prefix cache: two
    round trips."""
    names = sorted(live_worker_names(connection, model))
    if not names:
        return []
    with connection.pipeline(transaction=False) as pipe:
        pipe.hgetall(worker_load_key(model))
        for name in names:
            pipe.llen(Queue(worker_queue_name(model, name), connection=connection).key)
            if keys:
                pipe.smismember(worker_blocks_key(name), list(keys))
        replies = iter(pipe.execute())
    running = {_text(k): int(v) for k, v in next(replies).items()}
    states = []
    for name in names:
        waiting = int(next(replies))
        held = next(replies) if keys else []
        matched = next((i for i, hit in enumerate(held) if not hit), len(held))
        states.append(WorkerState(name, running.get(name, 0) + waiting, matched))
    return states


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
