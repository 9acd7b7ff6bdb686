"""The job function named in every request's RQ job (`schemas.job.JOB_FUNCTION`).

A tokenline worker never calls it: its RQ worker hands the job's payload to the engine
(workers/serving/intake.py). It exists so that the name resolves, and it refuses to run in any
other worker (a plain `rq worker` pointed at a model's queue), which fails the job with the reason.
"""

from __future__ import annotations

from typing import Any


def generate(payload: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("tokenline jobs are served only by a tokenline worker (`python -m workers`)")
