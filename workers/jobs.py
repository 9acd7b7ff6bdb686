"""The job functions a worker runs. RQ calls them by string path; nothing else is executed.

The runtime (model, engine, Redis) is bound by `python -m workers` at start-up, not at import.
"""

from __future__ import annotations

from typing import Any

from schemas.job import JOB_FUNCTION, JobPayload
from workers.runtime import Runtime

_runtime: Runtime | None = None


def bind(runtime: Runtime | None) -> None:
    global _runtime
    _runtime = runtime


def runtime() -> Runtime | None:
    return _runtime


def generate(payload: dict[str, Any]) -> dict[str, Any]:
    if _runtime is None:
        raise RuntimeError("no engine is bound: jobs run only inside `python -m workers`")
    request_id = payload.get("request_id") if isinstance(payload, dict) else None
    return _runtime.run(_runtime.submitted(request_id) or JobPayload.from_dict(payload))


KNOWN_FUNCTIONS = frozenset({JOB_FUNCTION})
