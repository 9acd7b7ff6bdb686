"""The model runner: carries out a step's plan on the device and returns the logits to sample from.

It owns the forward pass (models/forward.py) and the batch's KV cache (engine/kv_cache.py), and keeps
the cache's rows in step with the sequences they belong to: row i of the cache is `rows[i]`. A plan's
finished sequences leave the cache, its newcomers are prefilled into it, and the running rows decode.
Each row's last drawn token stays on the device (`advance`), where the next decode step reads it: a
step can be launched before the host has read the one before it (engine/core.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from workers.engine.kv_cache import KVBatch
from workers.engine.request import Sequence
from workers.engine.scheduler import SchedulerOutput
from workers.models.forward import Forward, left_padded, make_forward
from workers.models.loader import LoadedModel

logger = logging.getLogger(__name__)

# A prefill of at least this many prompt tokens runs on the prefill threads; so does any prefill on an
# engine that stepped less than WARM_CORES_SECONDS ago with no row running (its cores are still awake:
# after a longer pause, each parallel region waits for a core that went to sleep).
PARALLEL_PREFILL_MIN_TOKENS = 64
WARM_CORES_SECONDS = 0.010


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


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        forward: str = "auto",
        threads: int = 0,
        prefill_threads: int = 0,
        warm_cores_seconds: float = WARM_CORES_SECONDS,
    ) -> None:
        self.loaded = loaded
        self.device = loaded.device
        self.forward: Forward = make_forward(loaded.model, forward)
        auto_decode, auto_prefill = default_threads(loaded.device)
        self.threads = threads or auto_decode
        self.prefill_threads = prefill_threads or auto_prefill
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        self.warm_cores_seconds = warm_cores_seconds
        self.stepped_at = -float("inf")  # time.monotonic() at the end of the last pass
        self.pad_id = int(loaded.model.config.pad_token_id or 0)
        self.kv = KVBatch()
        self.rows: list[Sequence] = []
        self.last: torch.Tensor | None = None  # [rows]: each row's last drawn token, on the device

    @property
    def mixable(self) -> bool:
        """Whether the forward fuses a prefill and a decode step into one pass."""
        return callable(getattr(self.forward, "mixed", None))

    def execute(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the plan (its finished rows have left: `release`); the logits [rows, vocab] and the
        sequence each row belongs to."""
        running = list(self.rows)
        try:
            if plan.prefill and plan.decode:
                logits = self._mixed(plan.prefill)
                rows = running + plan.prefill
            elif plan.prefill:
                with torch_threads(self._prefill_threads(plan.prompt_tokens)):
                    logits = self._prefill(plan.prefill)
                rows = plan.prefill
            else:
                logits = self._decode()
                rows = running
        finally:
            self.stepped_at = time.monotonic()
        return logits, rows

    def advance(self, rows: list[Sequence], tokens: torch.Tensor) -> None:
        """The tokens just drawn [len(rows)], as the next decode step's inputs: `rows` are the pass's
        rows, which end the batch (a prefill's newcomers) or are all of it."""
        if self.last is None or len(rows) == len(self.rows):
            self.last = tokens
        else:
            self.last = torch.cat((self.last[: len(self.rows) - len(rows)], tokens))

    def release(self, sequences: list[Sequence]) -> None:
        """These sequences' rows leave the cache (the last rows move into their places)."""
        gone = {id(s) for s in sequences}
        drop = [i for i, s in enumerate(self.rows) if id(s) in gone]
        if drop:
            order = self.kv.drop(drop)
            self.rows = [self.rows[i] for i in order]
            self.last = self.last[torch.tensor(order, dtype=torch.long, device=self.device)] if order else None

    def cool_down(self) -> None:
        """Count the cores as idle: the host is busy elsewhere (a client left; the API unwinds its
        stream), so the next short prefill stays on the decode threads."""
        self.stepped_at = -float("inf")

    def reset(self) -> None:
        """Forget every row: after a failure that may have left the cache half-written."""
        self.kv = KVBatch()
        self.rows = []
        self.last = None
        release_device_memory(self.device)

    def _prefill_threads(self, tokens: int) -> int:
        if tokens >= PARALLEL_PREFILL_MIN_TOKENS:
            return self.prefill_threads
        warm = time.monotonic() - self.stepped_at < self.warm_cores_seconds
        return self.prefill_threads if not self.rows and warm else 0

    def _prompt_inputs(self, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return left_padded([s.prompt_ids for s in sequences], self.pad_id, self.device)

    def _decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running rows' last tokens and their positions; the cache's mask gains their column."""
        assert self.last is not None
        input_ids = self.last.view(-1, 1)
        positions = self.kv.next_positions()
        self.kv.grow()
        return input_ids, positions

    @torch.inference_mode()
    def _prefill(self, sequences: list[Sequence]) -> torch.Tensor:
        input_ids, positions, mask = self._prompt_inputs(sequences)
        logits, layers = self.forward.prefill(input_ids, positions, mask)
        self.kv.append(layers, mask)
        self.rows.extend(sequences)
        return logits

    @torch.inference_mode()
    def _decode(self) -> torch.Tensor:
        input_ids, positions = self._decode_inputs()
        try:
            return self.forward.decode(input_ids, positions, self.kv)
        except BaseException:
            self.kv.ungrow()
            raise

    @torch.inference_mode()
    def _mixed(self, sequences: list[Sequence]) -> torch.Tensor:
        """The newcomers' prefill and the running rows' decode in one pass: logits of the running rows,
        then of the newcomers."""
        input_ids, positions, mask = self._prompt_inputs(sequences)
        decode_ids, decode_positions = self._decode_inputs()
        try:
            logits, layers, decode_logits = self.forward.mixed(  # type: ignore[attr-defined]
                input_ids, positions, mask, decode_ids, decode_positions, self.kv
            )
        except BaseException:
            self.kv.ungrow()
            raise
        self.kv.append(layers, mask)
        self.rows.extend(sequences)
        return torch.cat((decode_logits, logits))


def release_device_memory(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    empty_cache = getattr(backend, "empty_cache", None)
    if device.type != "cpu" and callable(empty_cache):
        empty_cache()
