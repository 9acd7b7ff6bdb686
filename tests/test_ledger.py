"""schemas/ledger.py against the pinned RQ: what it writes is what RQ's own APIs and `rq info` read.

These are the records RQ's perform loop would write for a job; if RQ changes where it keeps them,
these tests fail.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis
import rq
from rq import Queue
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from schemas import ledger

WORKER = "host.1"


@pytest.fixture()
def queue(redis_conn: redis.Redis) -> Queue:
    return Queue(f"ledger-{uuid.uuid4().hex[:8]}", connection=redis_conn, serializer=JSONSerializer)


def dequeued(queue: Queue) -> Job:
    """A job enqueued and taken off its queue as RQ's worker loop takes it."""
    queue.enqueue("workers.serving.jobs.generate", {"x": 1}, job_id=f"job-{uuid.uuid4().hex[:8]}")
    taken = Queue.dequeue_any([queue], None, connection=queue.connection, serializer=JSONSerializer)
    assert taken is not None
    return taken[0]


def start(job: Job, queue: Queue) -> Execution:
    with queue.connection.pipeline() as pipe:
        execution = ledger.start(job, queue, WORKER, 3600, pipe)
        pipe.execute()
    return execution


def refetch(job: Job) -> Job:
    return Job.fetch(job.id, connection=job.connection, serializer=JSONSerializer)


def test_rq_is_the_version_the_ledger_was_written_for() -> None:
    assert rq.__version__ == "2.12.0"


def test_a_started_job_is_in_the_started_registry_with_its_worker_and_off_the_intermediate_list(
    queue: Queue,
) -> None:
    job = dequeued(queue)
    assert job.id in queue.intermediate_queue.get_job_ids()
    execution = start(job, queue)
    assert refetch(job).get_status() == JobStatus.STARTED
    assert refetch(job).worker_name == WORKER
    assert queue.started_job_registry.get_job_ids() == [job.id]
    assert [e.id for e in refetch(job).get_executions()] == [execution.id]
    assert queue.intermediate_queue.get_job_ids() == []
    assert 3500 < queue.connection.ttl(job.key) <= 3600


def test_a_heartbeat_pushes_the_executions_expiry_forward(queue: Queue) -> None:
    job = dequeued(queue)
    execution = start(job, queue)
    queue.connection.expire(execution.key, 1)  # as if its last beat were long ago
    with queue.connection.pipeline() as pipe:
        ledger.heartbeat([(job, execution)], pipe)
        pipe.execute()
    assert queue.started_job_registry.get_job_ids() == [job.id]
    assert queue.connection.ttl(execution.key) > ledger.EXECUTION_TTL_SECONDS - 5


def test_a_finished_job_has_its_result_and_leaves_the_started_registry(queue: Queue) -> None:
    job = dequeued(queue)
    execution = start(job, queue)
    with queue.connection.pipeline() as pipe:
        ledger.finish(job, execution, {"finish_reason": "stop"}, WORKER, pipe)
        pipe.execute()
    ended = refetch(job)
    assert ended.get_status() == JobStatus.FINISHED
    assert ended.return_value() == {"finish_reason": "stop"}
    assert ended.latest_result().worker_name == WORKER
    assert ended.ended_at is not None
    assert queue.finished_job_registry.get_job_ids() == [job.id]
    assert queue.started_job_registry.get_job_ids() == []


def test_a_failed_job_has_its_reason_and_is_in_the_failed_registry(queue: Queue) -> None:
    job = dequeued(queue)
    execution = start(job, queue)
    with queue.connection.pipeline() as pipe:
        ledger.fail(job, execution, "the device ran out of memory", WORKER, pipe)
        pipe.execute()
    ended = refetch(job)
    assert ended.get_status() == JobStatus.FAILED
    assert ended.latest_result().exc_string == "the device ran out of memory"
    assert queue.failed_job_registry.get_job_ids() == [job.id]
    assert queue.started_job_registry.get_job_ids() == []


def test_failing_an_abandoned_job_without_its_execution_clears_the_started_registry(queue: Queue) -> None:
    job = dequeued(queue)
    start(job, queue)
    abandoned = refetch(job)  # as the API sees it after the worker died
    with queue.connection.pipeline() as pipe:
        ledger.fail(abandoned, None, "WorkerLost: no heartbeat", WORKER, pipe)
        pipe.execute()
    assert refetch(job).get_status() == JobStatus.FAILED
    assert queue.started_job_registry.get_job_ids() == []


def test_a_job_put_back_is_first_in_its_queue_again(queue: Queue) -> None:
    job = dequeued(queue)
    queue.enqueue("workers.serving.jobs.generate", {"x": 2}, job_id=f"next-{uuid.uuid4().hex[:8]}")
    ledger.put_back(job, queue)
    assert queue.job_ids[0] == job.id
    assert refetch(job).get_status() == JobStatus.QUEUED
    assert queue.intermediate_queue.get_job_ids() == []


def test_cancelled_jobs_whose_records_expired_leave_the_canceled_registry(queue: Queue) -> None:
    """RQ adds each job it cancels to the CanceledJobRegistry, scored by the time of the cancel, and
    never takes one off (no expiry, and clean_registries passes it by): the ledger takes off those
    cancelled longer ago than their records live, and deletes a record of theirs left without a TTL."""
    jobs = [queue.enqueue("workers.serving.jobs.generate", {"x": i}, ttl=30) for i in range(3)]
    for job in jobs:
        job.cancel()
    registry, connection = queue.canceled_job_registry, queue.connection
    rq.registry.clean_registries(queue)
    assert sorted(registry.get_job_ids()) == sorted(job.id for job in jobs)  # RQ's own maintenance keeps them
    assert all(abs(connection.zscore(registry.key, job.id) - time.time()) < 5 for job in jobs)  # RQ's layout
    for job in jobs[:2]:  # cancelled an hour ago: their records expired, but for a bare one left by a race
        connection.zadd(registry.key, {job.id: time.time() - 3600})
    connection.delete(jobs[0].key)
    connection.persist(jobs[1].key)
    ledger.forget_expired_cancels(queue.name, connection, kept=90)
    assert registry.get_job_ids() == [jobs[2].id]
    assert not connection.exists(jobs[1].key) and connection.ttl(jobs[2].key) > 0
