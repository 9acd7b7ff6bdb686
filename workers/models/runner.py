"""The model runner: carries out a step's plan on the device and returns the logits to sample from.

It owns the KV pool (models/paged.py) and runs each step as one packed pass of the model's own
transformers forward with tokenline's paged attention: every scheduled sequence's new tokens, their
positions, where their keys and values go and which slots each one attends (from the block tables
of engine/kv_cache.py). Only the positions that draw a token reach the LM head. A decoding
sequence's input is the token it drew last; when that token is still on the device (a step launched
before the host read the one before it, engine/core.py), it is taken from there.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from workers.engine.request import Sequence
from workers.engine.scheduler import SchedulerOutput
from workers.models.loader import LoadedModel
from workers.models.paged import ATTENTION, Group, PagedKV, PagedStep, per_sequence_rotary

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


def default_threads(device: torch.device) -> tuple[int, int]:
    """(decode, prefill) torch threads when the settings leave them at 0. On a CPU, a decode step is
    too small to gain from every core and shares the host with the API and Redis: half the cores;
    a prefill gets them all. On an accelerator the host threads only launch kernels: torch's default."""
    if device.type != "cpu":
        return 0, 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // 2), cores


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or torch_npu's RuntimeError that says the same."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the pool: the model's attention layers (each one's sliding window, 0 for
    full attention), KV heads, head size, dtype."""

    windows: tuple[int, ...]
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVShape:
        config = model.config.get_text_config()
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        layers = int(config.num_hidden_layers)
        window = int(getattr(config, "sliding_window", None) or 0)
        types = getattr(config, "layer_types", None)
        if types is not None:  # alternating layers (Gemma 2/3, Qwen2's max_window_layers, ...)
            windows = tuple(window if kind == "sliding_attention" else 0 for kind in types[:layers])
        else:  # a sliding window on every layer (Mistral, Mixtral, Phi-3) or none
            windows = (window,) * layers
        return cls(windows, kv_heads, head_dim, next(model.parameters()).dtype)

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
class Scored:
    """Prompt positions [first, first + count) of a sequence whose logits score the next prompt token."""

    sequence: Sequence
    first: int
    count: int


@dataclass
class Pass:
    """A pass's output: logits to sample from [rows], their sequences, and the scored prompt
    positions' logits [sum of counts], in the order of `scores`."""

    logits: torch.Tensor
    rows: list[Sequence]
    score_logits: torch.Tensor
    scores: list[Scored]

    @staticmethod
    def join(passes: list[Pass]) -> Pass:
        return Pass(
            torch.cat([p.logits for p in passes]),
            [s for p in passes for s in p.rows],
            torch.cat([p.score_logits for p in passes]),
            [s for p in passes for s in p.scores],
        )


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
        self.last_rows: dict[int, int] = {}  # id(sequence) → its place in `last`

    def execute(self, plan: SchedulerOutput) -> Pass:
        """Run the plan: the logits to sample from, the sequence of each row, and the logits of the
        prompt positions that requests scoring their prompt (prompt_logprobs) asked for."""
        try:
            with torch_threads(self._threads(plan)):
                return self._run(plan)
        finally:
            self.stepped_at = time.monotonic()

    def advance(self, rows: list[Sequence], tokens: torch.Tensor) -> None:
        """The tokens just drawn [len(rows)]: the next step's inputs for these sequences."""
        self.last = tokens
        self.last_rows = {id(s): i for i, s in enumerate(rows)}

    def cool_down(self) -> None:
        """Count the cores as idle: the host is busy elsewhere (a client left; the API unwinds its
        stream), so the next short prefill stays on the decode threads."""
        self.stepped_at = -float("inf")

    def reset(self) -> None:
        """After a failed pass: forget the drawn tokens on the device."""
        self.last, self.last_rows = None, {}
        release_device_memory(self.device)

    def _threads(self, plan: SchedulerOutput) -> int:
        prompt = plan.prompt_tokens
        if prompt >= PARALLEL_PREFILL_MIN_TOKENS:
            return self.prefill_threads
        decoding = len(plan.scheduled) > sum(1 for s in plan.scheduled if s.count > 1 or not s.sample)
        warm = time.monotonic() - self.stepped_at < self.warm_cores_seconds
        return self.prefill_threads if prompt and not decoding and warm else 0

    @torch.inference_mode()
    def _run(self, plan: SchedulerOutput) -> Pass:
        size = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        write: list[int] = []
        pending: list[tuple[int, int]] = []  # (place in the step, place in `last`)
        decode: list[tuple[int, list[int], int]] = []  # (place, blocks, context)
        prefill: list[Group] = []
        keep: list[int] = []
        rows: list[Sequence] = []
        segments: list[tuple[int, int]] = []
        ring_write: list[int] = []
        ring_decode: list[tuple[int, int, int]] = []  # (place, ring start, context)
        ring_prefill: list[Group] = []
        scores: list[Scored] = []
        score_keep: list[int] = []
        for item in plan.scheduled:
            sequence, start, end = item.sequence, item.start, item.start + item.count
            blocks = sequence.table.blocks
            place = len(ids)
            known = sequence.tokens(start, end)
            if len(known) < item.count:  # its last draw is still on the device
                pending.append((place + len(known), self.last_rows[id(sequence)]))
                known.append(0)
            ids += known
            segments.append((place, len(ids)))
            positions += range(start, end)
            write += [blocks[p // size] * size + p % size for p in range(start, end)]
            if item.count == 1:
                decode.append((place, blocks, end))
            else:
                prefill.append(self._group(place, start, end, blocks))
            if self.window:
                base = sequence.table.ring * self.ring_tokens  # type: ignore[operator]
                ring_write += [base + p % self.ring_tokens for p in range(start, end)]
                if item.count == 1:
                    ring_decode.append((place, base, end))
                else:
                    ring_prefill.append(self._ring_group(place, start, end, base))
            if item.sample:
                keep.append(len(ids) - 1)
                rows.append(sequence)
            if sequence.params.prompt_logprobs is not None:
                first = max(start, sequence.scored - 1)
                last = min(end, len(sequence.prompt_ids) - 1)  # position p scores prompt token p + 1
                if first < last:
                    scores.append(Scored(sequence, first, last - first))
                    score_keep += range(place + first - start, place + last - start)
        device = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        if pending:
            at, source = zip(*pending, strict=True)
            assert self.last is not None
            input_ids[list(at)] = self.last[list(source)]
        groups = prefill
        if decode:
            groups = [self._decode_group(decode, whole=not prefill), *prefill]
        self.kv.step = PagedStep(torch.tensor(write, dtype=torch.long, device=device), groups)
        if self.window:
            self.kv.step.ring_write = torch.tensor(ring_write, dtype=torch.long, device=device)
            decodes = [self._ring_decode_group(ring_decode, whole=not ring_prefill)] if ring_decode else []
            self.kv.step.ring_groups = decodes + ring_prefill
        if self.rotary is not None:
            self.rotary.segments = segments
        try:
            out = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0),
                use_cache=False,
                logits_to_keep=torch.tensor(keep + score_keep, dtype=torch.long, device=device),
                paged_kv=self.kv,
            )
        finally:
            self.kv.step = None
        logits = out.logits[0].float()
        return Pass(logits[: len(keep)], rows, logits[len(keep) :], scores)

    def _slots(self, blocks: list[int], length: int) -> torch.Tensor:
        table = torch.tensor(blocks[: -(-length // self.block_size)], dtype=torch.long)
        return (table[:, None] * self.block_size + torch.arange(self.block_size)).view(-1)[:length]

    def _group(self, place: int, start: int, end: int, blocks: list[int]) -> Group:
        """One sequence's prompt chunk: queries at positions [start, end) over its slots [0, end)."""
        device = self.device
        return Group(
            queries=torch.arange(place, place + end - start, device=device).unsqueeze(0),
            slots=self._slots(blocks, end).to(device).unsqueeze(0),
            key_positions=torch.arange(end, device=device).unsqueeze(0),
            query_positions=torch.arange(start, end, device=device).unsqueeze(0),
        )

    def _decode_group(self, decode: list[tuple[int, list[int], int]], whole: bool) -> Group:
        """The decoding sequences, one query each, over their slots padded to the longest context."""
        size = self.block_size
        longest = max(context for _, _, context in decode)
        width = -(-longest // size)
        tables = torch.tensor([b[: -(-c // size)] + [b[0]] * (width - -(-c // size)) for _, b, c in decode])
        slots = (tables[:, :, None] * size + torch.arange(size)).view(len(decode), -1)[:, :longest]
        contexts = torch.tensor([c for _, _, c in decode])
        key_positions = torch.arange(longest).expand(len(decode), -1)
        key_positions = torch.where(key_positions < contexts[:, None], key_positions, -1)
        device = self.device
        return Group(
            queries=torch.tensor([[p] for p, _, _ in decode], device=device),
            slots=slots.to(device),
            key_positions=key_positions.to(device),
            query_positions=(contexts - 1)[:, None].to(device),
            whole=whole,
        )


    def _ring_group(self, place: int, start: int, end: int, base: int) -> Group:
        """One sequence's prompt chunk in the sliding-window layers: its keys from the window before
        `start` on, in its ring."""
        device = self.device
        keys = torch.arange(max(0, start - self.window + 1), end)
        return Group(
            queries=torch.arange(place, place + end - start, device=device).unsqueeze(0),
            slots=(base + keys % self.ring_tokens).to(device).unsqueeze(0),
            key_positions=keys.to(device).unsqueeze(0),
            query_positions=torch.arange(start, end, device=device).unsqueeze(0),
        )

    def _ring_decode_group(self, decode: list[tuple[int, int, int]], whole: bool) -> Group:
        """The decoding sequences in the sliding-window layers: each over its last `window` positions."""
        ends = torch.tensor([c for _, _, c in decode])
        bases = torch.tensor([b for _, b, _ in decode])
        lows = (ends - self.window).clamp(min=0)
        width = int((ends - lows).max())
        keys = lows[:, None] + torch.arange(width)
        valid = keys < ends[:, None]
        slots = torch.where(valid, bases[:, None] + keys % self.ring_tokens, bases[:, None])
        device = self.device
        return Group(
            queries=torch.tensor([[p] for p, _, _ in decode], device=device),
            slots=slots.to(device),
            key_positions=torch.where(valid, keys, -1).to(device),
            query_positions=(ends - 1)[:, None].to(device),
            whole=whole,
        )


def release_device_memory(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    empty_cache = getattr(backend, "empty_cache", None)
    if device.type != "cpu" and callable(empty_cache):
        empty_cache()
