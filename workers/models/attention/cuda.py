"""CUDA GPUs with FlashInfer installed (optional: `pip install flashinfer-python`, 0.2.1.post2 or later;
`auto` takes it for float16 and bfloat16 models with heads of 64, 128 or 256 dimensions, what its
kernels take, and flex otherwise): its paged prefill
kernel attends the whole packed step (decodes are one-token queries) over the pool viewed as
[blocks, block_size, KV heads, dim] (FlashInfer's NHD layout, any block size), with sliding windows
and logit soft-capping in the kernel. Keys and values are written by slot with `index_copy_`.

The kernel is planned once per step and window on the host (`plan`: query and page offsets, page
indices, the last page's fill), then run for every layer of that window. Without FlashInfer a GPU is
served by the flex backend.

A decode step captured as a CUDA graph (models/compile.py) runs FlashInfer's decode wrapper in its
CUDA-graph mode instead, as vLLM does: per bucket, one `BatchDecodeWithPagedKVCacheWrapper` for each
window, scale and soft-cap of the model (`use_cuda_graph=True`, the tensor-core kernels, which take
any number of query heads per KV head), over buffers of the bucket's that its `plan` copies each step
into (page offsets, the pages, the last page's fill). `plan` is host work and cannot be captured: the
graph records only `run`, and before every replay each of the bucket's kernels is planned again with
that step's pages (`refresh`), which its graph-mode kernels read from those buffers and its workspace.
Each decode wrapper holds 8 MiB of device memory and 8 MiB of pinned host memory of its own (its
schedule), as many as buckets times kernels.

Any FlashInfer plan (the prefill wrapper's in an eager step too) stages the schedule it computed in a
pinned host buffer of its wrapper's and copies it to the device without waiting. The engine prepares
a step while the device still runs the one before, so before a wrapper's next plan overwrites that
buffer the host waits until the last plan's copies have run (an event recorded after them). The
step's host arrays that `plan` copies are pinned for the same reason (models/device.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.models.attention import Pool, sequence_blocks
from workers.models.device import host_to, to_device
from workers.models.step import StepBatch

# FlashInfer's scratch for a step whose keys it splits (vLLM's default; its docstring's 128 MiB overflows
# on large steps: vLLM PRs #40383, #48428).
WORKSPACE_BYTES = 256 * 2**20


@dataclass
class FlashInferStep:
    """FlashInfer's paged layout of a step: query offsets [sequences + 1], page offsets [sequences + 1],
    the pages [sum of pages], the last page's fill [sequences] (on the host: `plan` reads them and
    copies what its kernels need to the device), the write slots [tokens] (on the device, once loaded)."""

    query_offsets: Any
    page_offsets: Any
    pages: Any
    last_page_len: Any
    slots: Any


Kernel = tuple[int, float, float]  # a kernel's window, scale and soft-cap
# What a plan takes of a layer: (query heads, KV heads, head size, page size), and the keyword options.
Planned = tuple[tuple[int, int, int, int], dict[str, Any]]


@dataclass
class FlashInferDecode:
    """One bucket's decode step as its CUDA graph reads it: the write slots [bucket] and FlashInfer's
    decode buffers, the page offsets [bucket + 1], the pages [bucket × the longest context's pages] and
    the last page's fill [bucket] (int32, on the device), which every kernel of the bucket's (a decode
    wrapper and the options it is planned with, by window, scale and soft-cap) is planned into before
    each replay; `step` is the step last planned (its arrays on the host); `planned` an event recorded
    after the last plans' copies (None off CUDA)."""

    slots: torch.Tensor
    page_offsets: torch.Tensor
    pages: torch.Tensor
    last_page_len: torch.Tensor
    step: FlashInferStep
    kernels: dict[Kernel, tuple[Any, Planned]] = field(default_factory=dict)
    planned: Any = None


class FlashInferBackend:
    name = "flashinfer"
    block_size = None
    rings = False
    softcap = True
    capturable = True
    compiles_per_batch = False

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None
        # One wrapper per window, scale and soft-cap (a plan holds them; the layers of one model share
        # them but for the window).
        self._kernels: dict[Kernel, Any] = {}
        self._planned: set[Kernel] = set()  # planned for the current step
        self._staged: dict[Kernel, Any] = {}  # each prefill kernel's last plan's copies (`_staged`)

    def prepare(self, batch: StepBatch, pool: Pool) -> FlashInferStep:
        size = pool.block_size
        pages: list[int] = []
        counts, last = [], []
        for end, blocks in zip(batch.context_len, batch.block_tables, strict=True):
            used = -(-end // size)
            pages += blocks[:used]
            counts.append(used)
            last.append(end - (used - 1) * size)

        def offsets(values: list[int]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(values)], dtype=torch.int32)

        return FlashInferStep(
            offsets(batch.query_len),
            offsets(counts),
            torch.tensor(pages, dtype=torch.int32),
            torch.tensor(last, dtype=torch.int32),
            torch.tensor(batch.slots(size), dtype=torch.long),
        )

    def load(self, meta: FlashInferStep, device: torch.device) -> FlashInferStep:
        loaded = _pinned(meta, device)
        loaded.slots = to_device(meta.slots, device)
        self._planned = set()  # a new step: each kernel is planned by its first layer
        return loaded

    def forward(
        self,
        pool: Pool,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        meta: FlashInferStep | FlashInferDecode,
        window: int,
        scale: float,
        softcap: float,
    ) -> None:
        keys, values = pool.keys[layer], pool.values[layer]
        keys.index_copy_(0, meta.slots, key.to(keys.dtype))
        values.index_copy_(0, meta.slots, value.to(values.dtype))
        kernel_key = (window, scale, softcap)
        shape = (query.shape[1], keys.shape[1], keys.shape[2], pool.block_size)
        options = {
            "sm_scale": scale,
            "window_left": window - 1 if window else -1,
            "logits_soft_cap": softcap or None,
            "q_data_type": query.dtype,
            "kv_data_type": keys.dtype,
        }
        if isinstance(meta, FlashInferDecode):
            kernel = self._decode_kernel(meta, kernel_key, (shape, options), query.device)
        else:
            kernel = self._plan(meta, kernel_key, (shape, options), query.device)
        blocks = keys.shape[0] // pool.block_size
        paged = (
            keys.view(blocks, pool.block_size, *keys.shape[1:]),
            values.view(blocks, pool.block_size, *keys.shape[1:]),
        )
        kernel.run(query.contiguous(), paged, out=out)

    def _plan(self, meta: FlashInferStep, key: Kernel, planned: Planned, device: torch.device) -> Any:
        """The prefill kernel of the layer's window, scale and soft-cap, planned for this step (once per
        step)."""
        import flashinfer

        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace(device), "NHD")
        if key not in self._planned:
            _wait(self._staged.pop(key, None))
            shape, options = planned
            kernel.plan(
                meta.query_offsets, meta.page_offsets, meta.pages, meta.last_page_len, *shape, causal=True, **options
            )
            self._staged[key] = _staged(device)
            self._planned.add(key)
        return kernel

    def workspace(self, device: torch.device) -> torch.Tensor:
        """FlashInfer's float scratch, one for every kernel (they run one after another on one stream),
        zeroed as its wrappers ask before first use."""
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def capture_meta(self, meta: FlashInferStep, pool: Pool, device: torch.device) -> FlashInferDecode:
        size = len(meta.last_page_len)

        def buffer(length: int) -> torch.Tensor:
            return torch.zeros(length, dtype=torch.int32, device=device)

        return FlashInferDecode(
            to_device(meta.slots, device), buffer(size + 1), buffer(size * sequence_blocks(pool)), buffer(size), meta
        )

    def refresh(self, captured: FlashInferDecode, meta: FlashInferStep) -> None:
        device = captured.pages.device
        _wait(captured.planned)
        host_to(captured.slots, meta.slots)
        captured.step = step = _pinned(meta, device)
        pages = to_device(step.pages, device)  # pinned already: copied without another pinned copy
        for kernel, planned in captured.kernels.values():
            _plan_decode(kernel, step, pages, planned)
        captured.planned = _staged(device)

    def _decode_kernel(self, meta: FlashInferDecode, key: Kernel, planned: Planned, device: torch.device) -> Any:
        """The bucket's decode kernel of the layer's window, scale and soft-cap: made and planned with
        the bucket's step on its first layer's call (the run before the graph is recorded)."""
        made = meta.kernels.get(key)
        if made is not None:
            return made[0]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"FlashInfer's decode kernel for window {key[0]} was not planned before the capture")
        import flashinfer

        kernel = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace(device),
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=meta.page_offsets,
            paged_kv_indices_buffer=meta.pages,
            paged_kv_last_page_len_buffer=meta.last_page_len,
        )
        _plan_decode(kernel, meta.step, to_device(meta.step.pages, device), planned)
        meta.kernels[key] = (kernel, planned)
        return kernel


