"""Paged attention for every transformers architecture: the KV pool on the device and the attention
function that reads and writes it.

The engine runs a step as one packed sequence of tokens (`input_ids` [1, tokens]: each scheduled
sequence's new tokens, one after the other, with their own position ids) through the model's own
transformers forward. transformers calls the attention function registered under its attention
interface (`ATTENTION`, set as the model's implementation) for each layer with that layer's queries,
keys and values; `paged_attention` writes the step's keys and values into the layer's slots of the pool
and attends each sequence over its own slots, as the step's `PagedStep` (built by the model runner
from the block tables, engine/kv_cache.py) says. transformers builds no mask for an implementation it
has no mask function for, so the model passes none; the step carries its own.

Kernels, one interface: on a CPU (and on CUDA) the sequences' slots are gathered and attended with
torch's scaled_dot_product_attention, decodes in one batched call and each prefill chunk in its own;
a layer with logit soft-capping (Gemma 2) is computed in plain torch. The pool's layout (slots ×
KV heads × head_dim per layer, block-major) is the one Ascend's block-table kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

if TYPE_CHECKING:
    from workers.models.runner import KVLayout

ATTENTION = "tokenline_paged"


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

    def to(self, device: torch.device) -> Group:
        """The group on `device` (built on the host; the masks are made where the group is)."""
        if self.queries.device == device:
            return self
        return Group(
            self.queries.to(device),
            self.slots.to(device),
            self.key_positions.to(device),
            self.query_positions.to(device),
            whole=self.whole,
        )

    def mask(self, window: int) -> torch.Tensor:
        """[rows, 1, q, keys]: causal, within `window` positions when it is > 0, padding excluded."""
        if window not in self.masks:
            q = self.query_positions[:, :, None]
            k = self.key_positions[:, None, :]
            allowed = (k >= 0) & (k <= q)
            if window > 0:
                allowed &= k > q - window
            self.masks[window] = allowed[:, None]
        return self.masks[window]


@dataclass
class DecodeTables:
    """Decoding sequences, one query each, as the host sends them: their block tables [rows, blocks]
    (padded with the row's first block) and context lengths [rows]. `to` expands them into a Group's
    slots and positions [rows, longest context] on the device, so the host neither builds nor
    transfers (nor, in a tensor-parallel group, sends) the block_size-times larger matrices."""

    queries: torch.Tensor
    tables: torch.Tensor
    contexts: torch.Tensor
    block_size: int
    whole: bool = False

    def to(self, device: torch.device) -> Group:
        rows = len(self.tables)
        longest = int(self.contexts.max())  # read on the host, before the move: no device sync
        tables, contexts = self.tables.to(device), self.contexts.to(device)
        offsets = torch.arange(self.block_size, device=device)
        slots = (tables[:, :, None] * self.block_size + offsets).view(rows, -1)[:, :longest]
        positions = torch.arange(longest, device=device).expand(rows, -1)
        key_positions = torch.where(positions < contexts[:, None], positions, -1)
        return Group(self.queries.to(device), slots, key_positions, (contexts - 1)[:, None], whole=self.whole)


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
        width = int((self.ends - (self.ends - self.window).clamp(min=0)).max())  # on the host
        ends, bases = self.ends.to(device), self.bases.to(device)
        keys = (ends - self.window).clamp(min=0)[:, None] + torch.arange(width, device=device)
        valid = keys < ends[:, None]
        slots = torch.where(valid, bases[:, None] + keys % self.ring_tokens, bases[:, None])
        return Group(
            self.queries.to(device), slots, torch.where(valid, keys, -1), (ends - 1)[:, None], whole=self.whole
        )


@dataclass
class PagedStep:
    """One step's layout: where each new token's keys and values go (`write` [tokens], slots) and the
    attention groups, for the full-attention layers and (`ring_*`) for the sliding-window ones."""

    write: torch.Tensor
    groups: list[Group]
    ring_write: torch.Tensor | None = None
    ring_groups: list[Group] = field(default_factory=list)


class PagedKV:
    """The pool: per full-attention layer, keys and values [blocks × block_size, KV heads, head_dim];
    per sliding-window layer, [rings × ring_tokens, KV heads, head_dim] (models/runner.py KVLayout)."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        shape = layout.shape
        self.num_blocks, self.block_size = layout.num_blocks, layout.block_size
        self.windows = shape.windows
        self.context = shape.context
        full = (layout.num_blocks * layout.block_size, shape.kv_heads, shape.head_dim)
        ring = (layout.rings * layout.ring_tokens, shape.kv_heads, shape.head_dim)

        def buffer(window: int) -> torch.Tensor:
            return torch.zeros(ring if window else full, dtype=shape.dtype, device=device)

        self.keys = [buffer(w) for w in shape.windows]
        self.values = [buffer(w) for w in shape.windows]
        self.step: PagedStep | None = None

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_kv: PagedKV | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, heads, tokens, dim], key and value
    [1, kv heads, tokens, dim]; returns [1, tokens, heads, dim]."""
    if paged_kv is None or paged_kv.step is None:
        raise RuntimeError(f"the {ATTENTION} attention runs only inside tokenline's model runner")
    step = paged_kv.step
    layer = module.layer_idx  # type: ignore[attr-defined]
    window = paged_kv.windows[layer]
    declared = int(sliding_window or 0)
    if declared != window and not (window == 0 and paged_kv.context and declared >= paged_kv.context):
        raise RuntimeError(f"layer {layer}: the model attends a window of {sliding_window}, the pool keeps {window}")
    keys, values = paged_kv.keys[layer], paged_kv.values[layer]
    write, groups = (step.ring_write, step.ring_groups) if window else (step.write, step.groups)
    assert write is not None
    keys.index_copy_(0, write, key[0].transpose(0, 1).to(keys.dtype))
    values.index_copy_(0, write, value[0].transpose(0, 1).to(values.dtype))
    if len(groups) == 1 and groups[0].whole:  # decodes alone: the queries are the rows as they come
        group = groups[0]
        q = query[0].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        o = _attend(q, keys[group.slots].transpose(1, 2), values[group.slots].transpose(1, 2), group.mask(window), scaling, softcap)
        return o.permute(2, 0, 1, 3), None
    q_all = query[0].transpose(0, 1)  # [tokens, heads, dim]
    out = query.new_empty(q_all.shape)
    for group in groups:
        rows, q_len = group.queries.shape
        q = q_all[group.queries.reshape(-1)].view(rows, q_len, *q_all.shape[1:]).transpose(1, 2)
        k = keys[group.slots].transpose(1, 2)  # [rows, kv heads, keys, dim]
        v = values[group.slots].transpose(1, 2)
        o = _attend(q, k, v, group.mask(window), scaling, softcap)
        out[group.queries.reshape(-1)] = o.transpose(1, 2).reshape(rows * q_len, *q_all.shape[1:])
    return out.unsqueeze(0), None


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float | None, softcap: float | None
) -> torch.Tensor:
    """q [rows, heads, q, dim] over k, v [rows, kv heads, keys, dim] where `mask` allows."""
    if softcap:
        return _softcapped(q, k, v, mask, scaling, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float | None, softcap: float
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


class PerSequenceRotary(torch.nn.Module):
    """A model's LongRoPE rotary embedding (Phi-3.5, Phi-4-mini) applied per sequence, as transformers'
    `generate()` applies it to that sequence alone. transformers picks the short or the long factors
    for a whole call from its largest position (long past `original_max_position_embeddings`): a
    prompt's keys get the factors its whole prefill would get, and each generated token those of its
    own position. Given a packed step, one long sequence would switch every other one; given one chunk
    of a long prompt, the early chunks would take the short factors. So each sequence is rotated on its
    own, its tokens split where the choice changes: a token at position p of a sequence whose prompt has
    P tokens takes the long factors when max(P, p + 1) passes the original context (a prompt recomputed
    after preemption gets the factors it had). `segments` ([start, end) in the step, first position,
    prompt length of each sequence) is set by the model runner."""

    def __init__(self, rotary: torch.nn.Module, original_context: int) -> None:
        super().__init__()
        self.rotary = rotary
        self.original_context = original_context
        self.segments: list[tuple[int, int, int, int]] = []

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for start, end, first, prompt in self.segments:
            short = 0 if prompt > self.original_context else max(0, min(end - start, self.original_context - first))
            if short:
                parts.append(self.rotary(x, position_ids[:, start : start + short]))
            if start + short < end:  # one position past the original context makes the call take the long factors
                positions = position_ids[:, start + short : end]
                beyond = positions.new_full((positions.shape[0], 1), self.original_context)
                cos, sin = self.rotary(x, torch.cat([positions, beyond], dim=1))
                parts.append((cos[:, :-1], sin[:, :-1]))
        return torch.cat([c for c, _ in parts], dim=1), torch.cat([s for _, s in parts], dim=1)


def per_sequence_rotary(model: torch.nn.Module) -> PerSequenceRotary | None:
    """Wrap the model's rotary embedding when it depends on the largest position (LongRoPE)."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if isinstance(rotary, PerSequenceRotary):  # another runner on the same model wrapped it
        return rotary
    if rotary is None or "longrope" not in str(getattr(rotary, "rope_type", "")):
        return None
    rope = model.config.get_text_config().rope_parameters
    wrapped = PerSequenceRotary(rotary, int(rope["original_max_position_embeddings"]))
    inner.rotary_emb = wrapped  # type: ignore[union-attr]
    return wrapped


AttentionInterface.register(ATTENTION, paged_attention)
