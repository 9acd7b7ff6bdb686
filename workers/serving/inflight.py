"""The one owner of the jobs a worker has in flight: its batch slots, the job table and every write to a
job's RQ record (schemas/ledger.py).

Three threads call it, and none of them touches a job's record or the table otherwise:
- the RQ worker (serving/intake.py) reserves a slot before each dequeue, `take`s a job (its start
  recorded in RQ) or puts it back on its queue;
- the publisher (serving/publisher.py) has each step's events `record`ed, and each ended request's
  record written (`end`) in its own pipelined round trip; then it frees their slots;
- the beacon (serving/beacon.py) refreshes the started jobs' executions (`beat`).
The engine thread (serving/loop.py) reads only which requests are in flight. The table is guarded by
one lock; no Redis round trip is made under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.client import Pipeline
from rq import Queue
from rq.executions import Execution
from rq.job import Job

from schemas import ledger
from schemas.job import JOB_FUNCTION, Event, JobPayload

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A request the worker serves: its RQ job and what its events have said so far."""

    job: Job
    execution: Execution
    payload: JobPayload
    worker_name: str
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    outcome: str = "done"  # done, cancelled or error
    error: str = ""
    taken_at: float = field(default_factory=time.monotonic)  # when this worker took it

    def record(self, event: Event) -> None:
        if event.kind == "done":
            self.finish_reasons.append(event.finish_reason or "stop")
            self.completion_tokens += event.usage.completion_tokens if event.usage else 0
        elif event.kind == "cancelled":
            self.outcome = "cancelled"
        elif event.kind == "error":
            self.outcome = "error"
            self.error = (event.error or {}).get("message", "generation failed")

    def result(self) -> dict[str, Any]:
        """The job's return value in RQ."""
        if self.outcome == "cancelled":
            return {"finish_reason": "cancelled"}
        prompt = len(self.payload.prompt_token_ids)
        reasons = self.finish_reasons
        return {
            "finish_reason": reasons[0] if len(reasons) == 1 else reasons,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
            },
        }


class JobTable:
    def __init__(self, capacity: int, keep_jobs_for: int, load: tuple[str, str] | None = None) -> None:
        self.keep_jobs_for = keep_jobs_for  # seconds a started job's hash lives (its timeout)
        # (hash, field) where the number of requests in flight is written with each take and end, so
        # that the API routes by a load no older than the last job in or out (app/routing.py).
        self.load = load
        # Told the number of requests in flight with each take and end (with its pipeline): the RQ
        # worker's state as `rq info` shows it (workers/serving/intake.py).
        self.on_count: Callable[[int, Pipeline], None] | None = None
        self._slots = threading.Semaphore(capacity)
        self._lock = threading.Lock()
        self._jobs: dict[str, InFlight] = {}

    # Anyone's side.

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._jobs

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    # The RQ worker's side.

    def reserve(self, timeout: float) -> bool:
        """Take a batch slot for the next job, waiting up to `timeout` seconds."""
        return self._slots.acquire(timeout=timeout)

    def take(self, job: Job, queue: Queue, worker_name: str, pipe: Pipeline) -> JobPayload | None:
        """A dequeued job (a slot is reserved for it) becomes a request in flight: its start is recorded
        in RQ (with `pipe`, one round trip) before the engine gets it, so a worker that dies during the
        prefill leaves a started job that the API fails. A job this worker does not serve is failed in
        RQ with the reason and its slot freed: None."""
        execution = ledger.start(job, queue, worker_name, self.keep_jobs_for, pipe)
        payload, refusal = _payload(job)
        if payload is None:
            logger.warning("refused job %s: %s", job.id, refusal)
            ledger.fail(job, execution, refusal, worker_name, pipe)
            pipe.execute()
            self._slots.release()
            return None
        with self._lock:
            self._write_load(pipe, len(self._jobs) + 1)
        pipe.execute()
        with self._lock:
            self._jobs[job.id] = InFlight(job, execution, payload, worker_name)
        return payload

    @staticmethod
    def put_back(job: Job, queue: Queue, to: Queue | None = None) -> None:
        """A job dequeued from `queue` that this worker will not take (it drains, or is suspended) goes
        back to the front of `to` (default: `queue`)."""
        ledger.put_back(job, queue, to)

    # The publisher's side.

    def record(self, events: list[Event]) -> dict[str, list[Event]]:
        """Note what each event says of its request; the events of requests in flight, by reply channel."""
        by_channel: dict[str, list[Event]] = defaultdict(list)
        with self._lock:
            for event in events:
                inflight = self._jobs.get(event.request_id)
                if inflight is not None:
                    inflight.record(event)
                    by_channel[inflight.payload.reply_channel].append(event)
        return by_channel

    def end(self, request_ids: list[str], pipe: Pipeline) -> int:
        """The ended requests leave the table and their RQ records are written with `pipe`; how many
        slots to `free` once the round trip is made."""
        with self._lock:
            ended = [f for f in (self._jobs.pop(rid, None) for rid in dict.fromkeys(request_ids)) if f]
            if ended:
                self._write_load(pipe, len(self._jobs))
        for inflight in ended:
            job, execution, worker = inflight.job, inflight.execution, inflight.worker_name
            reason = inflight.outcome if inflight.outcome != "done" else ",".join(inflight.finish_reasons)
            # Counts and time, never text: its done events say how many tokens it generated.
            generated = f" completion_tokens={inflight.completion_tokens}" if inflight.outcome == "done" else ""
            seconds = time.monotonic() - inflight.taken_at
            prompt = len(inflight.payload.prompt_token_ids)
            logger.info(
                "end request_id=%s %s prompt_tokens=%d%s seconds=%.3f", job.id, reason, prompt, generated, seconds
            )
            if inflight.outcome == "error":
                ledger.fail(job, execution, inflight.error, worker, pipe)
            else:
                ledger.finish(job, execution, inflight.result(), worker, pipe)
        return len(ended)

    def free(self, slots: int) -> None:
        for _ in range(slots):
            self._slots.release()

    def write_load(self, pipe: Pipeline) -> None:
        """Queue the write of how many requests are in flight."""
        with self._lock:
            self._write_load(pipe, len(self._jobs))

    def _write_load(self, pipe: Pipeline, count: int) -> None:
        if self.load is not None:
            pipe.hset(self.load[0], self.load[1], count)
        if self.on_count is not None:
            self.on_count(count, pipe)

    # The beacon's side.

    def beat(self, pipe: Pipeline) -> None:
        """Refresh the started jobs' executions in RQ (with `pipe`)."""
        with self._lock:
            running = [(f.job, f.execution) for f in self._jobs.values()]
        ledger.heartbeat(running, pipe)  # type: ignore[arg-type]


def _payload(job: Job) -> tuple[JobPayload | None, str]:
    if job.func_name != JOB_FUNCTION:
        return None, f"job function {job.func_name!r} is not served by this worker"
    try:
        (data,) = job.args
        payload = JobPayload.from_dict(data)
    except ValueError as exc:
        return None, str(exc)
    if payload.request_id != job.id:
        return None, "the payload's request id is not the job's id"
    return payload, ""