def _plan_decode(kernel: Any, step: FlashInferStep, pages: torch.Tensor, planned: Planned) -> None:
    """Plan a graph-mode decode wrapper for `step`: the page offsets and last pages' fill from the host
    (FlashInfer reads them there, and copies them into its buffers), the pages already on the device
    (from the host it would copy them waiting)."""
    shape, options = planned
    kernel.plan(step.page_offsets, pages, step.last_page_len, *shape, **options)


def _pinned(step: FlashInferStep, device: torch.device) -> FlashInferStep:
    """The step's host arrays in pinned memory on CUDA: FlashInfer's `plan` copies them to the device
    without waiting, and a copy from pageable memory would first wait for the device's queue to drain
    (models/device.py)."""
    if device.type != "cuda":
        return dataclasses.replace(step)
    arrays = ("query_offsets", "page_offsets", "pages", "last_page_len")
    return dataclasses.replace(step, **{name: getattr(step, name).pin_memory() for name in arrays})


def _staged(device: torch.device) -> Any:
    """An event after a plan's copies (None off CUDA). A FlashInfer wrapper's `plan` stages what it
    computed in a pinned host buffer of its own and copies it to the device without waiting; the
    wrapper's next plan waits for this event before it overwrites that buffer (the host may prepare
    the next step while the device still runs this one)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _wait(event: Any) -> None:
    if event is not None:
        event.synchronize()
