"""RQ worker classes: SimpleWorkers (no fork once the model is loaded) that run only known jobs.

A worker process runs one `SlotWorker` thread per batch slot, all feeding one engine thread
(workers/runtime.py). RQ 2.x performs one job per worker at a time, so N threads give N jobs in
flight, each visible in RQ's registries. Off the main thread a worker cannot install signal handlers
or use SIGALRM: the process's main thread owns signals, and job timeouts use RQ's TimerDeathPenalty.
These are the RQ internals relied on (rq pinned in requirements-api.txt; tests/test_worker_jobs.py).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from rq import Queue
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.timeouts import TimerDeathPenalty
from rq.worker import SimpleWorker

from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import worker_name
from workers import jobs
from workers.jobs import KNOWN_FUNCTIONS

logger = logging.getLogger(__name__)


class UnknownJobFunction(Exception):
    """A job named a callable this worker does not serve; it is failed without being imported."""


class TrustedJob(Job):
    @property
    def func(self) -> Callable[..., Any]:
        if self.func_name not in KNOWN_FUNCTIONS:
            logger.error("refused job request_id=%s naming %r", self.id, self.func_name)
            raise UnknownJobFunction(f"job function {self.func_name!r} is not served by this worker")
        return super().func


class TokenlineWorker(SimpleWorker):
    job_class = TrustedJob

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        # RQ's own handler logs the job's arguments (the prompt); log without them.
        logger.error("job failed request_id=%s: %s", job.id, exc_info[1])
        for handler in self._exc_handlers:
            if not handler(job, *exc_info):
                break


class SlotWorker(TokenlineWorker):
    """One batch slot of a worker process, run in a thread of its own."""

    death_penalty_class = TimerDeathPenalty

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Start generating at once; RQ's bookkeeping (several round trips) then overlaps the prefill."""
        submitted = early_submit(job)
        try:
            super().execute_job(job, queue)
        finally:
            if submitted:
                jobs.runtime().abandon(submitted)  # type: ignore[union-attr]

    def _install_signal_handlers(self) -> None:
        """Signals belong to the main thread, which stops the slots itself."""

    def subscribe(self) -> None:
        """No per-slot command channel: the process is controlled by signals."""


def early_submit(job: Job) -> str | None:
    """Hand a known, valid generation job to the engine before RQ performs it (which then waits).

    Returns the request id submitted, if any.
    """
    runtime = jobs.runtime()
    if job.func_name != JOB_FUNCTION or runtime is None:
        return None
    try:
        payload = JobPayload.from_dict(job.args[0] if job.args else None)
    except (ValueError, IndexError, DeserializationError):
        return None  # performing the job reports the problem
    runtime.submit(payload)
    return payload.request_id


def slot_name(slot: int) -> str:
    return worker_name(socket.gethostname(), os.getpid(), slot)
