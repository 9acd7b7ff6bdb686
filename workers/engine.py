"""The generation engine: iteration-level (continuous) batching over one copy of the model.

`add_request` queues a request's sequences (n choices = n sequences). Each step first admits waiting
sequences up to `max_batch_size` (one batched, left-padded prefill, whose last position gives each its
first token), then runs one decode forward pass for every running row, the newcomers included. With a
forward that has a mixed pass (tokenline's Llama forward) and rows running, a short prefill and the
running rows' decode are one pass instead (each weight read once), and that step's decode is done.
Each token is sampled with its sequence's own parameters. A finished or cancelled sequence leaves the
batch at its next phase, freeing its slot and its KV rows. The RQ glue (workers/runtime.py) feeds it
and publishes each phase's events as soon as it ends, so a newcomer prefilled alone does not wait for
the decode of the rows already running.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from schemas.errors import GenerationFailed
from schemas.job import Event, JobPayload, Usage
from schemas.sampling import MAX_SEED
from workers.detokenizer import IncrementalDetokenizer
from workers.forward import Forward, left_padded, make_forward
from workers.kvbatch import KVBatch
from workers.model import LoadedModel
from workers.sampler import SamplingState, sample
from workers.stopping import StopStrings

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    """One choice of one request."""

    request: Request
    index: int
    state: SamplingState
    detokenizer: IncrementalDetokenizer
    stop: StopStrings
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Request:
    payload: JobPayload
    sequences: list[Sequence] = field(default_factory=list)
    next_seq: int = 0

    @property
    def request_id(self) -> str:
        return self.payload.request_id

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def event(self, kind: str, **fields: object) -> Event:
        event = Event(self.request_id, self.next_seq, kind, **fields)  # type: ignore[arg-type]
        self.next_seq += 1
        return event


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or torch_npu's RuntimeError that says the same."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def release_device_memory(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    empty_cache = getattr(backend, "empty_cache", None)
    if device.type != "cpu" and callable(empty_cache):
        empty_cache()


# While rows are decoding, a prefill of fewer prompt tokens runs on the decode steps' thread count:
# small prefills interleaved with decode steps were slower on two threads in the full stack (bench
# A/B, README "Benchmark"). On an idle engine whose last step ended less than WARM_CORES_SECONDS ago
# (the cores are still awake), every prefill gets the prefill threads: a lone request's first token
# came sooner. After a longer pause, a short prompt's prefill on two threads took 15-16 ms instead of
# 5 ms on the 2-core VM (each parallel region waits for a core that has gone to sleep), against 7.5 ms
# on one thread; measured in-process for pauses of 2, 5, 10, 20, 50 and 200 ms (README "Benchmark").
PARALLEL_PREFILL_MIN_TOKENS = 64
WARM_CORES_SECONDS = 0.010


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block on `count` torch intra-op threads (0: leave the setting as it is)."""
    previous = torch.get_num_threads()
    if count <= 0 or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        max_seq_len: int,
        max_batch_size: int = 1,
        prefill_threads: int = 0,
        warm_cores_seconds: float = WARM_CORES_SECONDS,
        forward: str = "auto",
    ) -> None:
        self.loaded = loaded
        self.forward: Forward = make_forward(loaded.model, forward)
        self.prefill_threads = prefill_threads
        self.warm_cores_seconds = warm_cores_seconds
        self.stepped_at = -float("inf")  # time.monotonic() at the end of the last step that ran the model
        self._decoded = False  # the last admit decoded the running rows too: the step's decode is done
        self.eos_ids = frozenset(loaded.files.eos_token_ids)
        positions = loaded.files.max_position_embeddings or max_seq_len
        self.max_model_len = min(max_seq_len, positions)
        self.max_batch_size = max_batch_size
        self.pad_id = int(loaded.model.config.pad_token_id or 0)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv = KVBatch()

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def add_request(self, payload: JobPayload) -> None:
        if len(payload.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(payload.prompt_token_ids)} tokens leaves no room to generate")
        if payload.request_id in self.requests:
            raise ValueError(f"request {payload.request_id} is already running")
        request = Request(payload)
        for index in range(payload.n):
            params = payload.sampling
            if params.seed is not None and index:
                params = type(params).from_dict({**params.to_dict(), "seed": (params.seed + index) % MAX_SEED})
            request.sequences.append(
                Sequence(
                    request=request,
                    index=index,
                    state=SamplingState.create(
                        params, payload.prompt_token_ids, self.loaded.vocab_size, self.loaded.device
                    ),
                    detokenizer=IncrementalDetokenizer(self.loaded.tokenizer, payload.prompt_token_ids),
                    stop=StopStrings(params.stop),
                )
            )
        self.requests[payload.request_id] = request
        self.waiting.extend(request.sequences)

    def cancel(self, request_id: str) -> list[Event]:
        """Drop a request; its rows leave the batch at the next step."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return []
        for sequence in request.sequences:
            sequence.finish_reason = sequence.finish_reason or "cancelled"
        self.waiting = deque(s for s in self.waiting if s.request is not request)
        # The cores do not count as idle: the API unwinds the client's stream and the queue process will
        # settle its job. Right after 16 hang-ups, a short prompt's prefill on two threads took 18-31 ms
        # instead of 7-10 ms on one (the disconnect probe of `make bench`, traced).
        self.stepped_at = -float("inf")
        return [request.event("cancelled")]

    def fail_all(self, message: str) -> list[Event]:
        """End every request with an error event and start from an empty batch."""
        error = GenerationFailed(message).envelope()["error"]
        events = [r.event("error", error=error) for r in self.requests.values()]
        self.requests.clear()
        self.waiting.clear()
        self.running = []
        self.kv = KVBatch()
        return events

    def step(self) -> list[Event]:
        """One iteration: `admit`, then `decode`. The runtime runs the two itself, to publish the
        newcomers' first tokens before a decode that the admit did not already run."""
        return self.admit() + self.decode()

    def admit(self) -> list[Event]:
        """Prefill the waiting sequences that fit in the batch (one left-padded forward pass) and sample
        their first tokens; they join the running rows, and the decode that follows includes them.

        If rows are running, the prompts are short (under PARALLEL_PREFILL_MIN_TOKENS) and the forward
        has a mixed pass, the pass also decodes the running rows (their tokens are among the events)
        and this step's `decode` is then empty. In one process at 16 clients in a closed loop this gave
        2049-2171 tok/s against 1550-1984, and in the stack, side by side, c=16 1415-1686 against
        1358-1593 and c=4 563-682 against 550-654 (README "Benchmark"). A larger prefill runs apart on
        the prefill threads: in one pass with the decode rows it was slower in the stack."""
        self._compact()
        self._decoded = False
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            admitted.append(self.waiting.popleft())
        if not admitted:
            return []
        running = list(self.running)
        tokens = sum(len(s.request.payload.prompt_token_ids) for s in admitted)
        # A prefill large enough for the prefill threads runs apart: the decode rows stay on their own.
        mixable = callable(getattr(self.forward, "mixed", None))
        mixed = bool(running) and tokens < PARALLEL_PREFILL_MIN_TOKENS and mixable
        try:
            with torch_threads(self._prefill_threads(tokens)):
                logits = self._mixed(admitted) if mixed else self._prefill(admitted)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            return self._fail_out_of_memory(admitted, "prefilling the prompt")  # the running rows decode on
        self.running.extend(admitted)
        self._decoded = mixed
        return self._sampled(logits, running + admitted if mixed else admitted)

    def decode(self) -> list[Event]:
        """One decode forward pass over the running rows, and one token sampled for each."""
        self._compact()
        if self._decoded:  # the admit's mixed pass was this step's decode
            self._decoded = False
            return []
        if not self.running:
            return []
        try:
            logits = self._decode()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            # Every running row was in this forward pass and the cache may be half-updated:
            # those requests fail; the ones still waiting and the worker carry on.
            return self._fail_out_of_memory(self.running, "decoding")
        return self._sampled(logits, self.running)

    def _sampled(self, logits: torch.Tensor, sequences: list[Sequence]) -> list[Event]:
        tokens = sample(logits, [s.state for s in sequences])
        events: list[Event] = []
        for sequence, token in zip(sequences, tokens, strict=True):
            events.extend(self._advance(sequence, token))
        self.stepped_at = time.monotonic()
        for request_id in [rid for rid, r in self.requests.items() if r.finished]:
            del self.requests[request_id]
        return events

    def _prefill_threads(self, tokens: int) -> int:
        """The torch threads for prefilling this many prompt tokens: `prefill_threads` for a large enough
        prefill or on an idle engine that stepped moments ago, else the decode steps' setting (0: unchanged)."""
        if tokens >= PARALLEL_PREFILL_MIN_TOKENS:
            return self.prefill_threads
        warm = time.monotonic() - self.stepped_at < self.warm_cores_seconds
        return self.prefill_threads if not self.running and warm else 0

    def _fail_out_of_memory(self, hit: list[Sequence], during: str) -> list[Event]:
        """End the requests of these sequences with an error; the running batch is reset if it was hit."""
        requests = {s.request.request_id: s.request for s in hit}
        logger.error("out of device memory while %s; failing %d request(s)", during, len(requests))
        error = GenerationFailed(f"The device ran out of memory while {during}.", code="out_of_memory")
        events = []
        for request in requests.values():
            for sequence in request.sequences:
                sequence.finish_reason = sequence.finish_reason or "error"
            self.requests.pop(request.request_id, None)
            events.append(request.event("error", error=error.envelope()["error"]))
        self.waiting = deque(s for s in self.waiting if s.request.request_id not in requests)
        if any(s.request.request_id in requests for s in self.running):
            self.running = []
            self.kv = KVBatch()
        release_device_memory(self.loaded.device)
        return events

    def _compact(self) -> None:
        """Finished and cancelled rows leave; the last rows running take their places (see KVBatch.drop)."""
        gone = [i for i, s in enumerate(self.running) if s.finish_reason is not None]
        if gone:
            self.running = [self.running[i] for i in self.kv.drop(gone)]

    def _decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running rows' last tokens and their positions; the cache's mask gains their column."""
        input_ids = torch.tensor([[s.output_ids[-1]] for s in self.running], device=self.loaded.device)
        positions = self.kv.next_positions()
        self.kv.grow()
        return input_ids, positions

    def _prompt_inputs(self, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new prompts left-padded to the longest, their positions and mask."""
        prompts = [s.request.payload.prompt_token_ids for s in sequences]
        return left_padded(prompts, self.pad_id, self.loaded.device)

    @torch.inference_mode()
    def _decode(self) -> torch.Tensor:
        return self.forward.decode(*self._decode_inputs(), self.kv)

    @torch.inference_mode()
    def _mixed(self, sequences: list[Sequence]) -> torch.Tensor:
        """The new prompts' prefill and the running rows' decode step in one forward pass; the logits
        of the running rows, then of the new prompts."""
        input_ids, positions, mask = self._prompt_inputs(sequences)
        decode_ids, decode_positions = self._decode_inputs()
        try:
            logits, layers, decode_logits = self.forward.mixed(  # type: ignore[attr-defined]
                input_ids, positions, mask, decode_ids, decode_positions, self.kv
            )
        except BaseException:
            self.kv.ungrow()  # the running rows' cache as before the pass: they decode on without the newcomers
            raise
        self.kv.append(layers, mask)
        return torch.cat((decode_logits, logits))

    @torch.inference_mode()
    def _prefill(self, sequences: list[Sequence]) -> torch.Tensor:
        """One forward pass over the new prompts, left-padded to the longest."""
        input_ids, positions, mask = self._prompt_inputs(sequences)
        logits, layers = self.forward.prefill(input_ids, positions, mask)
        self.kv.append(layers, mask)
        return logits

    def _advance(self, sequence: Sequence, token: int) -> list[Event]:
        sequence.output_ids.append(token)
        sequence.state.record(token)
        params = sequence.state.params
        finish = None
        if token in self.eos_ids and not params.ignore_eos:
            finish = "stop"
            delta = sequence.detokenizer.flush()
        else:
            delta = sequence.detokenizer.push(token)
        text, hit_stop = sequence.stop.push(delta)
        if hit_stop:
            finish = "stop"
        elif finish is None and self._at_length(sequence):
            finish = "length"
            more, hit_stop = sequence.stop.push(sequence.detokenizer.flush())
            text += more
            finish = "stop" if hit_stop else finish
        if finish and not hit_stop:
            text += sequence.stop.flush()
        request = sequence.request
        events = [request.event("token", index=sequence.index, text=text)] if text else []
        if finish:
            sequence.finish_reason = finish
            usage = Usage(len(request.payload.prompt_token_ids), len(sequence.output_ids))
            events.append(request.event("done", index=sequence.index, finish_reason=finish, usage=usage))
        return events

    def _at_length(self, sequence: Sequence) -> bool:
        generated = len(sequence.output_ids)
        total = len(sequence.request.payload.prompt_token_ids) + generated
        return generated >= sequence.state.params.max_tokens or total >= self.max_model_len
