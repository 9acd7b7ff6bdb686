"""The job table (workers/serving/inflight.py), the one owner of a worker's jobs in flight, on a real
Redis and RQ: a taken job is started in RQ and holds a batch slot; its events are recorded; its end is
written to its RQ record and frees the slot; a job the worker does not serve is failed with the reason
and gives its slot back."""

from __future__ import annotations

import uuid

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from schemas.job import JOB_FUNCTION, Event, JobPayload, Usage
from schemas.sampling import SamplingParams
from workers.serving.inflight import JobTable

WORKER = "host.1"


@pytest.fixture()
def queue(redis_conn: redis.Redis) -> Queue:
    return Queue(f"jobs-{uuid.uuid4().hex[:8]}", connection=redis_conn, serializer=JSONSerializer)


def dequeued(queue: Queue, function: str = JOB_FUNCTION, request_id: str | None = None) -> Job:
    request_id = request_id or f"req-{uuid.uuid4().hex[:8]}"
    payload = JobPayload(request_id, "demo", (1, 2, 3), SamplingParams(max_tokens=4), "channel-1")
    queue.enqueue(function, payload.to_dict(), job_id=request_id)
    taken = Queue.dequeue_any([queue], None, connection=queue.connection, serializer=JSONSerializer)
    assert taken is not None
    return taken[0]


def take(table: JobTable, job: Job, queue: Queue) -> JobPayload | None:
    with queue.connection.pipeline() as pipe:
        return table.take(job, queue, WORKER, pipe)


def status(job: Job) -> JobStatus:
    return Job.fetch(job.id, connection=job.connection, serializer=JSONSerializer).get_status()


def test_a_taken_job_is_started_recorded_and_ended_in_rq_and_frees_its_slot(queue: Queue) -> None:
    table = JobTable(capacity=1, keep_jobs_for=60)
    assert table.reserve(0)
    job = dequeued(queue)
    payload = take(table, job, queue)
    assert payload is not None and payload.request_id == job.id
    assert status(job) == JobStatus.STARTED and job.id in table and table.ids() == [job.id]
    assert not table.reserve(0)  # the one slot is the job's
    done = Event(job.id, 0, "done", 0, finish_reason="length", usage=Usage(3, 4))
    assert table.record([Event(job.id, 0, "token", 0, "hi"), done]) == {
        "channel-1": [Event(job.id, 0, "token", 0, "hi"), done]
    }
    with queue.connection.pipeline() as pipe:
        freed = table.end([job.id, job.id], pipe)  # an end posted twice is written once
        pipe.execute()
    table.free(freed)
    assert freed == 1 and len(table) == 0
    finished = Job.fetch(job.id, connection=queue.connection, serializer=JSONSerializer)
    assert finished.get_status() == JobStatus.FINISHED
    assert finished.return_value() == {
        "finish_reason": "length",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }
    assert table.reserve(0)


def test_a_request_that_ended_in_an_error_fails_its_job_with_the_message(queue: Queue) -> None:
    table = JobTable(capacity=2, keep_jobs_for=60)
    job = dequeued(queue)
    take(table, job, queue)
    table.record([Event(job.id, 0, "error", 0, error={"message": "The device ran out of memory."})])
    with queue.connection.pipeline() as pipe:
        table.end([job.id], pipe)
        pipe.execute()
    failed = Job.fetch(job.id, connection=queue.connection, serializer=JSONSerializer)
    assert failed.get_status() == JobStatus.FAILED
    assert failed.latest_result().exc_string.strip().splitlines()[-1] == "The device ran out of memory."


def test_a_job_the_worker_does_not_serve_is_failed_with_the_reason_and_gives_its_slot_back(queue: Queue) -> None:
    table = JobTable(capacity=1, keep_jobs_for=60)
    assert table.reserve(0)
    job = dequeued(queue, function="os.system")
    assert take(table, job, queue) is None
    assert status(job) == JobStatus.FAILED and len(table) == 0
    assert table.reserve(0)
