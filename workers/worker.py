"""The RQ worker: a SimpleWorker (no fork after the model is loaded) that runs only known jobs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rq.job import Job
from rq.worker import SimpleWorker

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
