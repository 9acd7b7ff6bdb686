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

from rq.job import Job
from rq.timeouts import TimerDeathPenalty
from rq.worker import SimpleWorker

from schemas.keys import worker_name
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

    def _install_signal_handlers(self) -> None:
        """Signals belong to the main thread, which stops the slots itself."""

    def subscribe(self) -> None:
        """No per-slot command channel: the process is controlled by signals."""


def slot_name(slot: int) -> str:
    return worker_name(socket.gethostname(), os.getpid(), slot)
