"""What the engine counts and times, for the worker's metrics (workers/ops/metrics.py).

The engine thread records; the metrics side drains the observations between steps. Times are
seconds by Redis' clock (schemas/clock.py), which the API's stamp shares: a request's arrival is when
the API queued it (`JobPayload.queued_at`), so that queue time and time to first token include the
wait in Redis, as vLLM's include its frontend's, on whichever hosts the two run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.clock import clock


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # of requests whose prefill is done (once per request)
    generation_tokens: int = 0  # tokens generated, counted step by step
    queue_times: list[float] = field(default_factory=list)  # arrival → first scheduled
    first_token_times: list[float] = field(default_factory=list)  # arrival → first token
    inter_token_times: list[float] = field(default_factory=list)  # between a sequence's tokens
    e2e_times: list[float] = field(default_factory=list)  # arrival → end
    finished: list[str] = field(default_factory=list)  # finish reasons of ended sequences

    def drain(self) -> EngineStats:
        """The observations so far, leaving this object with empty lists (counters keep counting)."""
        taken = EngineStats(
            self.prompt_tokens,
            self.generation_tokens,
            self.queue_times,
            self.first_token_times,
            self.inter_token_times,
            self.e2e_times,
            self.finished,
        )
        self.queue_times, self.first_token_times, self.inter_token_times = [], [], []
        self.e2e_times, self.finished = [], []
        return taken


def now() -> float:
    return clock.now()
