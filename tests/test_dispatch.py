"""Admission, then RQ's enqueue (app/dispatch.py, app/admission.py), on a real Redis.

An admitted request's job is queued as RQ queues any job; a refused one (429 over maxLinkNum, 503
without a live worker) leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from app.admission import Admission
from app.dispatch import Dispatcher
from schemas.config import Settings
from schemas.errors import NoWorker, Overloaded
from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import admitted_key, cancel_key, live_workers_key, queue_name
from schemas.sampling import SamplingParams
from scripts import localstack


@pytest.fixture()
def model() -> str:
    return f"admit-{uuid.uuid4().hex[:8]}"


@pytest.fixture()
def dispatcher(redis_conn: redis.Redis, settings: Settings) -> Iterator[Dispatcher]:
    capped = dataclasses.replace(settings, max_link_num=2)
    yield Dispatcher(redis_conn, capped, Admission(redis_conn, capped))


def alive(conn: redis.Redis, model: str) -> None:
    """A worker process of `model` with a fresh heartbeat (Redis' clock, as workers/ops/heartbeat.py writes it)."""
    seconds, micros = conn.time()
    conn.zadd(live_workers_key(model), {"host.1": seconds * 1000 + micros // 1000})


def payload(model: str) -> JobPayload:
    return JobPayload(f"chatcmpl-{uuid.uuid4().hex}", model, (1, 2, 3), SamplingParams(max_tokens=4), "ch")


def queue(conn: redis.Redis, model: str) -> Queue:
    return Queue(queue_name(model), connection=conn, serializer=JSONSerializer)


def test_an_admitted_request_is_an_rq_job_queued_with_its_place_held(
    dispatcher: Dispatcher, redis_conn: redis.Redis, model: str
) -> None:
    alive(redis_conn, model)
    request = payload(model)
    dispatcher.submit(request)
    job = Job.fetch(request.request_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.QUEUED
    assert job.func_name == JOB_FUNCTION and JobPayload.from_dict(job.args[0]) == request
    assert queue(redis_conn, model).job_ids == [request.request_id]
    assert redis_conn.zscore(admitted_key(model), request.request_id) is not None


def test_over_the_cap_a_request_is_refused_and_leaves_no_job(
    dispatcher: Dispatcher, redis_conn: redis.Redis, model: str
) -> None:
    alive(redis_conn, model)
    admitted = [payload(model) for _ in range(2)]
    for request in admitted:
        dispatcher.submit(request)
    refused = payload(model)
    with pytest.raises(Overloaded):
        dispatcher.submit(refused)
    assert not Job.exists(refused.request_id, connection=redis_conn)
    assert queue(redis_conn, model).job_ids == [r.request_id for r in admitted]
    assert redis_conn.zcard(admitted_key(model)) == 2
    dispatcher.admission.release(model, admitted[0].request_id)  # a place given back is taken again
    dispatcher.submit(payload(model))
    assert queue(redis_conn, model).count == 3


def test_requests_admitted_together_take_their_places_all_or_none(
    dispatcher: Dispatcher, redis_conn: redis.Redis, model: str
) -> None:
    alive(redis_conn, model)
    first, second, third = (payload(model) for _ in range(3))
    with pytest.raises(Overloaded):  # three places under a cap of two: none is taken
        dispatcher.admission.admit(model, first.request_id, second.request_id, third.request_id)
    assert redis_conn.zcard(admitted_key(model)) == 0
    dispatcher.admission.admit(model, first.request_id, second.request_id)
    for request in (first, second):  # queued in the places already taken
        dispatcher.submit(request, admitted=True)
    assert queue(redis_conn, model).job_ids == [first.request_id, second.request_id]
    assert redis_conn.zcard(admitted_key(model)) == 2


def test_without_a_live_worker_a_request_is_refused_and_leaves_no_job(
    dispatcher: Dispatcher, redis_conn: redis.Redis, model: str
) -> None:
    request = payload(model)
    with pytest.raises(NoWorker):
        dispatcher.submit(request)
    assert not Job.exists(request.request_id, connection=redis_conn)
    assert queue(redis_conn, model).count == 0
    assert not redis_conn.exists(admitted_key(model))


def test_cancelling_a_queued_request_takes_its_job_off_the_queue_and_cancels_it_in_rq(
    dispatcher: Dispatcher, redis_conn: redis.Redis, model: str
) -> None:
    alive(redis_conn, model)
    withdrawn: list[str] = []
    dispatcher.on_withdrawn = withdrawn.append  # the API's metrics count it: no worker ever sees it
    leaving, staying = payload(model), payload(model)
    dispatcher.submit(leaving)
    dispatcher.submit(staying)
    dispatcher.cancel(leaving.request_id, model)
    assert withdrawn == [model]
    assert queue(redis_conn, model).job_ids == [staying.request_id]  # no worker can take it any more
    job = Job.fetch(leaving.request_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.CANCELED
    assert leaving.request_id in queue(redis_conn, model).canceled_job_registry.get_job_ids()
    assert redis_conn.get(cancel_key(leaving.request_id)) == b"1"


def test_the_canceled_registry_keeps_only_the_cancelled_jobs_rq_still_holds(
    dispatcher: Dispatcher, redis_conn: redis.Redis, model: str
) -> None:
    """Each request cancelled while queued adds its job to RQ's CanceledJobRegistry, which RQ never
    cleans: a soak of requests cancelled while queued grew it for good. Cancelling takes off the
    entries cancelled past their jobs' queueTimeout (and a minute), whose records have expired."""
    alive(redis_conn, model)
    registry = queue(redis_conn, model).canceled_job_registry
    earlier = [payload(model) for _ in range(3)]
    for request in earlier:
        dispatcher.submit(request)
        dispatcher.cancel(request.request_id, model)
        dispatcher.admission.release(model, request.request_id)  # as its relay does once it ends
    assert sorted(registry.get_job_ids()) == sorted(request.request_id for request in earlier)
    for request in earlier:  # cancelled past their queueTimeout: RQ's records of them have expired
        redis_conn.zadd(registry.key, {request.request_id: time.time() - dispatcher.settings.queue_timeout - 61})
        redis_conn.delete(Job.key_for(request.request_id))
    last = payload(model)
    dispatcher.submit(last)
    dispatcher.cancel(last.request_id, model)
    assert registry.get_job_ids() == [last.request_id]


def test_cancelling_a_request_a_worker_has_taken_only_flags_it(
    dispatcher: Dispatcher, redis_conn: redis.Redis, model: str
) -> None:
    alive(redis_conn, model)
    withdrawn: list[str] = []
    dispatcher.on_withdrawn = withdrawn.append
    request = payload(model)
    dispatcher.submit(request)
    taken = Queue.dequeue_any([queue(redis_conn, model)], None, connection=redis_conn, serializer=JSONSerializer)
    assert taken is not None and taken[0].id == request.request_id  # off the queue, as a worker takes it
    dispatcher.cancel(request.request_id, model)
    job = Job.fetch(request.request_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.QUEUED  # RQ's own bookkeeping is left to the worker that has it
    assert request.request_id not in queue(redis_conn, model).canceled_job_registry.get_job_ids()
    assert redis_conn.get(cancel_key(request.request_id)) == b"1"  # it drops the request at its next step
    assert withdrawn == []  # its worker counts it


def test_a_request_whose_admission_redis_leaves_unanswered_waits_for_one_command_timeout(
    settings: Settings, model: str, tmp_path: Path
) -> None:
    """Redis hangs (stopped, or cut off): the admission's command times out, and the place it may have
    taken is given back once Redis answers again, not by a second command that would wait as long."""
    port = localstack.free_port()
    server = localstack.start_redis(port, log=tmp_path / "redis.log")
    timeout = 1.0
    connection = redis.Redis(port=port, socket_timeout=timeout, retry=Retry(NoBackoff(), 2, (redis.ConnectionError,)))
    try:
        alive(connection, model)
        dispatcher = Dispatcher(connection, settings, Admission(connection, settings))
        server.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            dispatcher.submit(payload(model))
        elapsed = time.monotonic() - started
    finally:
        server.send_signal(signal.SIGCONT)
        connection.close()
        localstack.stop(server)
    assert elapsed < 1.6 * timeout, elapsed  # two waits took 2 s
