"""CUDA GPUs with FlashInfer installed (optional: `pip install flashinfer-python`, 0.2.1.post2 or later;
`auto` takes it for float16 and bfloat16 models with heads of 64, 128 or 256 dimensions, what its
kernels take, and flex otherwise): its paged prefill
kernel attends the whole packed step (decodes are one-token queries) over the pool viewed as
[blocks, block_size, KV heads, dim] (FlashInfer's NHD layout, any block size), with sliding windows
and logit soft-capping in the kernel. Keys and values are written by slot with `index_copy_`.

The kernel is planned once per step and window on the host (`plan`: query and page offsets, page
indices, the last page's fill), then run for every layer of that window. Without FlashInfer a GPU is
served by the flex backend.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from workers.models.attention import Pool
from workers.models.device import to_device
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


class FlashInferBackend:
    name = "flashinfer"
    block_size = None
    rings = False
    softcap = True
    capturable = False
    compiles_per_batch = False

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None
        # One wrapper per window, scale and soft-cap (a plan holds them; the layers of one model share
        # them but for the window).
        self._kernels: dict[tuple[int, float, float], Any] = {}
        self._planned: set[tuple[int, float, float]] = set()  # planned for the current step

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
        loaded = dataclasses.replace(meta, slots=to_device(meta.slots, device))
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
        meta: FlashInferStep,
        window: int,
        scale: float,
        softcap: float,
    ) -> None:
        keys, values = pool.keys[layer], pool.values[layer]
        keys.index_copy_(0, meta.slots, key.to(keys.dtype))
        values.index_copy_(0, meta.slots, value.to(values.dtype))
        kernel = self._plan(meta, pool, query, keys, window, scale, softcap)
        blocks = keys.shape[0] // pool.block_size
        paged = (
            keys.view(blocks, pool.block_size, *keys.shape[1:]),
            values.view(blocks, pool.block_size, *keys.shape[1:]),
        )
        kernel.run(query.contiguous(), paged, out=out)

    def _plan(
        self,
        meta: FlashInferStep,
        pool: Pool,
        query: torch.Tensor,
        keys: torch.Tensor,
        window: int,
        scale: float,
        softcap: float,
    ) -> Any:
        """The kernel of the layer's window, scale and soft-cap, planned for this step (once per step)."""
        import flashinfer

        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
        key = (window, scale, softcap)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        if key not in self._planned:
            kernel.plan(
                meta.query_offsets,
                meta.page_offsets,
                meta.pages,
                meta.last_page_len,
                query.shape[1],
                keys.shape[1],
                keys.shape[2],
                pool.block_size,
                causal=True,
                sm_scale=scale,
                window_left=window - 1 if window else -1,
                logits_soft_cap=softcap or None,
                q_data_type=query.dtype,
                kv_data_type=keys.dtype,
            )
            self._planned.add(key)
        return kernel
