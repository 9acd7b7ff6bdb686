"""RQ worker classes: SimpleWorkers (no fork once the model is loaded) that run only known jobs.

A worker's queue process (workers/slots.py) runs one `SlotWorker` thread per batch slot, performing
the jobs that the engine of its engine process takes (workers/taker.py, workers/link.py). RQ 2.x
performs one job per worker at a time, so N threads give N jobs in flight, each visible in RQ's
registries. Off the main thread a worker cannot install signal handlers or use SIGALRM: the process's
main thread owns signals, and job timeouts use RQ's TimerDeathPenalty.
These are the RQ internals relied on (rq pinned in requirements-api.txt; tests/test_worker_jobs.py,
tests/test_link.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rq import Queue
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.job import Job
from rq.timeouts import TimerDeathPenalty
from rq.worker import SimpleWorker

from workers import jobs
from workers.jobs import KNOWN_FUNCTIONS

logger = logging.getLogger(__name__)


DEQUEUE_POLL_SECONDS = 1
# RQ's loop beats (an HSET and an EXPIRE: two round trips) before and after each dequeue and after each
# job; a slot sends such a beat at most this often: on a machine with few cores they ran beside the
# engine's steps (once beside each prefill). The key lives worker_ttl + 60 s per beat.
BEAT_EVERY_SECONDS = 10


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
    """One batch slot of a worker process, run in a thread of its own.

    It performs, in RQ, the jobs that the engine process took off the queue (workers/taker.py) and
    handed over the link: RQ's own loop runs (registration, heartbeats, maintenance, the registries),
    but its dequeue waits on the link's jobs instead of Redis (see `from_the_engine`), one poll of
    DEQUEUE_POLL_SECONDS at a time, so that an idle slot leaves promptly on shutdown, or in burst mode
    once the engine has drained. `stopping` is the process's shutdown event; a job taken is performed
    even then, since the engine serves it.
    """

    death_penalty_class = TimerDeathPenalty

    def __init__(self, *args: Any, stopping: threading.Event | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stopping = stopping or threading.Event()
        self._beat_at = -float("inf")  # the first beat goes out
        self.taken: str | None = None  # the job id the last dequeue got from the engine
        self.queue_class = from_the_engine(self.queue_class, self)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        client = jobs.engine()
        if client is None:
            raise RuntimeError("no engine is bound: slots run only inside a worker (`python -m workers`)")
        while True:
            # The engine sends each take before its drain: once the drain is seen, every job taken is here.
            done = self.stop_requested or (timeout is None and client.draining.is_set())
            if done and not client.has_taken:
                return None
            self.taken = None
            try:
                # RQ's loop returns None once idle for max_idle_time: one short poll per call.
                result = super().dequeue_job_and_maintain_ttl(DEQUEUE_POLL_SECONDS, DEQUEUE_POLL_SECONDS)
            except BaseException:
                # RQ's loop failed after the take (Redis gone before its heartbeat): this slot will not
                # perform the job, so the engine drops the request; RQ's cleanup fails the job later.
                if self.taken is not None:
                    client.abandon(self.taken)
                raise
            if result is not None:
                return result

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            super().execute_job(job, queue)
        finally:
            jobs.engine().abandon(job.id)  # type: ignore[union-attr]

    @property
    def stop_requested(self) -> bool:
        return self.stopping.is_set() or self._stop_requested

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's beat; one of its loop's own (no pipeline, the default TTL) only every BEAT_EVERY_SECONDS."""
        if pipeline is None and timeout is None and time.monotonic() - self._beat_at < BEAT_EVERY_SECONDS:
            return
        super().heartbeat(timeout, pipeline)
        self._beat_at = time.monotonic()

    def set_state(self, state: str, pipeline: Any = None) -> None:
        """RQ's; a state the slot already holds is not written again (RQ sets `idle` after each job and
        again before each dequeue). Only this slot writes its worker key's state."""
        if pipeline is None and state == self.get_state():
            return
        super().set_state(state, pipeline)

    def _install_signal_handlers(self) -> None:
        """Signals belong to the main thread, which stops the slots itself."""

    def subscribe(self) -> None:
        """No per-slot command channel: the process is controlled by signals."""


def from_the_engine(queue_class: type[Queue], worker: SlotWorker) -> type[Queue]:
    """`queue_class` whose dequeue gives the next job the engine took (already moved to the queue's
    intermediate list, as RQ's dequeue moves it), waiting up to the timeout; RQ's loop performs it."""

    class FromTheEngine(queue_class):  # type: ignore[valid-type,misc]
        @classmethod
        def dequeue_any(
            cls, queues: Any, timeout: int | None, connection: Any, job_class: Any = None, **kwargs: Any
        ) -> tuple[Job, Queue] | None:
            client = jobs.engine()
            job_id = client.next_taken(timeout) if client is not None else None
            if job_id is None:
                raise DequeueTimeout(timeout, [q.key for q in queues])
            worker.taken = job_id
            try:
                serializer = kwargs.get("serializer")
                job = (job_class or cls.job_class).fetch(job_id, connection=connection, serializer=serializer)
            except NoSuchJobError:  # it expired: nothing to record in RQ
                logger.warning("job %s taken by the engine no longer exists", job_id)
                client.abandon(job_id)  # type: ignore[union-attr]
                raise DequeueTimeout(timeout, [q.key for q in queues]) from None
            return job, queues[0]

    return FromTheEngine
