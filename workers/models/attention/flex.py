"""The flex backend: decodes attend over the pool in place, through PyTorch's flex_attention.

The portable backend copies each decoding sequence's whole context out of the pool every step before
it attends (two passes over the KV cache that a kernel reading the blocks in place does not make).
Here a step of decodes calls flex_attention, compiled, with one batch row per sequence (its one query)
and the whole pool as the keys and values of every row ([1, KV heads, slots, dim] views, broadcast
over the batch, nothing copied); the sequences' block tables are the block mask: a row's full blocks
listed as full (no mask evaluated) and its last, partial block masked by position (each block's place
in its sequences, shared prefix blocks alike). Sliding windows and logit soft-capping are a mask and a
score modification. A step with prompt chunks is attended by the portable backend (a prefill computes
over its context anyway).

On a GPU every block of a row is listed as masked and none as full (`split_kv`). Flex's decoding
kernel (torch/_inductor/kernel/flex/templates/flex_decode.py.jinja) splits a row's keys among several
programs, as flash-decoding does: by the row's own masked blocks, but by the whole key length once
full blocks are given, and here the keys are the whole pool, so every row's context fell to its first
split: one program per row and KV head walked it all. The mask then costs a few comparisons per score.
A CPU's kernel splits otherwise; there the full blocks skip the mask.

That kernel also takes only a power-of-two number of query heads per KV head (torch's
flex_decoding.py `_use_flex_decoding`); with another (Qwen2.5-7B's 7, Qwen2.5-1.5B's 6) flex falls back
to its general kernel, one program per row and query head over the whole context and a 128-row query
block for one query. So on a GPU each KV head's query heads are padded with zero heads to the next
power of two (`pad_groups`; 8/7 of the scores for Qwen2.5-7B) and the padding's outputs dropped.

A decode step's metadata has one shape per batch size (rows padded to a power of two, tables as wide
as the pool): the device graph of a bucket (models/compile.py) copies each step's into its own and
replays (`capturable`).

Its kernels want big blocks: on a CPU, 128-token blocks attend ~1.5× as long as SDPA over a
contiguous cache, 16-token blocks ~4.6× (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from workers.models.attention import Pool
from workers.models.attention.portable import PortableBackend, PortableStep
from workers.models.device import host_to, to_device
from workers.models.step import StepBatch

BLOCK_SIZE = 128
QUERY_BLOCK = 128  # a row's one query is in one query block (flex's kernels tile queries by 16 and up)


@dataclass
class FlexStep:
    """A decode step: the write slots [rows]; each row's query position [rows]; each pool block's place
    in its sequence [pool blocks] (-1 for none); each row's full blocks and partial block, as flex's
    block-mask tables [rows, 1, 1(, pool blocks)]."""

    write: torch.Tensor
    query_positions: torch.Tensor
    block_places: torch.Tensor
    full_count: torch.Tensor
    full_blocks: torch.Tensor
    partial_count: torch.Tensor
    partial_blocks: torch.Tensor


class FlexBackend:
    name = "flex"
    block_size = BLOCK_SIZE
    rings = False
    softcap = True
    capturable = True
    compiles_per_batch = True

    def __init__(self, split_kv: bool = False, pad_groups: bool = False) -> None:
        self.split_kv = split_kv  # every block masked, none full: see the module's docstring
        self.pad_groups = pad_groups  # query heads per KV head padded to a power of two: ditto
        self.portable = PortableBackend()
        # Dynamo keeps 8 compiled variants of a function by default, then runs it eagerly (on a GPU,
        # flex's eager path materialises every score over the whole pool). flex_attention is compiled
        # once per padded row count, mask (windowed or not) and score modification, and again when
        # called from inside the compiled model (its tensors' dispatch keys differ): more than 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._attend = torch.compile(flex_attention, fullgraph=True, dynamic=False)  # see _padded_rows

    def prepare(self, batch: StepBatch, pool: Pool) -> FlexStep | PortableStep:
        if any(n != 1 for n in batch.query_len):
            return self.portable.prepare(batch, pool)
        size, rows = pool.block_size, _padded_rows(batch.num_sequences)
        pool_blocks = pool.keys[0].shape[0] // size
        places = torch.full((pool_blocks,), -1, dtype=torch.int32)
        # With split_kv every block is masked: the full-block table is never read (one column, not the
        # pool's width, copied to the device each step).
        full = torch.zeros(rows, 1, 1, 1 if self.split_kv else pool_blocks, dtype=torch.int32)
        partial = torch.zeros(rows, 1, 1, pool_blocks, dtype=torch.int32)
        full_count = torch.zeros(rows, 1, 1, dtype=torch.int32)
        partial_count = torch.zeros(rows, 1, 1, dtype=torch.int32)
        for row, (length, blocks) in enumerate(zip(batch.context_len, batch.block_tables, strict=True)):
            used = -(-length // size)
            table = torch.tensor(blocks[:used], dtype=torch.int32)
            places[table.long()] = torch.arange(used, dtype=torch.int32)
            if self.split_kv:
                partial[row, 0, 0, :used] = table
                partial_count[row, 0, 0] = used
                continue
            whole = length // size
            full[row, 0, 0, :whole] = table[:whole]
            full_count[row, 0, 0] = whole
            if whole < used:
                partial[row, 0, 0, 0] = table[whole]
                partial_count[row, 0, 0] = 1
        return FlexStep(
            torch.tensor(batch.slots(size), dtype=torch.long),
            torch.tensor(
                [length - 1 for length in batch.context_len] + [0] * (rows - batch.num_sequences), dtype=torch.int32
            ),
            places,
            full_count,
            full,
            partial_count,
            partial,
        )

    def load(self, meta: FlexStep | PortableStep, device: torch.device) -> Any:
        if isinstance(meta, PortableStep):
            return self.portable.load(meta, device)
        return FlexStep(*(to_device(getattr(meta, f), device) for f in meta.__dataclass_fields__))

    def capture_meta(self, meta: FlexStep, pool: Pool, device: torch.device) -> FlexStep:
        return self.load(meta, device)  # a bucket's tables have one shape whatever its contexts

    def refresh(self, captured: FlexStep, meta: FlexStep) -> None:
        for field in dataclasses.fields(captured):
            host_to(getattr(captured, field.name), getattr(meta, field.name))

    def forward(
        self,
        pool: Pool,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        meta: FlexStep | PortableStep,
        window: int,
        scale: float,
        softcap: float,
    ) -> None:
        if isinstance(meta, PortableStep):
            self.portable.forward(pool, layer, query, key, value, out, meta, window, scale, softcap)
            return
        keys, values = pool.keys[layer], pool.values[layer]
        keys.index_copy_(0, meta.write, key.to(keys.dtype))
        values.index_copy_(0, meta.write, value.to(values.dtype))
        mask = self._mask(meta, pool.block_size, window, keys.shape[0])
        rows, heads, dim = query.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        width = 1 << (group - 1).bit_length() if self.pad_groups else group
        # [rows padded, KV heads, query heads of each, dim]: the padding rows and heads are zeros, and
        # what they attend is dropped.
        padded = query.new_zeros(len(meta.query_positions), kv_heads, width, dim)
        padded[:rows, :, :group] = query.unflatten(1, (kv_heads, group))
        # Its guards tell its compiled variants apart: they are checked even inside a compiled decode
        # step, which skips its own (models/compile.py).
        with torch.compiler.set_stance("default"):
            attended = self._attend(
                padded.view(-1, kv_heads * width, 1, dim),  # [rows, heads, 1, dim]
                keys.permute(1, 0, 2).unsqueeze(0),  # [1, KV heads, slots, dim]: the pool, in place, for every row
                values.permute(1, 0, 2).unsqueeze(0),
                score_mod=_softcap(softcap) if softcap else None,
                block_mask=mask,
                scale=scale,
                enable_gqa=heads != kv_heads,
            )
        out.copy_(attended.reshape(-1, kv_heads, width, out.shape[-1])[:rows, :, :group].flatten(1, 2))

    def _mask(self, meta: FlexStep, size: int, window: int, slots: int) -> BlockMask:
        places, query_positions = meta.block_places, meta.query_positions

        def visible(b: Any, h: Any, q: Any, kv: Any) -> Any:
            position = places[kv // size] * size + kv % size
            seen = (places[kv // size] >= 0) & (position <= query_positions[b])
            return seen & (position > query_positions[b] - window) if window else seen

        if self.split_kv or window:  # every block is checked (a window's edge may cut any block)
            if self.split_kv:  # the tables list every block as masked already
                count, blocks = meta.partial_count, meta.partial_blocks
            else:
                count = meta.full_count + meta.partial_count
                blocks = meta.full_blocks.clone()
                blocks.scatter_(-1, meta.full_count.long().unsqueeze(-1), meta.partial_blocks[..., :1])
            # No full blocks: on a CPU as empty tables (torch 2.13's CPU kernel reads them), elsewhere
            # none at all (given, they make flex's GPU decoding kernel split by the pool's length).
            on_cpu = blocks.device.type == "cpu"
            return BlockMask.from_kv_blocks(
                count,
                blocks,
                torch.zeros_like(count) if on_cpu else None,
                torch.zeros_like(blocks) if on_cpu else None,
                BLOCK_SIZE=(QUERY_BLOCK, size),
                mask_mod=visible,
                seq_lengths=(1, slots),
                compute_q_blocks=False,
            )
        return BlockMask.from_kv_blocks(
            meta.partial_count,
            meta.partial_blocks,
            meta.full_count,
            meta.full_blocks,
            BLOCK_SIZE=(QUERY_BLOCK, size),
            mask_mod=visible,
            seq_lengths=(1, slots),
            compute_q_blocks=False,
        )


def _padded_rows(rows: int) -> int:
    """Rows padded to a power of two (rows without blocks attend nothing): the kernel is compiled for
    static shapes (its dynamic-shape C++ does not compile in torch 2.13), once per size."""
    return 1 << (rows - 1).bit_length()


def _softcap(cap: float) -> Any:
    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return torch.tanh(score / cap) * cap

    return score_mod
