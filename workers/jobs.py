"""The job functions a worker runs. RQ calls them by string path; nothing else is executed.

They run in a worker's queue process (workers/slots.py), which binds the link to its engine process
at start-up, not at import.
"""

from __future__ import annotations

from typing import Any

from rq import get_current_job

from schemas.job import JOB_FUNCTION
from workers.link import EngineClient

_engine: EngineClient | None = None


def bind(engine: EngineClient | None) -> None:
    global _engine
    _engine = engine


def engine() -> EngineClient | None:
    return _engine


def generate(payload: dict[str, Any]) -> dict[str, Any]:
    """The job of one request, which the engine took off the queue and serves (workers/taker.py, which
    also validates `payload`): wait for its end. A job the engine refused fails with the reason."""
    job = get_current_job()
    if _engine is None or job is None:
        raise RuntimeError("no engine is bound: jobs run only inside a worker (`python -m workers`)")
    return _engine.run(job.id)


KNOWN_FUNCTIONS = frozenset({JOB_FUNCTION})
