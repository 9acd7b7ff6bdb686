"""The RQ side of a worker: one RQ `SimpleWorker` per process that hands each job to the engine.

RQ's own loop runs unchanged — registration, `rq suspend` / `rq resume`, maintenance, dequeue,
signals (SIGTERM is a warm shutdown: the worker drains) — with two of its methods extended:
`check_for_suspension` also waits for a free batch slot, and `execute_job` (left by RQ to its worker
classes) hands the job to the engine instead of performing it: it marks the job started
(workers/serving/inflight.py) and returns, and the loop dequeues the next. `heartbeat` and
`set_state` are RQ's, with fewer writes; the state others read (`rq info`, rq-dashboard) is `busy`
while requests are in flight, as the job table tells it. The engine serves many jobs at once; each
job's end is recorded when its request ends (workers/serving/publisher.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rq import Queue
from rq.exceptions import StopRequested
from rq.job import Job
from rq.suspension import is_suspended
from rq.worker import SimpleWorker, WorkerStatus

from workers.serving.inflight import JobTable
from workers.serving.loop import EngineLoop

logger = logging.getLogger(__name__)

ROOM_POLL_SECONDS = 1.0
# The worker's RQ heartbeat goes out this often (also while it waits for a free slot).
RQ_BEAT_SECONDS = 10.0
# RQ's suspension check at the top of its loop runs at most this often while jobs keep coming; each
# dequeued job is checked again before it is taken.
SUSPENSION_RECHECK_SECONDS = 0.5


class IntakeWorker(SimpleWorker):
    """RQ's worker loop, with the engine's batch slots as the one extra condition for taking a job: before
    each dequeue the loop waits, beside `rq suspend`, until a slot is free, so a job is never taken off
    its queue for a full engine (where it could no longer be withdrawn by its client).

    A job's way in is kept short, since its first token waits for it: RQ's record of its start is one
    round trip, and the loop's own heartbeats (three a job) are sent at most every RQ_BEAT_SECONDS (the
    worker key lives 480 s); a state the worker already holds is not written again."""

    def __init__(
        self, *args: Any, engine: EngineLoop, jobs: JobTable, stopping: threading.Event | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.engine = engine
        self.jobs = jobs
        # Set by a signal that came before RQ's loop installed its own handlers (or by a lost lease).
        self.stopping = stopping or threading.Event()
        self.reserved = False  # a batch slot is held for the next job dequeued
        self.holding = False  # a job was dequeued and is not yet handed over
        self.checked_at = -float("inf")  # time.monotonic() of the last suspension check
        self.beat_at = -float("inf")
        self.shown: str | None = None  # the state last written to Redis
        jobs.on_count = self._count_changed

    def check_for_suspension(self, burst: bool) -> None:
        """RQ's check (a round trip), at most every SUSPENSION_RECHECK_SECONDS while jobs keep coming:
        `rq suspend` takes effect within that; then wait for a free batch slot."""
        if self.stopping.is_set():
            self.engine.drain()
            raise StopRequested()
        if time.monotonic() - self.checked_at >= SUSPENSION_RECHECK_SECONDS:
            super().check_for_suspension(burst)
            self.checked_at = time.monotonic()
        if not self.reserved:
            self.reserved = self._wait_for_room()

    def reorder_queues(self, reference_queue: Queue) -> None:
        """RQ's; its dequeue calls it exactly when a job came off a queue."""
        self.holding = True
        super().reorder_queues(reference_queue)

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Hand the job over. A draining worker puts it back on the model's shared queue (its last),
        for another worker; a suspended one (`rq suspend` while RQ's dequeue was waiting) puts it back
        on its queue, and its loop then waits for `rq resume`."""
        self.holding = False
        with self.connection.pipeline() as pipe:
            self.set_state(WorkerStatus.BUSY, pipeline=pipe)
            if not self.reserved or self.engine.draining or self._suspended_meanwhile():
                to = self.queues[-1] if self.engine.draining else queue
                self.jobs.put_back(job, queue, to)
                logger.info("job %s put back on %s (draining or suspended)", job.id, to.name)
                pipe.execute()
                return
            self.reserved = False
            try:
                payload = self.jobs.take(job, queue, self.name, pipe)
            except BaseException:  # Redis went away while its start was recorded: the engine never has it
                self.jobs.free(1)
                raise
            if payload is not None:
                self.engine.admit(payload)

    def release_room(self) -> None:
        """Free the batch slot held for a job that will not come now: this RQ loop ended (Redis dropped
        it, say), and the next one reserves its own. Kept, the slot would be lost for good, one per
        restart of the loop, until the batch took one job at a time."""
        if self.reserved:
            self.reserved = False
            self.jobs.free(1)

    def _suspended_meanwhile(self) -> bool:
        """`rq suspend` came while the dequeue (or the wait for a slot) waited since the last check:
        one round trip a job, since a dequeue that waits any time at all may outlast a check."""
        if is_suspended(self.connection):
            self.checked_at = -float("inf")  # RQ's own check comes next, and waits for `rq resume`
            return True
        self.checked_at = time.monotonic()
        return False

    def _wait_for_room(self) -> bool:
        while not self.engine.draining:
            if self.jobs.reserve(ROOM_POLL_SECONDS):
                return True
            self.heartbeat()  # sent every RQ_BEAT_SECONDS at most
        return False

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's; one of its loop's own (no timeout, no pipeline) goes out only every RQ_BEAT_SECONDS.

        RQ's dequeue calls it before each try, also while it retries an unreachable Redis; a stop
        requested meanwhile ends the loop here. (RQ's signal handler raises StopRequested wherever the
        main thread is, and redis-py, reconnecting, can turn that into a ConnectionError, which the
        dequeue retries for ever.)"""
        if self.stopping.is_set() and not self.holding:
            raise StopRequested()
        if timeout is None and pipeline is None and time.monotonic() - self.beat_at < RQ_BEAT_SECONDS:
            return
        super().heartbeat(timeout, pipeline)
        self.beat_at = time.monotonic()

    def set_state(self, state: str, pipeline: Any = None) -> None:
        """RQ's, with the state other processes read (`rq info`, rq-dashboard) `busy` while requests are
        in flight: RQ's loop sets `idle` before each dequeue, while the engine serves on. The loop's own
        view (which decides how a warm shutdown goes) stays RQ's. A state already written is not written
        again (RQ's dequeue sets `idle` each time)."""
        shown = WorkerStatus.BUSY if state == WorkerStatus.IDLE and len(self.jobs) else state
        if pipeline is None and (state, shown) == (self.get_state(), self.shown):
            return
        pipe = pipeline if pipeline is not None else self.connection.pipeline()
        super().set_state(state, pipe)
        if shown != state:
            pipe.hset(self.key, "state", shown)
        self.shown = shown
        if pipeline is None:
            pipe.execute()

    def _count_changed(self, count: int, pipe: Any) -> None:
        """From the job table, as a request comes in or ends (with its pipeline): busy or idle, while RQ's
        loop waits for jobs."""
        if self.get_state() == WorkerStatus.IDLE:
            self.shown = WorkerStatus.BUSY if count else WorkerStatus.IDLE
            pipe.hset(self.key, "state", self.shown)

    def handle_warm_shutdown_request(self) -> None:
        super().handle_warm_shutdown_request()
        self.stopping.set()
        self.engine.drain()
