"""The portable attention backend: any device torch runs on, every model transformers runs.

Each group of sequences attended together gathers its context's keys and values out of the pool
(by slot) and calls torch's scaled_dot_product_attention: the decoding sequences in one batched call
(their slots padded to the longest context), each prefill chunk in its own. A decode alone in its
step whose slots follow one another in the pool (its blocks in a run, its ring not wrapped) is
attended over the pool's slice in place, and decodes without padding attend without a mask. A layer
with logit soft-capping (Gemma 2) is computed in plain torch. Sliding-window layers keep one ring of slots per
batch slot (a sequence's token at position p sits at p mod ring_tokens of its ring).

The decodes leave the host as block tables and context lengths (`DecodeTables`, `RingTables`) and are
expanded into slots and positions on the device, so the host neither builds nor transfers the
block_size-times larger matrices.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from workers.models.attention import Pool
from workers.models.device import to_device
from workers.models.step import StepBatch


@dataclass
class Group:
    """Sequences attended in one call: their queries' places in the packed step [rows, q], the pool
    slots of their context [rows, keys] (padding repeats a real slot), each key's position [rows, keys]
    (-1 for padding) and each query's position [rows, q]."""

    queries: torch.Tensor
    slots: torch.Tensor
    key_positions: torch.Tensor
    query_positions: torch.Tensor
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    whole: bool = False  # one query a row, and the rows are the step's tokens in order (a step of decodes)
    # A window (0: none) under which each row's one query attends every one of its keys (decodes, no
    # padding): its layers attend without a mask. None where a mask is needed.
    attends_all: int | None = None
    # The first slot of a group of one row whose slots follow one another in the pool (its blocks
    # allocated in a run, or its ring not wrapped): its keys and values are read in place, not gathered.
    span: int | None = None
    # Made once per step, used by every layer: the slots flattened, and the buffers gathered into.
    flat: torch.Tensor = field(init=False)
    gathered: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.flat = self.slots.reshape(-1)

    def to(self, device: torch.device) -> Group:
        """The group on `device` (built on the host; the masks are made where the group is)."""
        if self.queries.device == device:
            return self
        return Group(
            to_device(self.queries, device),
            to_device(self.slots, device),
            to_device(self.key_positions, device),
            to_device(self.query_positions, device),
            whole=self.whole,
            attends_all=self.attends_all,
            span=self.span,
        )

    def mask(self, window: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[rows, 1, q, keys], 0 where a query attends a key and -inf elsewhere (made once per step
        and window: SDPA would turn a boolean mask into this in every layer): causal, within `window`
        positions when it is > 0, padding excluded. None where every key is attended."""
        if window == self.attends_all:
            return None
        if window not in self.masks:
            q = self.query_positions[:, :, None]
            k = self.key_positions[:, None, :]
            allowed = (k >= 0) & (k <= q)
            if window > 0:
                allowed &= k > q - window
            self.masks[window] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf")
            )[:, None]
        return self.masks[window]


@dataclass
class DecodeTables:
    """Decoding sequences, one query each, as the host sends them: their block tables [rows, blocks]
    (padded with the row's first block) and context lengths [rows]. `to` expands them into a Group's
    slots and positions [rows, longest context] on the device."""

    queries: torch.Tensor
    tables: torch.Tensor
    contexts: torch.Tensor
    block_size: int
    whole: bool = False

    def to(self, device: torch.device) -> Group:
        rows = len(self.tables)
        longest = int(self.contexts.max())  # read on the host, before the move: no device sync
        tables, contexts = to_device(self.tables, device), to_device(self.contexts, device)
        offsets = torch.arange(self.block_size, device=device)
        slots = (tables[:, :, None] * self.block_size + offsets).view(rows, -1)[:, :longest]
        positions = torch.arange(longest, device=device).expand(rows, -1)
        key_positions = torch.where(positions < contexts[:, None], positions, -1)
        unpadded = bool((self.contexts == longest).all())  # on the host
        span = None
        if rows == 1:
            blocks = self.tables[0, : -(-longest // self.block_size)]
            if bool((blocks[1:] - blocks[:-1] == 1).all()):
                span = int(blocks[0]) * self.block_size
        return Group(
            to_device(self.queries, device),
            slots,
            key_positions,
            (contexts - 1)[:, None],
            whole=self.whole,
            attends_all=0 if unpadded else None,
            span=span,
        )


@dataclass
class RingTables:
    """Decoding sequences in the sliding-window layers, as the host sends them: each one's context
    length [rows] and the start of its ring in the pool [rows]. `to` expands them into a Group over
    each sequence's last `window` positions, on the device."""

    queries: torch.Tensor
    ends: torch.Tensor
    bases: torch.Tensor
    window: int
    ring_tokens: int
    whole: bool = False

    def to(self, device: torch.device) -> Group:
        widths = self.ends - (self.ends - self.window).clamp(min=0)  # on the host
        width = int(widths.max())
        ends, bases = to_device(self.ends, device), to_device(self.bases, device)
        keys = (ends - self.window).clamp(min=0)[:, None] + torch.arange(width, device=device)
        valid = keys < ends[:, None]
        slots = torch.where(valid, bases[:, None] + keys % self.ring_tokens, bases[:, None])
        return Group(
            to_device(self.queries, device),
            slots,
            torch.where(valid, keys, -1),
            (ends - 1)[:, None],
            whole=self.whole,
            attends_all=self.window if bool((widths == width).all()) else None,
            span=self._span(width),
        )

    def _span(self, width: int) -> int | None:
        """The first slot of a lone sequence's last `width` positions where its ring does not wrap them."""
        if len(self.ends) != 1:
            return None
        start = (int(self.ends[0]) - width) % self.ring_tokens
        return int(self.bases[0]) + start if start + width <= self.ring_tokens else None


@dataclass
class PortableStep:
    """A step's layout: where each new token's keys and values go (`write` [tokens], slots) and the
    attention groups, for the full-attention layers and (`ring_*`) for the sliding-window ones."""

    write: torch.Tensor | list[int]
    groups: list[Group] | list[Group | DecodeTables]
    ring_write: torch.Tensor | list[int] | None = None
    ring_groups: list[Group] | list[Group | RingTables] = field(default_factory=list)


class PortableBackend:
    name = "portable"
    block_size = None
    rings = True
    softcap = True
    capturable = False
    compiles_per_batch = False

    def __init__(self) -> None:
        # On a CPU, the gathered keys and values of a layer go into two buffers kept from call to call
        # (grown to the largest context gathered): a fresh one per layer would be fresh pages from the
        # kernel, whose faults cost more than the copy. An accelerator's caching allocator reuses its
        # blocks itself.
        self.scratch: dict[str, torch.Tensor] = {}

    def _gather(self, name: str, pool: torch.Tensor, group: Group) -> torch.Tensor:
        """The pool's rows at the group's slots [rows, keys]: [rows, keys, kv heads, dim], valid until
        the next call for `name`. index_select copies whole rows (4x faster than advanced indexing on a
        CPU at a batch of 8). A group whose slots follow one another reads the pool in place."""
        if group.span is not None:
            return pool[group.span : group.span + group.slots.shape[1]].unsqueeze(0)
        if pool.device.type != "cpu":
            return torch.index_select(pool, 0, group.flat).view(*group.slots.shape, *pool.shape[1:])
        views = group.gathered.get(name)
        if views is None or views[0].dtype != pool.dtype:  # the group's first layer in this step
            count = len(group.flat)
            buffer = self.scratch.get(name)
            if buffer is None or buffer.shape[0] < count or buffer.dtype != pool.dtype:
                buffer = self.scratch[name] = pool.new_empty(count, *pool.shape[1:])
            rows = buffer[:count]
            views = group.gathered[name] = (rows, rows.view(*group.slots.shape, *pool.shape[1:]))
        torch.index_select(pool, 0, group.flat, out=views[0])
        return views[1]

    def prepare(self, batch: StepBatch, pool: Pool) -> PortableStep:
        size, ring_tokens = pool.block_size, pool.ring_tokens
        window = max(pool.windows)
        step = PortableStep(batch.slots(size), [], [] if ring_tokens else None)
        decode: list[tuple[int, list[int], int]] = []  # (place, blocks, context)
        prefill: list[Group | DecodeTables] = []
        ring_decode: list[tuple[int, int, int]] = []  # (place, ring start, context)
        ring_prefill: list[Group | RingTables] = []
        for i, place in enumerate(batch.query_start):
            count, end, blocks = batch.query_len[i], batch.context_len[i], batch.block_tables[i]
            start = end - count
            if count == 1:
                decode.append((place, blocks, end))
            else:
                prefill.append(_group(place, start, end, _slots(blocks, end, size)))
            if ring_tokens:
                base = batch.rings[i] * ring_tokens
                step.ring_write += [base + p % ring_tokens for p in range(start, end)]  # type: ignore[operator]
                if count == 1:
                    ring_decode.append((place, base, end))
                else:
                    keys = torch.arange(max(0, start - window + 1), end)
                    ring_prefill.append(_group(place, start, end, base + keys % ring_tokens, keys))
        step.groups = [_decode_tables(decode, size, whole=not prefill), *prefill] if decode else prefill
        if ring_decode:
            step.ring_groups = [_ring_tables(ring_decode, window, ring_tokens, whole=not ring_prefill)]
        step.ring_groups += ring_prefill  # type: ignore[operator]
        return step

    def load(self, meta: PortableStep, device: torch.device) -> PortableStep:
        def slots(values: torch.Tensor | list[int] | None) -> torch.Tensor | None:
            return None if values is None else to_device(torch.tensor(values, dtype=torch.long), device)

        return PortableStep(
            slots(meta.write),  # type: ignore[arg-type]
            [g.to(device) for g in meta.groups],
            slots(meta.ring_write),
            [g.to(device) for g in meta.ring_groups],
        )

    def forward(
        self,
        pool: Pool,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        meta: PortableStep,
        window: int,
        scale: float,
        softcap: float,
    ) -> None:
        keys, values = pool.keys[layer], pool.values[layer]
        write, groups = (
            (meta.ring_write, meta.ring_groups) if pool.ring_tokens and window else (meta.write, meta.groups)
        )
        keys.index_copy_(0, write, key.to(keys.dtype))  # type: ignore[arg-type]
        values.index_copy_(0, write, value.to(values.dtype))  # type: ignore[arg-type]
        for group in groups:
            assert isinstance(group, Group)
            k = self._gather("keys", keys, group).transpose(1, 2)  # [rows, kv heads, keys, dim]
            v = self._gather("values", values, group).transpose(1, 2)
            mask = group.mask(window, query.dtype)
            rows, q_len = group.queries.shape
            places = group.queries.reshape(-1)
            q = (query if group.whole else query[places]).reshape(rows, q_len, *query.shape[1:]).transpose(1, 2)
            o = _attend(q, k, v, mask, scale, softcap).transpose(1, 2).reshape(-1, *out.shape[1:])
            if group.whole:
                out.copy_(o)
            else:
                out[places] = o


def _slots(blocks: list[int], length: int, size: int) -> torch.Tensor:
    table = torch.tensor(blocks[: -(-length // size)], dtype=torch.long)
    return (table[:, None] * size + torch.arange(size)).view(-1)[:length]


def _group(place: int, start: int, end: int, slots: torch.Tensor, keys: torch.Tensor | None = None) -> Group:
    """One sequence's chunk: queries at positions [start, end) over `slots` (keys at positions `keys`,
    by default [0, end))."""
    return Group(
        queries=torch.arange(place, place + end - start).unsqueeze(0),
        slots=slots.unsqueeze(0),
        key_positions=(torch.arange(end) if keys is None else keys).unsqueeze(0),
        query_positions=torch.arange(start, end).unsqueeze(0),
    )


def _decode_tables(decode: list[tuple[int, list[int], int]], size: int, whole: bool) -> DecodeTables:
    """The decoding sequences, one query each, over their slots padded to the longest context."""
    width = max(-(-context // size) for _, _, context in decode)
    rows = (blocks[: -(-c // size)] + [blocks[0]] * (width - -(-c // size)) for _, blocks, c in decode)
    # numpy reads a flat iterator of ints several times faster than torch reads nested lists.
    tables = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=len(decode) * width)
    return DecodeTables(
        queries=torch.tensor([[p] for p, _, _ in decode]),
        tables=torch.from_numpy(tables).view(len(decode), width),
        contexts=torch.tensor([c for _, _, c in decode]),
        block_size=size,
        whole=whole,
    )


def _ring_tables(decode: list[tuple[int, int, int]], window: int, ring_tokens: int, whole: bool) -> RingTables:
    """The decoding sequences in the sliding-window layers: each over its last `window` positions."""
    return RingTables(
        queries=torch.tensor([[p] for p, _, _ in decode]),
        ends=torch.tensor([c for _, _, c in decode]),
        bases=torch.tensor([b for _, b, _ in decode]),
        window=window,
        ring_tokens=ring_tokens,
        whole=whole,
    )


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """q [rows, heads, q, dim] over k, v [rows, kv heads, keys, dim] where `mask` allows."""
    if softcap:
        return _softcapped(q, k, v, mask, scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
