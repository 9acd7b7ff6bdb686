"""The model runner: carries out a step on the device and returns the logits to sample from.

It owns the KV pool (models/kv_pool.py) and runs each step, as the engine hands it over in plain arrays
(models/step.py), as one packed pass of the model's own transformers forward, whose attention layers
call tokenline's attention op (models/attention/): the device's backend writes each layer's new keys
and values into the pool and attends over the sequences' block tables. Only the positions the engine
keeps reach the LM head. A decoding sequence's input is the token it drew last; when that token is
still on the device (a step launched before the host read the one before it, engine/core.py), it is
taken from there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from workers.models.attention import ATTENTION, AttentionBackend, forward_context, select_backend
from workers.models.compile import (
    CapturedDecode,
    CompiledDecode,
    Recorder,
    device_recorder,
    is_decode,
    padded,
    wanted,
)
from workers.models.device import release_device_memory, to_device
from workers.models.kv_pool import HostKV, KVLayout, KVShape, PagedKV
from workers.models.loader import LoadedModel
from workers.models.rotary import per_sequence_rotary
from workers.models.step import StepBatch

if TYPE_CHECKING:
    from workers.models.parallel import Collective

logger = logging.getLogger(__name__)

# A step of at least this many tokens runs on the prefill threads; so does any step on an engine
# that stepped less than WARM_CORES_SECONDS ago with no decode in it (its cores are still awake:
# after a longer pause, each parallel region waits for a core that went to sleep).
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


def default_threads(device: torch.device, ranks: int = 1) -> tuple[int, int]:
    """(decode, prefill) torch threads when the settings leave them at 0. On a CPU, a decode step is
    too small to gain from every core and shares the host with the API and Redis: half the cores;
    a prefill gets them all; the `ranks` of a tensor-parallel group share them. On an accelerator the
    host threads only launch kernels: torch's default."""
    if device.type != "cpu":
        return 0, 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (2 * ranks)), max(1, cores // ranks)


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or torch_npu's RuntimeError that says the same."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


@dataclass(frozen=True)
class PoolConfig:
    """How the pool is sized and read: npuMemSize (GiB per device; -1: what the device has free after
    loading the weights), cacheBlockSize, the most tokens a step carries (the sliding-window rings
    hold a window and one step), the attention backend (`attentionBackend`) and whether the decode
    step is compiled (`compile`)."""

    mem_gib: float = -1
    block_size: int = 16
    max_step_tokens: int = 8192
    attention: str = "auto"
    compile: str = "off"  # the decode step compiled (models/compile.py): auto, on, off
    capture: bool = True  # and captured as device graphs where it can be (off: the A/B of bench/steps.py)


class StepSender(Protocol):
    """Where a tensor-parallel leader sends each step before running it (models/parallel.py)."""

    def send(self, batch: StepBatch, input_ids: torch.Tensor) -> None: ...

    def ping(self) -> None: ...


class GroupBroken(RuntimeError):
    """A pass of a tensor-parallel group failed: its ranks no longer agree on which collective comes
    next, so the group cannot serve any more and must be started again."""


def make_runner(
    loaded: LoadedModel,
    max_model_len: int,
    max_batch_size: int,
    pool: PoolConfig | None = None,
    threads: int = 0,
    prefill_threads: int = 0,
    collective: Collective | None = None,
    **runner_options: float,
) -> ModelRunner:
    """The model runner, its attention backend and its KV pool. In a tensor-parallel group each rank
    holds its share of the KV heads, and every rank takes the block count of the rank with the least
    memory (the ranks of a group must all make the same call)."""
    pool = pool or PoolConfig()
    world, shards = 1, 1
    if collective is not None:
        from workers.models.parallel import kv_shards

        world = collective.spec.world
        shards = kv_shards(loaded.model, world)
    context = loaded.context(max_model_len)
    shape = KVShape.of(loaded.model, shards, context)
    config = loaded.model.config.get_text_config()
    softcap = bool(getattr(config, "attn_logit_softcapping", None))
    backend = select_backend(loaded.device, pool.attention, softcap, shape.head_dim, shape.dtype, shape.value_dim)
    block_size = pool.block_size
    if backend.block_size is not None and backend.block_size != block_size:
        logger.info(
            "the %s backend's kernels take %d-token blocks (cacheBlockSize %d)",
            backend.name,
            backend.block_size,
            block_size,
        )
        block_size = backend.block_size
    layout = KVLayout.plan(
        shape,
        loaded.device,
        pool.mem_gib,
        block_size,
        max_batch_size,
        context,  # what a sequence can reach: maxSeqLen, or the model's context where it is shorter
        pool.max_step_tokens,
        rings=backend.rings,
    )
    if collective is not None:
        layout = dataclasses.replace(layout, num_blocks=collective.smallest(layout.num_blocks))
    runner = ModelRunner(loaded, layout, backend, threads, prefill_threads, **runner_options)
    # Every rank of a group probes here, after they agreed on the block count: their forwards' collectives
    # meet, and a model the probe refuses is refused by each of them at the same layer.
    runner.probe()
    compiled = wanted(pool.compile, loaded.device)
    # The device's graphs (a memory pool for them is made here): only where a step may be captured.
    record = device_recorder(loaded.device) if pool.capture and (compiled or pool.compile == "auto") else None
    # `auto` on a device with graphs but no Inductor code generator (an NPU without triton-ascend):
    # the eager decode step is recorded as its graphs.
    recorded_eagerly = not compiled and pool.compile == "auto" and record is not None and backend.capturable
    if recorded_eagerly and collective is not None:
        # its collectives inside a device graph are not tested yet (no group of devices was lent)
        logger.info("a tensor-parallel rank's decode step is not recorded as device graphs: it stays eager")
    elif compiled or recorded_eagerly:
        runner.compile_decode(
            max_batch_size, pool.compile == "on", compiled, world, collective.compiled if collective else None
        )
        if collective is not None:
            runner.agree_on_graphs(collective)
        if record is not None and runner.graphs is not None and collective is not None:
            logger.info("a tensor-parallel rank's decode step is compiled, not captured as device graphs")
        elif record is not None and runner.graphs is not None and not backend.capturable:
            logger.info("the %s attention backend cannot be captured: the decode step is not", backend.name)
        elif record is not None and runner.graphs is not None:
            runner.capture_decode(record)
            if recorded_eagerly and runner.captured is None:
                runner.graphs = None  # not recorded: the plain eager step serves
    logger.info(
        "KV pool: %.3f GiB%s; %d blocks of %d tokens = %d tokens; %d rings of %d tokens for %d sliding-window layers",
        layout.bytes / 2**30,
        f" on each of {world} devices" if world > 1 else "",
        layout.num_blocks,
        layout.block_size,
        layout.num_blocks * layout.block_size,
        layout.rings,
        layout.ring_tokens,
        len(layout.shape.windows) - layout.shape.full_layers,
    )
    return runner


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        layout: KVLayout,
        backend: AttentionBackend,
        threads: int = 0,
        prefill_threads: int = 0,
        warm_cores_seconds: float = WARM_CORES_SECONDS,
    ) -> None:
        self.device = loaded.device
        self.model = loaded.model
        self.model.set_attn_implementation(ATTENTION)
        self.rotary = per_sequence_rotary(self.model)
        self.kv = PagedKV(layout, self.device)
        self.host: HostKV | None = None  # the KV host tier (cpuMemSize), given by the engine
        self.backend = backend
        self.layout = layout
        auto_decode, auto_prefill = default_threads(loaded.device)
        self.threads = threads or auto_decode
        self.prefill_threads = prefill_threads or auto_prefill
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        self.warm_cores_seconds = warm_cores_seconds
        self.stepped_at = -float("inf")  # time.monotonic() at the end of the last pass
        self.last: torch.Tensor | None = None  # the tokens the last step drew, on the device
        self.group: StepSender | None = None  # the other ranks of a tensor-parallel group
        self.graphs: CompiledDecode | None = None  # the compiled decode step
        self.captured: CapturedDecode | None = None  # and its buckets' device graphs

    @property
    def rings(self) -> int:
        return self.layout.rings

    def probe(self) -> None:
        """One eager forward of a padding row (its keys and values in the scratch block) before any
        request: a model whose attention asks for what no backend computes (UnsupportedAttention)
        stops the worker's start, named, rather than failing its first batch and restarting."""
        batch = padded(StepBatch(), 1, self.kv.scratch_block, self.kv.scratch_ring)
        with torch.inference_mode(), torch_threads(self.threads):
            self.forward(batch, torch.zeros(1, dtype=torch.long, device=self.device))

    def compile_decode(
        self,
        max_batch: int,
        required: bool = True,
        compile: bool = True,
        world: int = 1,
        compiled: Callable[[], None] | None = None,
    ) -> None:
        """Compile the decode step now (a model whose rotary embedding depends on each sequence's
        extent, LongRoPE, stays eager), so that no request waits for it. Where it fails and was not
        `required` (`compile: auto`), the step stays eager, with a warning. `compile=False`: the
        bucketed step stays eager, to be recorded as device graphs (`capture_decode`). A tensor-parallel
        rank: `world`, and `compiled`, its group's barrier once its graph compiled (CompiledDecode)."""
        if self.rotary is not None:
            logger.info("the model's LongRoPE rotary embedding runs per sequence: its decode step stays eager")
            return
        started = time.monotonic()
        self.graphs = CompiledDecode(self.model, self.device, max_batch, compile, world, compiled)
        try:
            with torch.inference_mode(), torch_threads(self.threads):
                # One graph of the model serves every bucket (the second call checks it serves both ends);
                # a backend whose kernels compile per batch size (flex) is warmed at every bucket.
                sizes = (
                    self.graphs.sizes
                    if self.backend.compiles_per_batch
                    else sorted({self.graphs.sizes[0], self.graphs.sizes[-1]})
                )
                for size in sizes:
                    self.forward(StepBatch(), torch.empty(0, dtype=torch.long, device=self.device), pad_to=size)
        except Exception as exc:
            if required:
                raise
            logger.warning(
                "compile auto: the decode step did not compile (%s: %s); it runs eagerly", type(exc).__name__, exc
            )
            self.graphs = None
            return
        self.graphs.warm = True
        logger.info(
            "decode step %s for batches of %s in %.1f s",
            "compiled" if compile else "bucketed (eager, to be recorded)",
            ", ".join(map(str, self.graphs.sizes)),
            time.monotonic() - started,
        )

    def agree_on_graphs(self, collective: Collective) -> None:
        """A tensor-parallel rank's decode step compiles where every rank's did: the ranks of a group
        must pad a step alike, or their collectives would not meet (`compile: auto` leaves a step
        that failed to compile eager, on that rank)."""
        if collective.smallest(int(self.graphs is not None)) == 0 and self.graphs is not None:
            logger.warning("another rank's decode step did not compile: this rank's runs eagerly too")
            self.graphs = None

    def capture_decode(self, record: Recorder) -> None:
        """Capture the compiled decode step of every bucket, largest first (models/compile.py). A model
        whose step cannot be captured (one that reads the device from the host mid-step: transformers'
        float32 MoE experts), or whose attention library refuses the recorded calls (a release without
        an argument they pass: TypeError; a shape it refuses: ValueError), keeps the compiled step,
        with a warning."""
        assert self.graphs is not None, "capture_decode before compile_decode"
        started = time.monotonic()
        captured = CapturedDecode(self.graphs, self.backend, self.kv, record)
        try:
            with torch.inference_mode():
                for size in reversed(self.graphs.sizes):
                    batch = padded(StepBatch(), size, self.kv.scratch_block, self.kv.scratch_ring)
                    ids = torch.zeros(size, dtype=torch.long, device=self.device)
                    captured.capture(size, ids, torch.zeros_like(ids), self.backend.prepare(batch, self.kv))
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.warning("the decode step cannot be captured (%s): it runs compiled, not captured", exc)
            self.captured = None
            return
        self.captured = captured
        logger.info(
            "decode step captured as %d device graphs in %.1f s", len(self.graphs.sizes), time.monotonic() - started
        )

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run the step: the logits [len(batch.keep), vocab] of the places it keeps, in float32."""
        try:
            with torch_threads(self._threads(batch)):
                return self._run(batch)
        finally:
            self.stepped_at = time.monotonic()

    def advance(self, tokens: torch.Tensor) -> None:
        """The tokens just drawn, on the device: the rows a next step's `pending` refers to."""
        self.last = tokens

    def idle(self) -> None:
        """Between steps while there is no work: a tensor-parallel leader tells its followers it is alive."""
        if self.group is not None:
            self.group.ping()

    def cool_down(self) -> None:
        """Count the cores as idle: the host is busy elsewhere (a client left; the API unwinds its
        stream), so the next short prefill stays on the decode threads."""
        self.stepped_at = -float("inf")

    def reset(self) -> None:
        """After a failed pass: forget the drawn tokens on the device."""
        self.last = None
        release_device_memory(self.device)

    def _threads(self, batch: StepBatch) -> int:
        prompt = batch.prompt_tokens
        if prompt >= PARALLEL_PREFILL_MIN_TOKENS:
            return self.prefill_threads
        warm = time.monotonic() - self.stepped_at < self.warm_cores_seconds
        return self.prefill_threads if prompt and not batch.decodes and warm else 0

    @torch.inference_mode()
    def _run(self, batch: StepBatch) -> torch.Tensor:
        input_ids = self._input_ids(batch)
        if self.group is None:
            return self.forward(batch, input_ids)
        self.group.send(batch, input_ids)
        try:
            return self.forward(batch, input_ids)
        except Exception as exc:
            raise GroupBroken(f"a pass of the device group failed: {type(exc).__name__}: {exc}") from exc

    def _input_ids(self, batch: StepBatch) -> torch.Tensor:
        """The step's token ids on the device, the draws still there taken from the last step's."""
        input_ids = to_device(torch.tensor(batch.token_ids, dtype=torch.long), self.device)
        if batch.pending:
            at, source = (
                to_device(torch.tensor(i, dtype=torch.long), self.device) for i in zip(*batch.pending, strict=True)
            )
            assert self.last is not None
            input_ids[at] = self.last[source]
        return input_ids

    @torch.inference_mode()
    def forward(self, batch: StepBatch, input_ids: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
        """The packed pass: the logits [len(batch.keep), vocab] of the kept positions, in float32. A
        decode step runs compiled where it is (padded to its bucket, or to `pad_to`)."""
        graphs = self.graphs
        if graphs is not None and is_decode(batch):
            size = pad_to or graphs.bucket(batch.num_sequences)
            if size is not None:
                return self._compiled(graphs, batch, input_ids, size)
        device = self.device
        meta = self.backend.load(self.backend.prepare(batch, self.kv), device)
        if self.rotary is not None:
            self.rotary.segments = [
                (place, place + count, end - count, prompt)
                for place, count, end, prompt in zip(
                    batch.query_start, batch.query_len, batch.context_len, batch.prompt_len, strict=True
                )
            ]
        with forward_context(self.backend, self.kv, meta):
            out = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=to_device(torch.tensor(batch.positions, dtype=torch.long), device).unsqueeze(0),
                use_cache=False,
                logits_to_keep=to_device(torch.tensor(batch.keep, dtype=torch.long), device),
            )
        return out.logits[0].float()

    def _compiled(self, graphs: CompiledDecode, batch: StepBatch, input_ids: torch.Tensor, size: int) -> torch.Tensor:
        rows = batch.num_sequences
        batch = padded(batch, size, self.kv.scratch_block, self.kv.scratch_ring)
        input_ids = torch.cat([input_ids, input_ids.new_zeros(size - rows)])
        positions = to_device(torch.tensor(batch.positions, dtype=torch.long), self.device)
        host_meta = self.backend.prepare(batch, self.kv)
        if self.captured is not None and size in self.captured:
            # The graph's logits are its buffer, overwritten by the bucket's next replay.
            return self.captured(size, input_ids, positions, host_meta)[:rows].to(torch.float32, copy=True)
        with forward_context(self.backend, self.kv, self.backend.load(host_meta, self.device)):
            logits = graphs(input_ids, positions)
        return logits[:rows].float()
