"""Sampling and stopping parameters: validated once at the edge, carried in the job as-is."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MAX_SEED = 2**64 - 1
MAX_STOP_SEQUENCES = 4


@dataclass(frozen=True)
class SamplingParams:
    """What the worker needs to pick and stop tokens for one sequence.

    temperature 0 means greedy; top_k -1 means off; seed is always set by the API (the client's, or
    one the server picked) so that every answer can be reproduced.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stop"] = list(self.stop)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        return cls(**{**data, "stop": tuple(data.get("stop") or ())})
