"""The engine core: schedule → run → sample → process outputs, one step at a time.

It knows nothing of Redis or RQ: the serving layer (workers/serving/) adds requests, aborts them,
calls `step` and publishes the events it returns. Iteration-level (continuous) batching: requests
join and leave between steps. Faults stay with the requests they hit: a request whose output
processing fails gets its own error event; when a pass of several sequences fails, each runs alone
and only those that fail alone end with an error; the engine carries on with the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from schemas.config import ModelConfig, Settings
from schemas.errors import ConstraintFailed, ContextLengthExceeded, GenerationFailed, TokenlineError
from schemas.job import Event, JobPayload
from schemas.vocabulary import Vocabulary
from workers.engine.batch import Pass, split, step_batch
from workers.engine.grammar import GrammarCompiler
from workers.engine.kv_cache import KVCacheManager
from workers.engine.output import OutputProcessor, prompt_events
from workers.engine.request import Request, Sequence
from workers.engine.sampler import Sampler, TokenLogprobs
from workers.engine.scheduler import Scheduled, Scheduler, SchedulerOutput
from workers.engine.stats import EngineStats, now
from workers.models.device import release_device_memory
from workers.models.kv_pool import HostKV
from workers.models.loader import LoadedModel
from workers.models.parallel import Collective, Leader
from workers.models.runner import (
    GroupBroken,
    ModelRunner,
    PoolConfig,
    is_out_of_memory,
    make_runner,
)

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """A step's events, and the requests that ended in it (their last event is among the events)."""

    events: list[Event] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)

    def merge(self, other: StepResult) -> None:
        self.events += other.events
        self.ended += other.ended


@dataclass
class Launched:
    """A step whose pass and draws were queued on the device: its plan, the sequence of each drawn
    token, the tokens' host copy and the device event that marks it complete (None on a CPU), and
    the log probabilities of the rows that asked (with how many alternatives each wants)."""

    plan: SchedulerOutput
    rows: list[Sequence]
    tokens: torch.Tensor
    ready: torch.Event | None
    logprobs: TokenLogprobs | None = None
    wanted: list[int] | None = None


def to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Event | None]:
    """Start the copy of the drawn ids to the host; on an accelerator it runs behind the queued work."""
    if tokens.device.type == "cpu":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.Event(device=tokens.device)
    ready.record()
    return host, ready


