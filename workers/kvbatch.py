"""The KV cache of the running batch: row i of every tensor belongs to sequence i.

Sequences of different lengths share one DynamicCache by left padding; `mask` marks the real
positions (1) and the padding (0). New rows are merged in after their own prefill; finished rows are
dropped, and columns that became padding for every row are trimmed. Only full-attention layers
(DynamicLayer) are supported: this relies on `layer.keys` / `layer.values` of transformers 5.x
(pinned in requirements.txt, covered by tests/test_engine.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache


def _pad_left(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0]
    return F.pad(tensor, pad)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [rows, heads, length, head_dim]."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("sliding-window attention layers are not supported by the batcher")
    return [(layer.keys, layer.values) for layer in cache.layers]


class KVBatch:
    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # long [rows, length]

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.cache is not None
        return _layers(self.cache)

    def append(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add rows (a freshly prefilled cache and its mask) after the existing ones."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            return
        assert self.mask is not None
        length = max(self.mask.shape[1], mask.shape[1])
        merged = [
            (
                torch.cat([_pad_left(k1, length, 2), _pad_left(k2, length, 2)]),
                torch.cat([_pad_left(v1, length, 2), _pad_left(v2, length, 2)]),
            )
            for (k1, v1), (k2, v2) in zip(self.layers(), _layers(cache), strict=True)
        ]
        self.cache = DynamicCache(ddp_cache_data=merged)
        self.mask = torch.cat([_pad_left(self.mask, length, 1), _pad_left(mask, length, 1)])

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), then drop columns that are padding for all of them."""
        if not rows:
            self.cache = self.mask = None
            return
        assert self.mask is not None
        if rows == list(range(self.rows)):
            return
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(dim=0).nonzero()[0])
        layers = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:]) for k, v in self.layers()
        ]
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = mask[:, start:]

    def next_positions(self) -> torch.Tensor:
        """Position ids of the token each row feeds next: its count of real tokens so far."""
        assert self.mask is not None
        return self.mask.sum(dim=1, keepdim=True)

    def grow(self) -> torch.Tensor:
        """Extend the mask by one real column (the token being fed) and return it."""
        assert self.mask is not None
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        return self.mask
