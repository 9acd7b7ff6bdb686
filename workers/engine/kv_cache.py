"""The KV cache of the running batch: row i of every buffer belongs to sequence i.

Sequences of different lengths share one cache by left padding: `mask` marks the real positions (1)
and the padding (0), and every row writes its next token's keys and values in the same column. The
keys and values live in buffers allocated ahead (rows and columns grow by doubling), which the model
sees as views of the rows and columns in use (`SlabLayer`). A decode step writes its column in place,
where transformers' DynamicLayer copies the whole cache to append one column; a finished row's place
is taken by the last row (one row's copy), where keeping the others in order copied them all; new rows
are written into free rows. Columns that became padding for every row are trimmed once they are half
of the columns in use. Only full-attention layers are supported: this relies on transformers 5.x's
`DynamicCache.layers` and `DynamicLayer` (pinned in requirements.txt, covered by tests/test_kvbatch.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _pad_left(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0]
    return F.pad(tensor, pad)


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [rows, heads, length, head_dim]."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("sliding-window attention layers are not supported by the batcher")
    return [(layer.keys, layer.values) for layer in cache.layers]


class SlabLayer(DynamicLayer):
    """One layer's keys and values in buffers [row capacity, heads, column capacity, head_dim]; `keys`
    and `values` are the views of the `rows` and `length` in use, as transformers' attention reads them."""

    def __init__(self, like: torch.Tensor, rows: int, columns: int) -> None:
        super().__init__()
        self.dtype, self.device = like.dtype, like.device
        self.is_initialized = True
        self.rows = self.length = 0
        self._reallocate(like, rows, columns)

    def _reallocate(self, like: torch.Tensor, rows: int, columns: int, shift: int = 0) -> None:
        """New zeroed buffers of at least this capacity; the rows in use move `shift` columns right."""
        heads, head_dim = like.shape[1], like.shape[3]
        shape = (max(rows, 1), heads, max(columns, 1), head_dim)
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if self.rows and self.length:
            keys[: self.rows, :, shift : shift + self.length] = self.keys
            values[: self.rows, :, shift : shift + self.length] = self.values
        self.key_slab, self.value_slab = keys, values
        self.show(self.rows, self.length + shift)

    def show(self, rows: int, length: int) -> None:
        self.rows, self.length = rows, length
        self.keys = self.key_slab[:rows, :, :length]
        self.values = self.value_slab[:rows, :, :length]

    def reserve(self, rows: int, columns: int, shift: int = 0) -> None:
        """Room for `rows` rows and `columns` columns (doubling), the rows in use moved `shift` columns right."""
        have_rows, have_columns = self.key_slab.shape[0], self.key_slab.shape[2]
        if rows <= have_rows and columns <= have_columns and not shift:
            return
        grown_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows)
        grown_columns = have_columns if columns <= have_columns else max(columns, 2 * have_columns)
        self._reallocate(self.key_slab, grown_rows, grown_columns, shift)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new columns of every row in use in place (a decode step: one column)."""
        end = self.length + key_states.shape[-2]
        self.reserve(self.rows, end)
        self.key_slab[: self.rows, :, self.length : end] = key_states
        self.value_slab[: self.rows, :, self.length : end] = value_states
        self.show(self.rows, end)
        return self.keys, self.values


class KVBatch:
    def __init__(self) -> None:
        self.cache: DynamicCache | None = None  # its layers are SlabLayers
        self.mask: torch.Tensor | None = None  # long [rows, length]

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def slabs(self) -> list[SlabLayer]:
        assert self.cache is not None
        return self.cache.layers  # type: ignore[return-value]

    def append(self, new: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Add rows (a prefill's keys and values per layer, and its mask) after the existing ones."""
        added, columns = mask.shape
        if self.cache is None or self.mask is None:
            self.cache = DynamicCache()
            self.cache.layers = [SlabLayer(keys, added, 2 * columns) for keys, _ in new]  # room to decode
            self.mask = mask
            rows, length = 0, columns
        else:
            rows, length = self.rows, max(self.length, columns)
            shift = length - self.length  # a longer prompt than the columns in use: more left padding
            for slab in self.slabs():
                slab.reserve(rows + added, length, shift)
            self.mask = torch.cat([_pad_left(self.mask, length, 1), _pad_left(mask, length, 1)])
        start = length - columns
        for slab, (keys, values) in zip(self.slabs(), new, strict=True):
            slab.key_slab[rows : rows + added, :, :start] = 0  # what a former row left there
            slab.value_slab[rows : rows + added, :, :start] = 0
            slab.key_slab[rows : rows + added, :, start:length] = keys
            slab.value_slab[rows : rows + added, :, start:length] = values
            slab.show(rows + added, length)

    @torch.inference_mode()  # the buffers are inference tensors: the prefill made them
    def drop(self, rows: list[int]) -> list[int]:
        """Drop these rows; the last rows held move into their places. Returns, for each row now held,
        its former index. Columns that are then padding for every row are trimmed if they are half of
        the columns in use."""
        assert self.mask is not None
        held = self.rows
        keep = held - len(set(rows))
        if keep <= 0:
            self.cache = self.mask = None
            return []
        gone = set(rows)
        holes = sorted(i for i in gone if i < keep)
        movers = [i for i in range(keep, held) if i not in gone]
        order = list(range(keep))
        if holes:
            to = torch.tensor(holes, device=self.mask.device)
            since = torch.tensor(movers, device=self.mask.device)
            for slab in self.slabs():
                slab.key_slab[to, :, : self.length] = slab.key_slab[since, :, : self.length]
                slab.value_slab[to, :, : self.length] = slab.value_slab[since, :, : self.length]
            self.mask[to] = self.mask[since]
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
        self.mask = self.mask[:keep]
        for slab in self.slabs():
            slab.show(keep, self.length)
        self._trim()
        return order

    def _trim(self) -> None:
        """Drop the leading columns that are padding for every row, once they are half of those in use."""
        assert self.mask is not None
        start = int(self.mask.any(dim=0).int().argmax())
        if start == 0 or 2 * start < self.length:
            return
        length = self.length - start
        for slab in self.slabs():
            for slab_tensor in (slab.key_slab, slab.value_slab):
                slab_tensor[: self.rows, :, :length] = slab_tensor[: self.rows, :, start : self.length].clone()
            slab.show(self.rows, length)
        self.mask = self.mask[:, start:]

    def next_positions(self) -> torch.Tensor:
        """Position ids of the token each row feeds next: its count of real tokens so far."""
        assert self.mask is not None
        return self.mask.sum(dim=1, keepdim=True)

    def grow(self) -> None:
        """Extend the mask by one real column (the token being fed)."""
        assert self.mask is not None
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)

    def ungrow(self) -> None:
        """Undo `grow` and the step's writes after a forward pass that failed part-way: every layer
        shows the columns it held before (a written column beyond them is overwritten next time)."""
        assert self.mask is not None
        self.mask = self.mask[:, :-1]
        for slab in self.slabs():
            slab.show(slab.rows, min(slab.length, self.length))
