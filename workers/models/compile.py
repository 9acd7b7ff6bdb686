"""The decode step compiled: the model's forward under torch.compile, attention kept out of the graph.

A step whose every sequence decodes one token (the step that runs most often, and whose time is the
host's on an accelerator: a 28-layer model launches ~2,000 eager operations per step) runs through
the model's forward compiled once with `fullgraph=True`: the whole forward is one graph but for the
attention op of each layer (models/attention/, a registered custom op that writes into a buffer it is
given), which stays an opaque call. Inductor fuses the rest; on a CPU its C++ wrapper calls the
kernels without Python in between.

The batch is padded up to a bucket size (1, 2, 4, then multiples of 8, as vLLM captures its graphs):
padded rows are sequences of one token at position 0 whose keys and values go to the pool's scratch
block, which no request holds. Prefill steps run eagerly.

The token dimension is marked unbacked (`torch._dynamo.decorators.mark_unbacked`, torch 2.13; not
exported at `torch._dynamo`'s top level in this release): one graph serves every bucket, 1 included,
where a dynamic dimension would compile a second graph for size 1. A tensor-parallel rank's forward
holds its collectives (Dynamo makes transformers' DTensor redistributions and tokenline's own
all-reduces functional collectives, which Inductor calls between its kernels); its DTensor layers need
a backed dimension, and guard on whether the batch is smaller than the group, so a rank's buckets
start at the first at or above the group's size (`grouped_buckets`) and one graph serves them all.
Every rank of a group pads a step to the same bucket, so their collectives meet.

Compiled code is cached on disk by Inductor, in TORCHINDUCTOR_CACHE_DIR: the worker process sets it
before torch loads (workers/serving/main.py, `~/.cache/tokenline/inductor` unless the environment
says otherwise), so a restart reuses what an earlier start compiled.

On a CUDA GPU or an Ascend NPU, with an attention backend whose decode steps can be recorded
(`capturable`: flex, npu), each bucket's compiled step is then captured as a device graph
(`torch.cuda.CUDAGraph`, torch_npu's `NPUGraph`) over static buffers: the token ids, the positions,
the backend's metadata (`capture_meta`) and the logits. A step copies its ids, positions and metadata
into its bucket's buffers (`refresh`: the npu backend also updates its attention calls' host
arguments there) and replays the graph: one launch for the whole forward, attention included, where
the compiled step still launches each kernel from the host. The buckets are captured largest first,
into one memory pool that they share, as vLLM does. Where Inductor has no code generator for the
device (an NPU without triton-ascend), `compile: auto` captures the eager step in the same buckets.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.decorators import mark_unbacked

from workers.models.attention import AttentionBackend, Pool, forward_context
from workers.models.step import StepBatch

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to (and including one at or above) `max_batch`."""
    sizes = [1, 2, 4]
    while sizes[-1] < max_batch:
        sizes.append(8 * (sizes[-1] // 8 + 1))
    return [s for s in sizes if s < max_batch] + [next(s for s in sizes if s >= max_batch)]


def grouped_buckets(max_batch: int, world: int) -> list[int]:
    """A tensor-parallel rank's buckets: those of `buckets` from the first at or above the group's size
    (and 2). A rank's DTensor layers guard on whether the token count is below the group's size as
    they choose how to shard (a count under it cannot be split), and a backed dimension (which they
    need) is specialized at 1: from there up a single graph serves every bucket. A step of fewer
    sequences is padded, which a step bound by reading the weights hardly notices."""
    floor = max(2, world)
    return [size for size in buckets(max(max_batch, floor)) if size >= floor]


def generates_code(device: torch.device) -> bool:
    """Whether Inductor has a code generator for `device`: on a CPU its C++ (a compiler is assumed),
    elsewhere Triton (CUDA's torch brings it; on an NPU, torch_npu's Inductor generates Triton code for
    triton-ascend, a package of its own)."""
    return device.type == "cpu" or importlib.util.find_spec("triton") is not None


def wanted(mode: str, device: torch.device) -> bool:
    """`compile`: `auto` compiles on an accelerator whose Inductor code generator is installed, and not
    on a CPU (docs/configuration.md says why)."""
    if mode not in MODES:
        raise ValueError(f"compile {mode!r}: one of {', '.join(MODES)}")
    if mode != "auto" or device.type == "cpu":
        return mode == "on"
    if not generates_code(device):
        logger.info("compile auto: no Triton for Inductor's %s kernels here: the decode step runs eagerly", device.type)
        return False
    return True


def is_decode(batch: StepBatch) -> bool:
    """Every sequence computes one token and draws the next, and only those draws are kept."""
    return all(n == 1 for n in batch.query_len) and all(batch.sample) and batch.keep == batch.query_start


def padded(batch: StepBatch, size: int, scratch_block: int, scratch_ring: int) -> StepBatch:
    """`batch` with sequences of one token at position 0 added up to `size`, their keys and values in
    the scratch block (and ring)."""
    extra = size - batch.num_sequences
    return StepBatch(
        token_ids=batch.token_ids + [0] * extra,
        pending=batch.pending,
        positions=batch.positions + [0] * extra,
        query_start=batch.query_start + list(range(batch.num_tokens, batch.num_tokens + extra)),
        query_len=batch.query_len + [1] * extra,
        context_len=batch.context_len + [1] * extra,
        prompt_len=batch.prompt_len + [1] * extra,
        sample=batch.sample + [True] * extra,
        block_tables=batch.block_tables + [[scratch_block]] * extra,
        rings=batch.rings + [scratch_ring] * extra,
        keep=batch.keep + list(range(batch.num_tokens, batch.num_tokens + extra)),
    )


class CompiledDecode:
    """The model's forward for decode steps of up to `max_batch` sequences, compiled once (the token
    dimension unbacked): `__call__(input_ids, positions)` → logits [tokens, vocab] of every token.
    With `compile=False` the forward stays eager, in buckets all the same: a device without Inductor's
    code generator records that as its graphs (as vllm-ascend records its steps without Inductor)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        max_batch: int,
        compile: bool = True,
        world: int = 1,
        compiled: Callable[[], None] | None = None,
    ) -> None:
        """`world`: the tensor-parallel group's size; `compiled`: called on a rank once Inductor has
        compiled a graph, before the graph first runs (the group's barrier: below)."""
        self.model = model
        self.device = device
        self.grouped = world > 1  # a tensor-parallel rank's model (its forward holds collectives)
        self.sizes = grouped_buckets(max_batch, world) if self.grouped else buckets(max_batch)
        self.compiled = compile
        self.warm = False  # every graph it needs is compiled
        if not compile:
            self._forward = self._eager
        elif compiled is not None:
            # The ranks compile at once and may take very different times; the graph's first collectives
            # would wait for the slowest only `groupTimeout`, so the ranks meet once each has compiled.
            self._forward = torch.compile(
                self._eager, fullgraph=True, dynamic=True, backend=self._inductor_then(compiled)
            )
        else:
            # torch 2.13's C++ wrapper cannot pass a collective its group (the functional collectives take
            # it as an `Any` argument): a rank's graph is called from Inductor's Python wrapper.
            options = {"cpp_wrapper": device.type == "cpu" and not self.grouped}
            self._forward = torch.compile(self._eager, fullgraph=True, dynamic=True, options=options)

    def _inductor_then(self, compiled: Callable[[], None]) -> Callable[..., Any]:
        """Inductor as a backend of torch.compile (its default options), then `compiled()` for each graph
        compiled while warming up."""

        def backend(graph: torch.fx.GraphModule, example_inputs: list[Any], **options: Any) -> Any:
            from torch._inductor.compile_fx import compile_fx

            out = compile_fx(graph, example_inputs, **options)
            if not self.warm:
                compiled()
            return out

        return backend

    def _eager(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        return out.logits[0]

    def bucket(self, sequences: int) -> int | None:
        """The bucket a decode step of `sequences` runs in; None above the largest."""
        return next((s for s in self.sizes if s >= sequences), None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.compiled:
            return self._eager(input_ids, positions)
        if not self.warm:
            if self.grouped:
                # A rank's DTensor layers (transformers' tensor-parallel plan) guard on the token count as
                # they propagate their shardings, which an unbacked dimension cannot (grouped_buckets).
                # The range is the buckets' (torch 2.13 needs a `max` with a `min`; a range of one size
                # would be a static one): what it allows, its guards must (an MoE layer's top-2 routing
                # guards 2 × tokens < 32,767).
                high = max(self.sizes[-1], self.sizes[0] + 1)
                for tensor in (input_ids, positions):
                    torch._dynamo.mark_dynamic(tensor, 0, min=self.sizes[0], max=high)
            else:
                mark_unbacked(input_ids, 0)
                mark_unbacked(positions, 0)
            # The modules' float attributes (norms' epsilons, attention scales, RoPE scaling) are the
            # model's constants. Traced as symbols (what `dynamic=True` makes of them) they cannot stay
            # symbols through Inductor, and Dynamo traces the whole forward again with them fixed:
            # most of a start-up from the compile cache.
            with torch._dynamo.config.patch(specialize_float=True):
                return self._forward(input_ids, positions)
        # Compiled for every shape it will see: only the guards that tell its graphs apart are checked
        # (the weights' guards alone took ~1 ms a step on a 28-layer model).
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self._forward(input_ids, positions)

    def eager(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The same forward, not compiled (the A/B and the tests' reference)."""
        return self._eager(input_ids, positions)


# Records `step()` once and returns what it returned, and a replay that runs the recorded work again over
# the same tensors (writing the same outputs).
Recorder = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None]]]


def device_recorder(device: torch.device) -> Recorder | None:
    """The device's graph capture (CUDA graphs, torch_npu's NPUGraph), its buckets sharing one memory
    pool; None on a device without graphs."""
    api = getattr(torch, device.type, None) if device.type in ("cuda", "npu") else None
    graph_type = getattr(api, "CUDAGraph" if device.type == "cuda" else "NPUGraph", None)
    if api is None or graph_type is None:
        return None
    memory_pool = api.graph_pool_handle()

    def record(step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        graph = graph_type()
        with api.graph(graph, pool=memory_pool):
            out = step()
        return out, graph.replay

    return record


@dataclass
class Captured:
    """One bucket's decode step recorded over static buffers: each step is copied into them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: Any  # the backend's metadata on the device (a dataclass of tensors)
    logits: torch.Tensor
    replay: Callable[[], None]


class CapturedDecode:
    """The compiled decode step of each bucket, recorded once (`capture`) and replayed (`__call__`)."""

    def __init__(self, compiled: CompiledDecode, backend: AttentionBackend, pool: Pool, record: Recorder) -> None:
        self.compiled = compiled
        self.backend = backend
        self.pool = pool
        self.record = record
        self.buckets: dict[int, Captured] = {}

    def capture(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, host_meta: Any) -> None:
        """Record the bucket's step on these inputs (their shapes are every later step's): once run
        as it is, so that everything it compiles or allocates on first use is there, then recorded."""
        meta = self.backend.capture_meta(host_meta, self.pool, input_ids.device)
        input_ids, positions = input_ids.clone(), positions.clone()

        def step() -> torch.Tensor:
            with forward_context(self.backend, self.pool, meta):
                return self.compiled(input_ids, positions)

        step()
        logits, replay = self.record(step)
        self.buckets[size] = Captured(input_ids, positions, meta, logits, replay)

    def __contains__(self, size: int) -> bool:
        return size in self.buckets

    def __call__(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, host_meta: Any) -> torch.Tensor:
        """The step's logits, replayed in its bucket's graph: valid until that bucket's next replay."""
        captured = self.buckets[size]
        captured.input_ids.copy_(input_ids)
        captured.positions.copy_(positions)
        self.backend.refresh(captured.meta, host_meta)
        captured.replay()
        return captured.logits


def replay_on_host(step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """A Recorder for a device without graphs (the tests' CPU): the replay runs `step` again and writes
    its result into the first one's tensor, as a graph writes into the buffers it recorded. What a
    graph's replay reads is only its static buffers; so is what this one reads, where the capture's
    bookkeeping is right."""
    out = step()
    return out, lambda: out.copy_(step())


def log_compiled(what: str, started: float) -> None:
    logger.info("%s compiled in %.1f s", what, time.monotonic() - started)
