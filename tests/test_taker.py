"""The engine's dequeue (workers/taker.py) against jobs that RQ itself enqueued on a real Redis: the RQ
internals it relies on (the intermediate list, the `data` field's encoding) and what it does with
jobs it cannot serve."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import cancel_key
from schemas.sampling import SamplingParams
from scripts import localstack
from scripts.localstack import wait_for
from workers.taker import Taken, Taker


@pytest.fixture()
def queue(redis_conn: redis.Redis) -> Queue:
    return Queue(f"taker-{uuid.uuid4().hex}", connection=redis_conn, serializer=JSONSerializer)


@pytest.fixture()
def taker(queue: Queue, redis_conn: redis.Redis) -> Iterator[Taker]:
    taker = Taker(redis_conn, queue.name, name="test.taker")
    yield taker
    taker.close()


def payload(request_id: str) -> JobPayload:
    sampling = SamplingParams(max_tokens=7, temperature=0.3, top_k=5, seed=11, stop=("x",))
    return JobPayload(request_id, "demo", (1, 2, 3), sampling, "tokenline:reply:t", n=2)


def enqueue(queue: Queue, request_id: str) -> None:
    """As the API's dispatcher enqueues a request (app/dispatch.py)."""
    queue.enqueue_call(JOB_FUNCTION, args=(payload(request_id).to_dict(),), job_id=request_id, ttl=60)


def test_a_waiting_blmove_takes_a_job_as_rqs_dequeue_does_and_reads_its_payload(
    taker: Taker, queue: Queue, redis_conn: redis.Redis
) -> None:
    assert taker.listen()
    assert not taker.ready()
    enqueue(queue, "j1")
    wait_for(taker.ready, 5, "the BLMOVE to answer")
    assert taker.take(room=1) == [Taken("j1", payload("j1"))]
    assert redis_conn.lrange(queue.intermediate_queue_key, 0, -1) == [b"j1"]
    assert queue.count == 0
    assert not taker.blocked  # no room left: no BLMOVE waits
    names = [c["name"] for c in redis_conn.client_list()]
    assert "test.taker" in names


def test_one_take_gets_as_many_queued_jobs_as_there_is_room_for_in_order(
    taker: Taker, queue: Queue, redis_conn: redis.Redis
) -> None:
    for request_id in ("a", "b", "c", "d"):
        enqueue(queue, request_id)
    assert taker.listen()
    wait_for(taker.ready, 5, "the BLMOVE to answer")
    taken = taker.take(room=3)
    assert [t.job_id for t in taken] == ["a", "b", "c"]
    assert all(t.payload == payload(t.job_id) for t in taken)
    assert queue.get_job_ids() == ["d"]
    assert redis_conn.lrange(queue.intermediate_queue_key, 0, -1) == [b"a", b"b", b"c"]
    assert taker.take_now(room=5) == [Taken("d", payload("d"))]


def test_a_job_taken_carries_its_cancel_flag(taker: Taker, queue: Queue, redis_conn: redis.Redis) -> None:
    enqueue(queue, "left")
    enqueue(queue, "stays")
    redis_conn.set(cancel_key("left"), 1, ex=60)
    assert [(t.job_id, t.cancelled) for t in taker.take_now(room=2)] == [("left", True), ("stays", False)]


def test_jobs_it_cannot_serve_are_taken_with_the_reason(taker: Taker, queue: Queue, redis_conn: redis.Redis) -> None:
    queue.enqueue("os.getcwd", job_id="evil")
    queue.enqueue_call(JOB_FUNCTION, args=({"v": 1, "request_id": "bad"},), job_id="bad")
    queue.enqueue_call(JOB_FUNCTION, args=(payload("someone-else").to_dict(),), job_id="forged")
    enqueue(queue, "expired")
    redis_conn.delete(Job.key_for("expired"))  # its hash expired while it was queued
    taken = {t.job_id: t for t in taker.take_now(room=4)}
    assert all(t.payload is None for t in taken.values())
    assert taken["evil"].refused == "job function 'os.getcwd' is not served by this worker"
    assert taken["bad"].refused.startswith("invalid job payload: ")  # type: ignore[union-attr]
    assert taken["forged"].refused == "invalid job payload: request_id is not the job's id"
    assert taken["expired"].refused == "unreadable job: the job has no data (it expired or was deleted)"


