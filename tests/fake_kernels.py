"""CPU stand-ins for the device kernels the NPU and FlashInfer attention backends call, written from the
operators' documented contracts (torch_npu's `_npu_reshape_and_cache` and
`npu_fused_infer_attention_score` in layout TND; FlashInfer's `BatchPrefillWithPagedKVCacheWrapper`).

A pure seam: they let the tests run each backend's metadata (slots, block tables, cumulative and
per-sequence lengths, page offsets, windows) through a whole engine on the CPU and compare its output
with transformers'. They prove the backends call the operators as documented, not the operators
themselves: `make device-check` runs the real ones on a device.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int, softcap: float
) -> torch.Tensor:
    """q [n, H, D] (the last n positions of a sequence of len(k)), k and v [len, KV heads, D]: causal
    from the bottom right, within `window` keys (self included) when it is > 0."""
    n, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(length - n, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    allowed = key_pos <= query_pos
    if window:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def torch_npu() -> types.ModuleType:
    """`torch_npu` with the two operators the NPU backend calls."""
    module = types.ModuleType("torch_npu")

    def _npu_reshape_and_cache(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_indices: torch.Tensor,
    ) -> None:
        assert slot_indices.dtype == torch.int32
        flat = slot_indices.long()
        key_cache.view(-1, *key_cache.shape[2:])[flat] = key
        value_cache.view(-1, *value_cache.shape[2:])[flat] = value

    def npu_fused_infer_attention_score(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor,
        block_table: torch.Tensor,
        input_layout: str,
        block_size: int,
        actual_seq_lengths: list[int],
        actual_seq_lengths_kv: list[int],
        num_key_value_heads: int,
        num_heads: int,
        scale: float,
        sparse_mode: int,
        pre_tokens: int = 2**31 - 1,
        next_tokens: int = 2**31 - 1,
    ) -> tuple[torch.Tensor, None]:
        assert input_layout == "TND" and block_table.dtype == torch.int32 and atten_mask.shape == (2048, 2048)
        assert sparse_mode in (3, 4) and query.shape[1] == num_heads and actual_seq_lengths[-1] == query.shape[0]
        dim = query.shape[2]
        keys = key.reshape(-1, num_key_value_heads, dim)
        values = value.reshape(-1, num_key_value_heads, dim)
        out = torch.empty_like(query)
        start = 0
        for row, (end, length) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv, strict=True)):
            blocks = block_table[row].long()
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
            window = pre_tokens if sparse_mode == 4 else 0
            out[start:end] = _attend(query[start:end], keys[slots], values[slots], scale, window, 0.0)
            start = end
        return out, None

    module._npu_reshape_and_cache = _npu_reshape_and_cache  # type: ignore[attr-defined]
    module.npu_fused_infer_attention_score = npu_fused_infer_attention_score  # type: ignore[attr-defined]
    return module


def flashinfer() -> types.ModuleType:
    """`flashinfer` with the paged prefill wrapper the CUDA backend calls."""
    module = types.ModuleType("flashinfer")

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
            assert kv_layout == "NHD" and workspace.dtype == torch.uint8
            self.planned: dict[str, Any] | None = None

        def plan(
            self,
            qo_indptr: torch.Tensor,
            paged_kv_indptr: torch.Tensor,
            paged_kv_indices: torch.Tensor,
            paged_kv_last_page_len: torch.Tensor,
            num_qo_heads: int,
            num_kv_heads: int,
            head_dim: int,
            page_size: int,
            **options: Any,
        ) -> None:
            for array in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
                assert array.dtype == torch.int32
            self.planned = {
                "qo": qo_indptr.tolist(),
                "pages": paged_kv_indptr.tolist(),
                "indices": paged_kv_indices.long(),
                "last": paged_kv_last_page_len.tolist(),
                "page_size": page_size,
                **options,
            }

        def run(self, q: torch.Tensor, paged: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
            plan = self.planned
            assert plan is not None and plan["causal"]
            k_cache, v_cache = paged
            size = plan["page_size"]
            window = plan["window_left"] + 1 if plan["window_left"] >= 0 else 0
            for row in range(len(plan["last"])):
                pages = plan["indices"][plan["pages"][row] : plan["pages"][row + 1]]
                length = (len(pages) - 1) * size + plan["last"][row]
                keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:length]
                values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:length]
                a, b = plan["qo"][row], plan["qo"][row + 1]
                out[a:b] = _attend(q[a:b], keys, values, plan["sm_scale"], window, plan["logits_soft_cap"] or 0.0)
            return out

    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    return module