# The prompt tokens a step carries beside running decodes, by default. On an accelerator a decode step
# is bound by reading the weights, and a chunk of 512 tokens costs about as much. On a CPU a step's cost
# grows with its tokens: beside D decodes it carries max(16, D) prompt tokens, so that a long prompt
# holds the streams back by a bounded factor however many run, and newcomers still enter quickly when
# many do (docs/benchmarks.md, "no stall").
ACCELERATOR_PREFILL_CHUNK = 512
CPU_PREFILL_CHUNK, CPU_CHUNK_PER_DECODE = 16, 1


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool and the scheduler's limits, by their MindIE names: cacheBlockSize, npuMemSize (GiB
    per device; -1: what the device has free after loading the weights), maxPrefillTokens,
    maxPrefillBatchSize (0: maxBatchSize), maxPreemptCount (preemptions a step may make), whether
    full blocks are shared between requests (prefix caching), prefillChunkTokens: the most prompt
    tokens a step carries beside running decodes (0: the device's default, above), and cpuMemSize
    (GiB of host memory for the KV host tier; 0: none)."""

    block_size: int = 16
    mem_gib: float = -1
    max_prefill_tokens: int = 8192
    max_prefill_batch_size: int = 0
    max_preempt: int = 4
    prefix_caching: bool = True
    prefill_chunk: int = 0
    attention: str = "auto"  # attentionBackend (models/attention/)
    compile: str = "off"  # the decode step compiled (models/compile.py); the worker's default is auto
    host_gib: float = 0.0
    capture: bool = True  # a compiled step captured as device graphs where it can be (bench/steps.py's A/B)

    @classmethod
    def from_settings(cls, settings: Settings, model: ModelConfig) -> CacheConfig:
        """The worker's settings for `model` (its own npuMemSize where its ModelConfig has one)."""
        return cls(
            block_size=settings.cache_block_size,
            mem_gib=settings.npu_mem_size if model.npu_mem_size is None else model.npu_mem_size,
            max_prefill_tokens=settings.max_prefill_tokens,
            max_prefill_batch_size=settings.max_prefill_batch_size,
            max_preempt=settings.max_preempt_count,
            prefix_caching=settings.prefix_caching,
            prefill_chunk=settings.prefill_chunk_tokens,
            attention=settings.attention_backend,
            compile=settings.compile,
            host_gib=settings.cpu_mem_size if model.cpu_mem_size is None else model.cpu_mem_size,
        )

    @property
    def pool(self) -> PoolConfig:
        return PoolConfig(
            self.mem_gib, self.block_size, self.max_prefill_tokens, self.attention, self.compile, self.capture
        )


class EngineCore:
    @classmethod
    def build(
        cls,
        loaded: LoadedModel,
        max_model_len: int,
        max_batch_size: int = 1,
        threads: int = 0,
        prefill_threads: int = 0,
        overlap: bool | None = None,
        cache: CacheConfig | None = None,
        collective: Collective | None = None,
        **runner_options: float,
    ) -> EngineCore:
        """An engine with its own model runner and KV pool on the loaded model; with `collective`, the
        leader of a tensor-parallel group (rank 0), whose followers run models/parallel.py `follow`."""
        runner = make_runner(
            loaded,
            max_model_len,
            max_batch_size,
            (cache or CacheConfig()).pool,
            threads,
            prefill_threads,
            collective,
            **runner_options,
        )
        if collective is not None:
            runner.group = Leader(collective)
        return cls(loaded, runner, max_model_len, max_batch_size, overlap, cache)

    def __init__(
        self,
        loaded: LoadedModel,
        runner: ModelRunner,
        max_model_len: int,
        max_batch_size: int,
        overlap: bool | None = None,
        cache: CacheConfig | None = None,
    ) -> None:
        cache = cache or CacheConfig()
        self.loaded = loaded
        self.vocabulary = Vocabulary.of(loaded.tokenizer)
        self.last_rows: dict[int, int] = {}  # id(sequence) → its row in the last step's draws
        # Launch step N + 1 before reading step N's tokens: on an accelerator the host's work for step N
        # (detokenizing, stops, events) then runs while the device computes. On a CPU the "device" is
        # the host itself and a step's events would only come a step later: off unless asked for.
        self.overlap = loaded.device.type != "cpu" if overlap is None else overlap
        self.runner = runner
        pool_tokens = runner.kv.num_blocks * runner.kv.block_size
        context = loaded.context(max_model_len)
        self.max_model_len = min(context, pool_tokens)
        if pool_tokens < context:
            logger.warning(
                "the KV pool holds %d tokens, fewer than one full context (%d): requests are limited to it",
                pool_tokens,
                context,
            )
        self.max_batch_size = max_batch_size
        host_blocks = self._host_tier(runner, cache.host_gib)
        self.kv = KVCacheManager(
            runner.kv.num_blocks, runner.kv.block_size, cache.prefix_caching, runner.rings, host_blocks
        )
        self.scheduler = Scheduler(
            self.kv,
            max_batch_size,
            cache.max_prefill_tokens,
            cache.max_prefill_batch_size,
            cache.max_preempt,
            *self._chunking(cache.prefill_chunk, loaded.device),
        )
        self.sampler = Sampler(loaded.vocab_size, loaded.device, loaded.files.eos_token_ids)
        self.output = OutputProcessor(loaded.files.eos_token_ids)
        self._grammars: GrammarCompiler | None = None  # built once (a worker builds it before it serves)
        self._grammars_refused: ConstraintFailed | None = None  # why llguidance cannot read the tokenizer
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()

    @staticmethod
    def _host_tier(runner: ModelRunner, gib: float) -> int:
        """The host tier's blocks (cpuMemSize), its memory given to the runner; 0 where it is off."""
        if gib <= 0:
            return 0
        if runner.rings:
            logger.info("cpuMemSize: no host tier for a model with sliding-window rings (its rings are not in blocks)")
            return 0
        if runner.group is not None:
            logger.info("cpuMemSize: no host tier for a tensor-parallel group yet")
            return 0
        blocks = HostKV.blocks_for(runner.layout, gib)
        if blocks:
            runner.host = HostKV(runner.kv, blocks, runner.device)
            logger.info("KV host tier: %.3f GiB, %d blocks", gib, blocks)
        return blocks

    @staticmethod
    def _chunking(setting: int, device: torch.device) -> tuple[int, int]:
        """(prefill chunk, tokens per decode) for the scheduler: the setting, or the device's default."""
        if setting:
            return setting, 0
        if device.type == "cpu":
            return CPU_PREFILL_CHUNK, CPU_CHUNK_PER_DECODE
        return ACCELERATOR_PREFILL_CHUNK, 0

    def idle(self) -> None:
        """Called between the serving layer's waits while there is no work: the batch lets go of the
        sequences that finished in the last step (a next step would have), so that the batch, the pool
        and the metrics read empty."""
        self._release(self.scheduler.release_finished())
        self.runner.idle()

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def constrained(self) -> bool:
        """Some running sequence follows a grammar or bans a bad word of several tokens: its next mask
        needs the token just drawn, so steps do not overlap while it runs."""
        return any(s.matcher is not None or s.params.reads_output for r in self.requests.values() for s in r.sequences)

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar engine over the model's tokenizer; ConstraintFailed, at once, where llguidance
        cannot read the tokenizer (tried once: each try holds the GIL for seconds)."""
        if self._grammars_refused is not None:
            raise self._grammars_refused
        if self._grammars is None:
            files = self.loaded.files
            try:
                self._grammars = GrammarCompiler(files.tokenizer_file, self.loaded.vocab_size, files.eos_token_ids)
            except ValueError as exc:
                self._grammars_refused = ConstraintFailed(
                    f"Constrained decoding is unavailable for this model: the grammar engine cannot read its "
                    f"tokenizer ({exc})."
                )
                raise self._grammars_refused from None
        return self._grammars

    def add_request(self, payload: JobPayload) -> None:
        """Queue a request's sequences; ContextLengthExceeded if its prompt fills the context (the KV
        pool may hold less than the model's), ConstraintFailed if its grammar does not compile for the
        tokenizer, ValueError if it cannot run otherwise."""
        if len(payload.prompt_token_ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"The prompt has {len(payload.prompt_token_ids)} tokens, which leaves no room to generate "
                f"within the model's {self.max_model_len}-token context."
            )
        if payload.request_id in self.requests:
            raise ValueError(f"request {payload.request_id} is already running")
        grammars = self.grammars if payload.sampling.grammar else None
        request = Request.create(payload, self.vocabulary, self.max_model_len, grammars)
        self.requests[payload.request_id] = request
        self.scheduler.add(request)

    def cancel(self, request_id: str) -> list[Event]:
        """Drop a request (its client left); its rows leave the batch at the next step."""
        request = self._end(request_id, "cancelled")
        if request is None:
            return []
        self.runner.cool_down()
        return [request.event("cancelled")]

    def fail(self, request_id: str, error: TokenlineError) -> list[Event]:
        """End a request with an error event."""
        request = self._end(request_id, "error")
        return [request.event("error", error=error.envelope()["error"])] if request else []

    def fail_all(self, message: str) -> list[Event]:
        """End every request with an error event and start from an empty batch."""
        error = GenerationFailed(message)
        events = [e for rid in list(self.requests) for e in self.fail(rid, error)]
        self.runner.reset()  # the failed sequences leave the scheduler's batch at its next plan
        return events

    def step(self) -> StepResult:
        """One step, start to end: `launch`, then `finish`."""
        launched, result = self.launch()
        if launched is not None:
            result.merge(self.finish(launched))
        return result

    def launch(self) -> tuple[Launched | None, StepResult]:
        """Schedule and start a step: the forward pass and the draws are queued on the device, and the
        drawn ids start their copy to the host; nothing waits for them. The next `launch` may come
        before this step's `finish` (the engine thread processes step N's outputs while the device
        runs step N + 1): a sequence that step N ends then still runs in step N + 1, whose token for it
        is dropped. The result holds the events of a pass that failed."""
        plan = self.scheduler.schedule()
        self._release(plan.finished)
        out, into = self.kv.take_copies()
        if out or into:  # before the pass: it reads what comes in and writes over what goes out
            self.runner.host.copy(out, into)  # type: ignore[union-attr]
        result = StepResult()
        if plan.empty:
            result.events += self._waiting(plan)
            return None, result
        for item in plan.scheduled:
            request = item.sequence.request
            if not request.scheduled:
                request.scheduled = True
                self.stats.queue_times.append(now() - request.arrived)
        try:
            executed = self._execute(plan, result)
            if executed is None:
                result.events += self._waiting(plan)
                return None, result
            drawn = self.sampler.draw(executed.logits, executed.rows)
            self.runner.advance(drawn.tokens)
            self.last_rows = {id(s): i for i, s in enumerate(executed.rows)}
            if executed.scores:
                result.events += prompt_events(executed.score_logits, executed.scores)
        except GroupBroken:
            raise  # the engine cannot go on: the serving layer fails every request and stops
        except Exception as exc:
            self._forward_failed(plan.scheduled, exc, result)
            result.events += self._waiting(plan)
            return None, result
        for item in plan.scheduled:
            sequence = item.sequence
            self.kv.commit(sequence.table, item.start + item.count, sequence.length, sequence.tokens)
        # The logprobs stay on the device until `finish` reads them, after the step's tokens are ready.
        return Launched(plan, executed.rows, *to_host(drawn.tokens), drawn.logprobs, drawn.wanted), result

    def finish(self, launched: Launched) -> StepResult:
        """Read a launched step's tokens (waiting for the device if need be) and process them."""
        result = StepResult()
        try:
            if launched.ready is not None:
                launched.ready.synchronize()
            tokens = launched.tokens.tolist()
        except Exception as exc:  # an asynchronous device error surfaces here
            self._forward_failed(launched.plan.scheduled, exc, result)
            result.events += self._waiting(launched.plan)
            return result
        logprobs = launched.logprobs.entries(tokens, launched.wanted or []) if launched.logprobs else {}
        at = now()
        for row, (sequence, token) in enumerate(zip(launched.rows, tokens, strict=True)):
            if sequence.finished:  # its request ended while the pass ran (a sibling's fault)
                continue
            try:
                result.events += self.output.process(sequence, token, logprobs.get(row))
                self._timed(sequence, at)
            except ConstraintFailed as exc:  # the request's schema, not the engine: a 400, and no traceback
                logger.warning("request_id=%s: %s", sequence.request.request_id, exc.message)
                result.events += self.fail(sequence.request.request_id, exc)
            except Exception as exc:
                logger.exception("output processing failed request_id=%s", sequence.request.request_id)
                error = GenerationFailed(f"Generation failed while processing the output: {type(exc).__name__}.")
                result.events += self.fail(sequence.request.request_id, error)
        result.events += self._waiting(launched.plan)
        self._collect(result)
        return result

    @staticmethod
    def _waiting(plan: SchedulerOutput) -> list[Event]:
        """A "waiting" event for each sequence the step preempted, after any token it had in flight:
        the API then bounds its silence as a queued request's, not as a running one's (app/relay.py)."""
        return [s.request.event("waiting", s.index) for s in plan.preempted if not s.finished]

    def _timed(self, sequence: Sequence, at: float) -> None:
        """Count a sequence's new token (if the step gave it one) and time it. The request's prompt is
        counted with its first token (its prefill is done), as vLLM counts it: a request cancelled
        later counts it too, one cancelled before it does not."""
        request = sequence.request
        if not request.prompt_counted:
            request.prompt_counted = True
            self.stats.prompt_tokens += len(request.payload.prompt_token_ids)
        if sequence.last_token_at is None and not sequence.output_ids:
            return  # max_tokens 0: nothing generated
        if sequence.last_token_at is None:
            if sequence.index == 0:
                self.stats.first_token_times.append(at - sequence.request.arrived)
        else:
            self.stats.inter_token_times.append(at - sequence.last_token_at)
        sequence.last_token_at = at
        self.stats.generation_tokens += 1

    def _collect(self, result: StepResult) -> None:
        """Requests that failed in this step, or whose last sequence finished in it, are done."""
        finished = set()
        for event in result.events:
            if event.kind == "done":
                finished.add(event.request_id)
                self.stats.finished.append(event.finish_reason or "stop")
            elif event.final:
                result.ended.append(event.request_id)
        for request_id in finished:
            request = self.requests.get(request_id)
            if request is not None and request.finished:
                del self.requests[request_id]
                result.ended.append(request_id)
                self.stats.e2e_times.append(now() - request.arrived)

    def _end(self, request_id: str, reason: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for sequence in request.sequences:
            if sequence.finish_reason is None:  # counted as vLLM counts it: aborted, or failed
                self.stats.finished.append("abort" if reason == "cancelled" else "error")
            sequence.finish_reason = sequence.finish_reason or reason
            self.sampler.release(sequence)
        self.scheduler.remove(request)
        return request

    def _release(self, sequences: list[Sequence]) -> None:
        """Finished sequences left the batch (the scheduler freed their blocks): their penalty history is free."""
        for sequence in sequences:
            self.sampler.release(sequence)

    def _execute(self, plan: SchedulerOutput, result: StepResult) -> Pass | None:
        """The plan's pass. If a pass of several sequences fails, each runs alone (a failed pass leaves
        every other sequence's cache as it was: what it wrote past their computed tokens is written
        again), and only those that fail alone fail; None if none is left."""
        try:
            return self._pass(plan)
        except GroupBroken:
            raise
        except Exception as exc:
            if len(plan.scheduled) == 1:
                raise
            logger.warning("a pass of %d sequences failed (%r); running them one at a time", len(plan.scheduled), exc)
        passes = []
        for item in plan.scheduled:
            if item.sequence.finished:  # a sibling of a request that failed alone
                continue
            try:
                passes.append(self._pass(SchedulerOutput(scheduled=[item])))
            except Exception as exc:
                self._forward_failed([item], exc, result)
        return Pass.join(passes) if passes else None

    def _pass(self, plan: SchedulerOutput) -> Pass:
        """The runner's pass over the plan's arrays, its logits split by sequence."""
        batch, rows, scores = step_batch(plan, self.last_rows)
        return split(self.runner.execute(batch), rows, scores)

    def _forward_failed(self, scheduled: list[Scheduled], exc: Exception, result: StepResult) -> None:
        """End the requests of a pass that failed."""
        requests = {s.sequence.request.request_id for s in scheduled}
        if is_out_of_memory(exc):
            release_device_memory(self.runner.device)
            logger.error("out of device memory; failing %d request(s)", len(requests))
            error = GenerationFailed("The device ran out of memory during generation.", code="out_of_memory")
        else:
            logger.error("forward pass failed; failing %d request(s)", len(requests), exc_info=exc)
            error = GenerationFailed(f"Generation failed: {type(exc).__name__}.")
        for request_id in requests:
            result.events += self.fail(request_id, error)
        self._collect(result)
