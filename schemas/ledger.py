"""A request's RQ job, moved through RQ's registries by the engine rather than by RQ's perform loop.

RQ's worker performs one job at a time, and its per-job bookkeeping (`Worker.perform_job`,
`handle_job_success`, `handle_job_failure`) keeps that job in the worker's own state. A tokenline
worker holds many requests at once in one engine, so it records each job's start and end itself,
through RQ's public Job, Execution, Result and registry APIs only — the same records RQ's loop
writes: the job's status, an Execution in the StartedJobRegistry (refreshed by `heartbeat`), a
Result, and the Finished/Failed registry. This is the one module that does so; `rq info`,
rq-dashboard and `Job.fetch(...).latest_result()` read what it wrote (tests/test_ledger.py checks
them against the pinned RQ). One private detail is read here: the CanceledJobRegistry's sorted set,
scored by the time of each cancel, which RQ never trims (`forget_expired_cancels`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq import Queue
from rq.defaults import DEFAULT_FAILURE_TTL, DEFAULT_RESULT_TTL
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry
from rq.results import Result
from rq.utils import as_text, current_timestamp, now

from schemas.keys import queue_owner

# How long a job's record is kept once it has ended (the API sets them on every job it queues).
RESULT_TTL_SECONDS = 600
FAILURE_TTL_SECONDS = 24 * 3600

# A started job's Execution lives this long past its last heartbeat; after that RQ's own maintenance
# counts the job as abandoned (the API fails the request much sooner, from the worker's heartbeat).
EXECUTION_TTL_SECONDS = 60


def start(job: Job, queue: Queue, worker_name: str, keep_for: int, pipe: Pipeline) -> Execution:
    """Mark a dequeued job as started by `worker_name` (off the queue's intermediate list, in the
    StartedJobRegistry); its hash is kept `keep_for` seconds. Written when `pipe` executes."""
    execution = Execution.create(job, EXECUTION_TTL_SECONDS, pipeline=pipe, worker_name=worker_name)
    job.prepare_for_execution(worker_name, pipe)
    job.cleanup(keep_for, pipeline=pipe, remove_from_queue=False)
    IntermediateQueue(queue.key, connection=pipe).remove(job.id)  # type: ignore[arg-type]
    return execution


def heartbeat(running: list[tuple[Job, Execution]], pipe: Pipeline) -> None:
    """Keep these jobs' Executions alive in the StartedJobRegistry."""
    for job, execution in running:
        execution.heartbeat(job.started_job_registry, EXECUTION_TTL_SECONDS, pipe)


def finish(job: Job, execution: Execution | None, result: Any, worker_name: str, pipe: Pipeline) -> None:
    """Record the job as finished with `result` (its return value in RQ)."""
    job.ended_at = now()
    ttl = job.get_result_ttl(DEFAULT_RESULT_TTL)
    job.set_status(JobStatus.FINISHED, pipeline=pipe)
    job.save(pipeline=pipe, include_meta=False, include_result=False)
    Result.create(
        job,
        Result.Type.SUCCESSFUL,
        return_value=result,
        ttl=ttl,
        worker_name=worker_name,
        pipeline=pipe,
        **_execution_fields(job, execution),
    )
    job.finished_job_registry.add(job, ttl, pipe)
    job.cleanup(ttl, pipeline=pipe, remove_from_queue=False)
    if execution is not None:
        execution.delete(job, pipe)


def fail(job: Job, execution: Execution | None, reason: str, worker_name: str, pipe: Pipeline) -> None:
    """Record the job as failed with `reason` (the Result's exc_string). Without an execution, every
    execution the job has is taken off the StartedJobRegistry (its worker died)."""
    job.ended_at = now()
    ttl = job.failure_ttl or DEFAULT_FAILURE_TTL
    job.set_status(JobStatus.FAILED, pipeline=pipe)
    job.failed_job_registry.add(job, ttl=ttl, exc_string=reason, pipeline=pipe)
    Result.create_failure(
        job, ttl, exc_string=reason, worker_name=worker_name, pipeline=pipe, **_execution_fields(job, execution)
    )
    if execution is not None:
        execution.delete(job, pipe)
    else:
        job.started_job_registry.remove_executions(job, pipeline=pipe)


def put_back(job: Job, queue: Queue, to: Queue | None = None) -> None:
    """Return a job dequeued from `queue` and not started to the front of `to` (default: `queue`)."""
    (to or queue).enqueue_job(job, at_front=True)
    queue.intermediate_queue.remove(job.id)


def forget_expired_cancels(queue: str, connection: Redis, kept: float) -> None:
    """Take off `queue`'s CanceledJobRegistry the jobs cancelled more than `kept` seconds ago, whose
    records have expired (a queued job's lives queueTimeout from its enqueue), and delete any record
    of theirs left without a TTL (a cancel whose transaction ran as the record expired writes a bare
    status hash). RQ adds each job it cancels there and never takes one off: the registry has no
    expiry and `clean_registries` passes it by, so it grew by one id for every request cancelled while
    queued, for as long as Redis ran. This reads RQ's layout of that registry, a sorted set scored by
    the time of the cancel (RQ 2.12; tests/test_ledger.py holds it)."""
    key = CanceledJobRegistry(queue, connection=connection).key
    cutoff = current_timestamp() - kept
    expired = connection.zrangebyscore(key, "-inf", cutoff)
    if expired:
        with connection.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(key, "-inf", cutoff)
            pipe.delete(*(Job.key_for(as_text(job_id)) for job_id in expired))
            pipe.execute()


def retire(queue: Queue) -> None:
    """Remove a worker's own queue, its jobs moved elsewhere, and let its registries (started,
    finished, failed, canceled…) expire once their jobs' records have: RQ maintains the registries
    of the queues it lists (but for the canceled one: forget_expired_cancels), and a removed queue is
    no longer listed, so they stayed for good."""
    queue.delete(delete_jobs=False)
    registries = (
        queue.started_job_registry,
        queue.finished_job_registry,
        queue.failed_job_registry,
        queue.deferred_job_registry,
        queue.scheduled_job_registry,
        queue.canceled_job_registry,
    )
    with queue.connection.pipeline(transaction=False) as pipe:
        for registry in registries:
            pipe.expire(registry.key, FAILURE_TTL_SECONDS)
        pipe.execute()


def rescue(connection: Redis, job: Job, live: Collection[str]) -> bool:
    """Move `job`, queued on the own queue of a worker process not in `live` (app/routing.py), to the
    front of its model's shared queue; True if this call moved it. Taking it off the worker's queue
    decides: of the callers racing (API processes, live workers) and a dequeue, only the one that took
    it off puts it on the shared queue."""
    shared, worker = queue_owner(job.origin)
    if worker is None or worker in live:
        return False
    if not Queue(job.origin, connection=connection, serializer=job.serializer).remove(job.id):
        return False
    Queue(shared, connection=connection, serializer=job.serializer).enqueue_job(job, at_front=True)
    return True


def _execution_fields(job: Job, execution: Execution | None) -> dict[str, Any]:
    if execution is None:
        return {}
    return {
        "execution_id": execution.id,
        "execution_started_at": execution.created_at,
        "execution_ended_at": job.ended_at,
    }
