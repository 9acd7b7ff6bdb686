"""CUDA GPUs with FlashInfer installed (optional: `pip install flashinfer-python`): its paged prefill
kernel attends the whole packed step (decodes are one-token queries) over the pool viewed as
[blocks, block_size, KV heads, dim] (FlashInfer's NHD layout, any block size), with sliding windows
and logit soft-capping in the kernel. Keys and values are written by slot with `index_copy_`.

The kernel is planned once per step and window on the host (`plan`: query and page offsets, page
indices, the last page's fill), then run for every layer of that window. Without FlashInfer a GPU is
served by the portable backend.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from workers.models.attention import Pool
from workers.models.step import StepBatch

WORKSPACE_BYTES = 128 * 2**20


@dataclass
class FlashInferStep:
    """FlashInfer's paged layout of a step: query offsets [sequences + 1], page offsets [sequences + 1],
    the pages [sum of pages], the last page's fill [sequences], the write slots [tokens]."""

    query_offsets: Any
    page_offsets: Any
    pages: Any
    last_page_len: Any
    slots: Any
    host: FlashInferStep | None = None  # the same on the host, which `plan` reads


class FlashInferBackend:
    name = "flashinfer"
    block_size = None
    rings = False
    softcap = True
    capturable = False
    compiles_per_batch = False

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None
        self._kernels: dict[int, Any] = {}
        self._planned: set[int] = set()  # the windows planned for the current step

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
        loaded = FlashInferStep(
            meta.query_offsets.to(device),
            meta.page_offsets.to(device),
            meta.pages.to(device),
            meta.last_page_len.to(device),
            meta.slots.to(device),
            host=meta,
        )
        self._planned = set()  # a new step: each window's kernel is planned by its first layer
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
        """The window's kernel, planned for this step (once per step and window)."""
        import flashinfer

        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
        kernel = self._kernels.get(window)
        if kernel is None:
            kernel = self._kernels[window] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        if window not in self._planned:
            host = meta.host or meta
            kernel.plan(
                host.query_offsets,
                host.page_offsets,
                host.pages,
                host.last_page_len,
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
            self._planned.add(window)
        return kernel
