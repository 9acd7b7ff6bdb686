"""The scheduler: which sequences run in the next step.

A step either prefills newcomers or decodes the running sequences; when the runner can fuse the two
(`mixable`) and the newcomers' prompts are short, it does both in one pass. Admission is first come,
first served, bounded by `max_batch_size` running sequences. The KV cache manager (engine/kv_cache.py)
holds the running rows; the plan says which rows leave before the step and which join in it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.engine.request import Request, Sequence

# A prefill of fewer prompt tokens than this rides along with the running rows' decode in one pass
# (each weight read once); a larger one runs apart, on the prefill threads.
MIXED_PREFILL_MAX_TOKENS = 64


@dataclass
class SchedulerOutput:
    """One step's plan. `finished`: rows that leave the batch first; `prefill`: sequences that join it
    (their prompts are run and their first tokens drawn); `decode`: whether the running rows
    (those already in the batch) draw their next token in this step too."""

    prefill: list[Sequence] = field(default_factory=list)
    decode: bool = False
    finished: list[Sequence] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.prompt_ids) for s in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, max_batch_size: int, mixable: bool = False) -> None:
        self.max_batch_size = max_batch_size
        self.mixable = mixable
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.extend(request.sequences)

    def remove(self, request: Request) -> None:
        """Take a request's sequences off the waiting line; its running rows leave at the next step."""
        self.waiting = deque(s for s in self.waiting if s.request is not request)

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput(finished=[s for s in self.running if s.finished])
        if plan.finished:
            self.running = [s for s in self.running if not s.finished]
        while self.waiting and len(self.running) + len(plan.prefill) < self.max_batch_size:
            plan.prefill.append(self.waiting.popleft())
        if not plan.prefill:
            plan.decode = bool(self.running)
        else:
            plan.decode = bool(self.running) and self.mixable and plan.prompt_tokens < MIXED_PREFILL_MAX_TOKENS
        self.running.extend(plan.prefill)
        return plan
