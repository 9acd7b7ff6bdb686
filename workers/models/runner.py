"""The model runner: carries out a step's plan on the device and returns the logits to sample from.

It owns the KV pool (models/paged.py) and runs each step as one packed pass of the model's own
transformers forward with tokenline's paged attention: every scheduled sequence's new tokens, their
positions, where their keys and values go and which slots each one attends (from the block tables
of engine/kv_cache.py). Only the positions that draw a token reach the LM head. A decoding
sequence's input is the token it drew last; when that token is still on the device (a step launched
before the host read the one before it, engine/core.py), it is taken from there.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from workers.models.loader import LoadedModel
from workers.models.paged import ATTENTION, DecodeTables, Group, PagedKV, PagedStep, RingTables, per_sequence_rotary
from workers.models.step import StepBatch

logger = logging.getLogger(__name__)

# A step of at least this many tokens runs on the prefill threads; so does any step on an engine
# that stepped less than WARM_CORES_SECONDS ago with no decode in it (its cores are still awake:
# after a longer pause, each parallel region waits for a core that went to sleep).
PARALLEL_PREFILL_MIN_TOKENS = 64
WARM_CORES_SECONDS = 0.010
# With npuMemSize -1, the pool takes this share of the device memory free after loading the weights.
FREE_MEMORY_SHARE = 0.9
# On a CPU, -1 sizes the pool for this many full-length sequences per batch slot (the rest of the
# host's memory is the API's, Redis's and the page cache's).
CPU_CONTEXTS_PER_SLOT = 2


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block on `count` torch intra-op threads (0: leave the setting as it is)."""
    previous = torch.get_num_threads()
    if count <= 0 or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def default_threads(device: torch.device, ranks: int = 1) -> tuple[int, int]:
    """(decode, prefill) torch threads when the settings leave them at 0. On a CPU, a decode step is
    too small to gain from every core and shares the host with the API and Redis: half the cores;
    a prefill gets them all; the `ranks` of a tensor-parallel group share them. On an accelerator the
    host threads only launch kernels: torch's default."""
    if device.type != "cpu":
        return 0, 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (2 * ranks)), max(1, cores // ranks)


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or torch_npu's RuntimeError that says the same."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the pool: the model's attention layers (each one's sliding window, 0 for
    full attention), KV heads, head size, dtype; and the longest context the pool serves."""

    windows: tuple[int, ...]
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    context: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module, shards: int = 1, context: int = 0) -> KVShape:
        """The model's shape, or one rank's part of it when `shards` ranks split the KV heads. A window
        that a `context`-token sequence cannot outgrow is full attention (Phi-3.5 and Phi-4-mini ship
        `sliding_window: 262144`)."""
        config = model.config.get_text_config()
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        layers = int(config.num_hidden_layers)
        window = int(getattr(config, "sliding_window", None) or 0)
        if context and window >= context:
            window = 0
        types = getattr(config, "layer_types", None)
        if types is not None:  # alternating layers (Gemma 2/3, Qwen2's max_window_layers, ...)
            windows = tuple(window if kind == "sliding_attention" else 0 for kind in types[:layers])
        else:  # a sliding window on every layer (Mistral, Mixtral, Phi-3) or none
            windows = (window,) * layers
        return cls(windows, kv_heads // shards, head_dim, next(model.parameters()).dtype, context)

    @property
    def full_layers(self) -> int:
        return sum(1 for w in self.windows if w == 0)

    @property
    def bytes_per_token(self) -> int:
        """Of all layers: what a token costs where every layer keeps it."""
        return PagedKV.bytes_per_token(len(self.windows), self.kv_heads, self.head_dim, self.dtype)

    @property
    def full_bytes_per_token(self) -> int:
        return PagedKV.bytes_per_token(self.full_layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def sliding_bytes_per_token(self) -> int:
        return self.bytes_per_token - self.full_bytes_per_token


@dataclass(frozen=True)
class KVLayout:
    """The pool as sized at start-up: `num_blocks` blocks of `block_size` slots for the full-attention
    layers, and for the sliding-window layers one ring of `ring_tokens` slots per batch slot (a
    sequence's token at position p sits at p mod ring_tokens: the window and one step's tokens fit)."""

    shape: KVShape
    block_size: int
    num_blocks: int
    rings: int
    ring_tokens: int

    @property
    def window(self) -> int:
        return max(self.shape.windows)

    @property
    def bytes(self) -> int:
        ring_bytes = self.rings * self.ring_tokens * self.shape.sliding_bytes_per_token
        return self.num_blocks * self.block_size * self.shape.full_bytes_per_token + ring_bytes

    @classmethod
    def plan(
        cls,
        shape: KVShape,
        device: torch.device,
        mem_gib: float,
        block_size: int,
        max_batch_size: int,
        max_model_len: int,
        max_step_tokens: int,
    ) -> KVLayout:
        """`mem_gib` GiB (npuMemSize), or with -1 a share of the device's free memory (on a CPU: enough
        for CPU_CONTEXTS_PER_SLOT full contexts per batch slot); the rings first, the blocks from the rest."""
        window = max(shape.windows)
        rings = max_batch_size if window else 0
        ring_tokens = window - 1 + max_step_tokens if window else 0
        ring_bytes = rings * ring_tokens * shape.sliding_bytes_per_token
        if mem_gib > 0:
            budget = int(mem_gib * 2**30)
        elif device.type == "cpu":
            contexts = CPU_CONTEXTS_PER_SLOT * max_batch_size * (max_model_len + block_size)
            budget = contexts * shape.full_bytes_per_token + ring_bytes
        else:
            backend = getattr(torch, device.type)
            free, _total = backend.mem_get_info(device)
            budget = int(free * FREE_MEMORY_SHARE)
        if budget < ring_bytes:
            raise ValueError(
                f"npuMemSize holds {budget / 2**30:.3f} GiB, less than the {ring_bytes / 2**30:.3f} GiB "
                f"the sliding-window layers need ({rings} batch slots × {ring_tokens} tokens)"
            )
        if shape.full_layers:
            blocks = max(1, (budget - ring_bytes) // (block_size * shape.full_bytes_per_token))
        else:  # the rings are all the memory: the blocks only count tokens
            blocks = max_batch_size * -(-max_model_len // block_size)
        return cls(shape, block_size, blocks, rings, ring_tokens)


@dataclass
class StepInputs:
    """The attention's view of a step, built on the host from its batch: the pool slots the new
    tokens' keys and values go to, the attention groups (and both for the sliding-window layers'
    rings), and each sequence's [start, end) in the step with its first position and its prompt's
    length (for a per-sequence rotary embedding)."""

    write: list[int] = field(default_factory=list)
    groups: list[Group | DecodeTables] = field(default_factory=list)
    ring_write: list[int] = field(default_factory=list)
    ring_groups: list[Group | RingTables] = field(default_factory=list)
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)


class StepSender(Protocol):
    """Where a tensor-parallel leader sends each step before running it (models/parallel.py)."""

    def send(self, batch: StepBatch, input_ids: torch.Tensor) -> None: ...

    def ping(self) -> None: ...


class GroupBroken(RuntimeError):
    """A pass of a tensor-parallel group failed: its ranks no longer agree on which collective comes
    next, so the group cannot serve any more and must be started again."""


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        layout: KVLayout,
        threads: int = 0,
        prefill_threads: int = 0,
        warm_cores_seconds: float = WARM_CORES_SECONDS,
    ) -> None:
        self.device = loaded.device
        self.model = loaded.model
        self.model.set_attn_implementation(ATTENTION)
        self.rotary = per_sequence_rotary(self.model)
        self.kv = PagedKV(layout, self.device)
        self.block_size = layout.block_size
        self.rings = layout.rings
        self.ring_tokens = layout.ring_tokens
        self.window = layout.window
        auto_decode, auto_prefill = default_threads(loaded.device)
        self.threads = threads or auto_decode
        self.prefill_threads = prefill_threads or auto_prefill
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        self.warm_cores_seconds = warm_cores_seconds
        self.stepped_at = -float("inf")  # time.monotonic() at the end of the last pass
        self.last: torch.Tensor | None = None  # the tokens the last step drew, on the device
        self.group: StepSender | None = None  # the other ranks of a tensor-parallel group

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run the step: the logits [len(batch.keep), vocab] of the places it keeps, in float32."""
        try:
            with torch_threads(self._threads(batch)):
                return self._run(batch)
        finally:
            self.stepped_at = time.monotonic()

    def advance(self, tokens: torch.Tensor) -> None:
        """The tokens just drawn, on the device: the rows a next step's `pending` refers to."""
        self.last = tokens

    def idle(self) -> None:
        """Between steps while there is no work: a tensor-parallel leader tells its followers it is alive."""
        if self.group is not None:
            self.group.ping()

    def cool_down(self) -> None:
        """Count the cores as idle: the host is busy elsewhere (a client left; the API unwinds its
        stream), so the next short prefill stays on the decode threads."""
        self.stepped_at = -float("inf")

    def reset(self) -> None:
        """After a failed pass: forget the drawn tokens on the device."""
        self.last = None
        release_device_memory(self.device)

    def _threads(self, batch: StepBatch) -> int:
        prompt = batch.prompt_tokens
        if prompt >= PARALLEL_PREFILL_MIN_TOKENS:
            return self.prefill_threads
        warm = time.monotonic() - self.stepped_at < self.warm_cores_seconds
        return self.prefill_threads if prompt and not batch.decodes and warm else 0

    @torch.inference_mode()
    def _run(self, batch: StepBatch) -> torch.Tensor:
        input_ids = self._input_ids(batch)
        if self.group is None:
            return self.forward(batch, input_ids)
        self.group.send(batch, input_ids)
        try:
            return self.forward(batch, input_ids)
        except Exception as exc:
            raise GroupBroken(f"a pass of the device group failed: {type(exc).__name__}: {exc}") from exc

    def prepare(self, batch: StepBatch) -> StepInputs:
        """The attention's view of the step, built on the host from the batch's block tables."""
        size = self.block_size
        inputs = StepInputs()
        write = inputs.write
        decode: list[tuple[int, list[int], int]] = []  # (place, blocks, context)
        prefill: list[Group | DecodeTables] = []
        ring_decode: list[tuple[int, int, int]] = []  # (place, ring start, context)
        ring_prefill: list[Group | RingTables] = []
        for i, place in enumerate(batch.query_start):
            count, end, blocks = batch.query_len[i], batch.context_len[i], batch.block_tables[i]
            start = end - count
            inputs.segments.append((place, place + count, start, batch.prompt_len[i]))
            write += [blocks[p // size] * size + p % size for p in range(start, end)]
            if count == 1:
                decode.append((place, blocks, end))
            else:
                prefill.append(self._group(place, start, end, blocks))
            if self.window:
                base = batch.rings[i] * self.ring_tokens
                inputs.ring_write += [base + p % self.ring_tokens for p in range(start, end)]
                if count == 1:
                    ring_decode.append((place, base, end))
                else:
                    ring_prefill.append(self._ring_group(place, start, end, base))
        inputs.groups = prefill
        if decode:
            inputs.groups = [self._decode_group(decode, whole=not prefill), *prefill]
        if ring_decode:
            inputs.ring_groups = [self._ring_decode_group(ring_decode, whole=not ring_prefill)]
        inputs.ring_groups += ring_prefill
        return inputs

    def _input_ids(self, batch: StepBatch) -> torch.Tensor:
        """The step's token ids on the device, the draws still there taken from the last step's."""
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        if batch.pending:
            at, source = zip(*batch.pending, strict=True)
            assert self.last is not None
            input_ids[list(at)] = self.last[list(source)]
        return input_ids

    @torch.inference_mode()
    def forward(self, batch: StepBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """The packed pass: the logits [len(batch.keep), vocab] of the kept positions, in float32."""
        device = self.device
        inputs = self.prepare(batch)
        self.kv.step = PagedStep(
            torch.tensor(inputs.write, dtype=torch.long, device=device), [g.to(device) for g in inputs.groups]
        )
        if self.window:
            self.kv.step.ring_write = torch.tensor(inputs.ring_write, dtype=torch.long, device=device)
            self.kv.step.ring_groups = [g.to(device) for g in inputs.ring_groups]
        if self.rotary is not None:
            self.rotary.segments = inputs.segments
        try:
            out = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=torch.tensor(batch.positions, dtype=torch.long, device=device).unsqueeze(0),
                use_cache=False,
                logits_to_keep=torch.tensor(batch.keep, dtype=torch.long, device=device),
                paged_kv=self.kv,
            )
        finally:
            self.kv.step = None
        return out.logits[0].float()

    def _slots(self, blocks: list[int], length: int) -> torch.Tensor:
        table = torch.tensor(blocks[: -(-length // self.block_size)], dtype=torch.long)
        return (table[:, None] * self.block_size + torch.arange(self.block_size)).view(-1)[:length]

    def _group(self, place: int, start: int, end: int, blocks: list[int]) -> Group:
        """One sequence's prompt chunk: queries at positions [start, end) over its slots [0, end)."""
        return Group(
            queries=torch.arange(place, place + end - start).unsqueeze(0),
            slots=self._slots(blocks, end).unsqueeze(0),
            key_positions=torch.arange(end).unsqueeze(0),
            query_positions=torch.arange(start, end).unsqueeze(0),
        )

    def _decode_group(self, decode: list[tuple[int, list[int], int]], whole: bool) -> DecodeTables:
        """The decoding sequences, one query each, over their slots padded to the longest context."""
        size = self.block_size
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

    def _ring_group(self, place: int, start: int, end: int, base: int) -> Group:
        """One sequence's prompt chunk in the sliding-window layers: its keys from the window before
        `start` on, in its ring."""
        keys = torch.arange(max(0, start - self.window + 1), end)
        return Group(
            queries=torch.arange(place, place + end - start).unsqueeze(0),
            slots=(base + keys % self.ring_tokens).unsqueeze(0),
            key_positions=keys.unsqueeze(0),
            query_positions=torch.arange(start, end).unsqueeze(0),
        )

    def _ring_decode_group(self, decode: list[tuple[int, int, int]], whole: bool) -> RingTables:
        """The decoding sequences in the sliding-window layers: each over its last `window` positions."""
        return RingTables(
            queries=torch.tensor([[p] for p, _, _ in decode]),
            ends=torch.tensor([c for _, _, c in decode]),
            bases=torch.tensor([b for _, b, _ in decode]),
            window=self.window,
            ring_tokens=self.ring_tokens,
            whole=whole,
        )


def release_device_memory(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    empty_cache = getattr(backend, "empty_cache", None)
    if device.type != "cpu" and callable(empty_cache):
        empty_cache()
