"""The job functions a worker runs. RQ calls them by string path; nothing else is executed.

They run in a worker's queue process (workers/slots.py), which binds the link to its engine process
at start-up, not at import.
"""

from __future__ import annotations

from typing import Any

from schemas.job import JOB_FUNCTION, JobPayload
from workers.link import EngineClient

_engine: EngineClient | None = None


def bind(engine: EngineClient | None) -> None:
    global _engine
    _engine = engine


def engine() -> EngineClient | None:
    return _engine


def generate(payload: dict[str, Any]) -> dict[str, Any]:
    if _engine is None:
        raise RuntimeError("no engine is bound: jobs run only inside a worker (`python -m workers`)")
    request_id = payload.get("request_id") if isinstance(payload, dict) else None
    return _engine.run(_engine.submitted(request_id) or JobPayload.from_dict(payload))


KNOWN_FUNCTIONS = frozenset({JOB_FUNCTION})