def test_a_job_put_back_is_first_in_the_queue_again(taker: Taker, queue: Queue, redis_conn: redis.Redis) -> None:
    enqueue(queue, "first")
    enqueue(queue, "second")
    [taken] = taker.take_now(room=1)
    taker.put_back(taken.job_id)
    assert queue.get_job_ids() == ["first", "second"]
    assert redis_conn.llen(queue.intermediate_queue_key) == 0


def test_stop_waits_for_the_blmove_and_puts_its_job_back(taker: Taker, queue: Queue) -> None:
    assert taker.listen()
    enqueue(queue, "late")
    wait_for(taker.stop, 5, "the BLMOVE to answer")
    assert queue.get_job_ids() == ["late"]
    assert not taker.blocked


def test_redis_unreachable_pauses_taking_without_raising(queue: Queue) -> None:
    gone = redis.Redis(port=localstack.free_port(), socket_connect_timeout=1)
    taker = Taker(gone, queue.name)
    assert taker.listen() is False
    assert taker.take_now(room=2) == []
    assert taker.listen() is False  # paused: no new attempt before RETRY_SECONDS
    assert taker.paused_until > 0


def test_a_prefetch_sends_the_read_of_the_job_taken_and_the_next_take_collects_it(
    taker: Taker, queue: Queue, redis_conn: redis.Redis
) -> None:
    assert taker.listen()
    taker.prefetch(room=2)  # nothing taken yet: nothing sent
    assert taker.reading is None and taker.blocked
    enqueue(queue, "p1")
    wait_for(taker.ready, 5, "the BLMOVE to answer")
    taker.prefetch(room=2)
    assert taker.reading is not None and not taker.blocked  # the read is under way, unanswered
    wait_for(lambda: taker.connection.can_read(timeout=0), 5, "Redis to answer the read")  # type: ignore[union-attr]
    enqueue(queue, "p2")  # after the read's LLEN: left for the next take
    assert taker.ready()
    assert taker.take(room=2) == [Taken("p1", payload("p1"))]
    assert taker.blocked  # room is left: the next BLMOVE waits, and takes p2 at once
    wait_for(taker.ready, 5, "the next BLMOVE to answer")
    assert taker.take(room=1) == [Taken("p2", payload("p2"))]


def prefetch_three(taker: Taker, queue: Queue, first: str, *queued_after: str) -> None:
    """The BLMOVE takes `first`; the others are queued before the prefetch, whose read (room 3) moves them."""
    assert taker.listen()
    enqueue(queue, first)
    wait_for(taker.ready, 5, "the BLMOVE to answer")
    for request_id in queued_after:
        enqueue(queue, request_id)
    taker.prefetch(room=3)


def test_stop_during_a_prefetch_puts_back_every_job_it_took_in_order(
    taker: Taker, queue: Queue, redis_conn: redis.Redis
) -> None:
    prefetch_three(taker, queue, "p3", "p4", "p5")
    assert taker.stop()
    assert queue.get_job_ids() == ["p3", "p4", "p5"]
    assert redis_conn.llen(queue.intermediate_queue_key) == 0
    assert taker.reading is None and not taker.blocked


def test_while_a_prefetch_is_under_way_listen_sends_nothing_and_the_take_gets_what_is_queued(
    taker: Taker, queue: Queue, redis_conn: redis.Redis
) -> None:
    prefetch_three(taker, queue, "q1", "q2", "q3")
    assert taker.listen()  # as the engine's next turn begins: the read is still to be collected
    assert not taker.blocked
    assert [t.job_id for t in taker.take(room=3)] == ["q1", "q2", "q3"]
    assert all(t.payload == payload(t.job_id) for t in taker.take_now(room=1)) and queue.count == 0
