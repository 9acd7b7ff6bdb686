"""RQ worker classes: SimpleWorkers (no fork once the model is loaded) that run only known jobs.

A worker's queue process (workers/slots.py) runs one `SlotWorker` thread per batch slot, all feeding
the engine of its engine process (workers/link.py). RQ 2.x performs one job per worker at a time, so
N threads give N jobs in flight, each visible in RQ's registries. Off the main thread a worker cannot
install signal handlers or use SIGALRM: the process's main thread owns signals, and job timeouts use
RQ's TimerDeathPenalty.
These are the RQ internals relied on (rq pinned in requirements-api.txt; tests/test_worker_jobs.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rq import Queue
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.timeouts import TimerDeathPenalty
from rq.worker import SimpleWorker

from schemas.job import JOB_FUNCTION, JobPayload
from workers import jobs
from workers.jobs import KNOWN_FUNCTIONS
from workers.link import Pending

logger = logging.getLogger(__name__)


DEQUEUE_POLL_SECONDS = 1
# A slot waiting for its turn to listen renews its RQ worker key this often (RQ's worker_ttl is 420 s).
IDLE_HEARTBEAT_SECONDS = 60
# RQ's loop beats (an HSET and an EXPIRE: two round trips) before and after each dequeue and after each
# job; a slot sends such a beat at most this often. Those right after a dequeue ran beside the prefill
# of the job just handed over, on a machine with few cores. The key lives worker_ttl + 60 s per beat.
BEAT_EVERY_SECONDS = 10
# A slot starts RQ's bookkeeping of its job once the engine has published the job's first step, or after this.
FIRST_STEP_WAIT_SECONDS = 2.0


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

    `stopping` is the process's shutdown event. The idle slot that holds `listening` (one per process)
    polls the queue every DEQUEUE_POLL_SECONDS instead of blocking for minutes, so that it leaves
    promptly on shutdown; a job it pops after shutdown began goes back to the front of its queue for
    another worker.
    """

    death_penalty_class = TimerDeathPenalty

    def __init__(
        self,
        *args: Any,
        stopping: threading.Event | None = None,
        listening: threading.Lock | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.stopping = stopping or threading.Event()
        self.listening = listening or threading.Lock()
        self._beat_at = -float("inf")  # the first beat goes out
        self.handed_over: str | None = None  # the job id whose request the last dequeue handed over
        self.queue_class = handing_over(self.queue_class, self)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        if timeout is None:  # burst mode: RQ's own non-blocking dequeue
            return self._dequeue(timeout, max_idle_time)
        while not self.stop_requested:
            # One idle slot of the process listens on the queue at a time (`listening` is shared); the
            # others wait for their turn without a Redis call each per poll, which would steal the
            # interpreter from the engine thread, but for RQ's worker heartbeat.
            if not self.listening.acquire(timeout=DEQUEUE_POLL_SECONDS):
                if time.monotonic() - self._beat_at > IDLE_HEARTBEAT_SECONDS:
                    self.heartbeat()
                continue
            try:
                # RQ's loop returns None once idle for max_idle_time: one short poll per call.
                result = self._dequeue(DEQUEUE_POLL_SECONDS, max_idle_time=DEQUEUE_POLL_SECONDS)
            finally:
                self.listening.release()
            if result is None:
                continue
            job, queue = result
            if self.stop_requested and self.handed_over != job.id:
                queue.push_job_id(job.id, at_front=True)
                logger.info("shutting down: job %s goes back to the front of %s", job.id, queue.name)
                return None
            return result
        return None

    def _dequeue(self, timeout: int | None, max_idle_time: int | None) -> Any:
        """RQ's dequeue, whose queue class hands the job over to the engine (see `handing_over`). If
        RQ's loop fails after that (Redis gone before its heartbeat), the request is abandoned (cancelled):
        this slot will not perform the job, which stays in RQ's intermediate queue for RQ's cleanup."""
        self.handed_over = None
        try:
            return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        except BaseException:
            if self.handed_over is not None:
                jobs.engine().abandon(self.handed_over)  # type: ignore[union-attr]
            raise

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Make sure the request is with the engine (the dequeue normally handed it over), and do RQ's
        bookkeeping (Python work and several round trips) once its first step is out: on a machine with
        few cores it would slow the prefill down."""
        submitted = early_submit(job)
        try:
            if submitted is not None:
                submitted.started.wait(FIRST_STEP_WAIT_SECONDS)
            super().execute_job(job, queue)
        finally:
            if submitted is not None:
                jobs.engine().abandon(submitted.payload.request_id)  # type: ignore[union-attr]

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


def handing_over(queue_class: type[Queue], worker: SlotWorker) -> type[Queue]:
    """`queue_class` with a dequeue that hands the job's request to the engine as soon as the job is
    fetched, unless the slot is stopping. RQ's worker loop follows a dequeue with a heartbeat (a
    round trip) and its logging before it performs the job: the first token need not wait for them."""

    class HandingOver(queue_class):  # type: ignore[valid-type,misc]
        @classmethod
        def dequeue_any(cls, *args: Any, **kwargs: Any) -> tuple[Job, Queue] | None:
            result = super().dequeue_any(*args, **kwargs)
            if result is not None and not worker.stop_requested and early_submit(result[0]) is not None:
                worker.handed_over = result[0].id
            return result

    return HandingOver


def early_submit(job: Job) -> Pending | None:
    """Hand a known, valid generation job to the engine before RQ performs it (which then waits).

    Returns the request handed over, if any.
    """
    engine = jobs.engine()
    if job.func_name != JOB_FUNCTION or engine is None:
        return None
    payload = engine.submitted(job.id)  # handed over at the dequeue: parsed once, there
    if payload is None:
        try:
            payload = JobPayload.from_dict(job.args[0] if job.args else None)
        except (ValueError, IndexError, DeserializationError):
            return None  # performing the job reports the problem
    return engine.submit(payload)
