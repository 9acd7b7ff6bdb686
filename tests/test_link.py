"""The link between a worker's queue process and its engine process (workers/link.py), on a real socket
pair and a real Redis: this test plays the engine process's side of the protocol."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import cancel_key
from workers import jobs, link
from workers import worker as worker_module
from workers.link import EngineClient, EngineGone
from workers.worker import SlotWorker


def payload(request_id: str) -> JobPayload:
    return JobPayload.from_dict(
        {
            "v": 1,
            "request_id": request_id,
            "model": "m",
            "prompt_token_ids": [1, 2, 3],
            "reply_channel": "tokenline:reply:test",
            "n": 2,
            "sampling": {
                "max_tokens": 8,
                "temperature": 0.5,
                "top_k": 0,
                "top_p": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "repetition_penalty": 1.0,
                "seed": 7,
                "stop": ["x"],
            },
        }
    )


@pytest.fixture()
def pair(redis_conn: redis.Redis) -> Iterator[tuple[EngineClient, Connection]]:
    """An EngineClient reading one end; the other end is the test's engine process."""
    engine_end, theirs = link.socket_pair()
    client = EngineClient(link.connect(theirs.detach()), redis_conn)
    client.start()
    yield client, engine_end
    engine_end.close()
    client.reader.join(5)


def received(engine_end: Connection) -> dict[str, Any]:
    assert engine_end.poll(5), "nothing arrived on the link"
    return link.receive(engine_end)


def test_a_request_is_handed_over_once_and_arrives_whole(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    first = client.submit(payload("r1"))
    again = client.submit(payload("r1"))  # the job function names the request the slot already handed over
    message = received(engine_end)
    assert again is first
    assert message["op"] == "submit"
    assert JobPayload.from_dict(message["payload"]) == payload("r1")
    assert JobPayload.from_validated(message["payload"]) == payload("r1")  # as the engine rebuilds it
    assert not engine_end.poll(0.2), "the request was sent twice"
    assert client.submitted("r1") == payload("r1")


def test_the_end_of_a_request_is_the_result_of_its_job(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    results: list[dict[str, Any]] = []
    runner = threading.Thread(target=lambda: results.append(client.run(payload("r2"))))
    runner.start()
    received(engine_end)
    link.send(engine_end, {"op": "end", "id": "r2", "result": {"finish_reason": "length"}})
    runner.join(5)
    assert results == [{"finish_reason": "length"}]
    assert client.submitted("r2") is None  # forgotten once its job has its result


def test_the_first_step_is_reported_before_the_end(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    pending = client.submit(payload("r6"))
    received(engine_end)
    link.send(engine_end, {"op": "started", "id": "r6"})
    assert pending.started.wait(5)
    assert not pending.future.done()
    link.send(engine_end, {"op": "end", "id": "r6", "result": {"finish_reason": "stop"}})
    assert pending.future.result(5) == {"finish_reason": "stop"}


def test_an_error_end_fails_the_job_with_its_message(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    pending = client.submit(payload("r3"))
    received(engine_end)
    link.send(engine_end, {"op": "end", "id": "r3", "error": "The worker shut down before this request finished."})
    with pytest.raises(RuntimeError) as raised:
        pending.future.result(5)
    assert pending.started.is_set()  # a request that ended never holds its slot's bookkeeping back
    assert str(raised.value) == "The worker shut down before this request finished."


def test_a_drain_message_sets_draining(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    link.send(engine_end, {"op": "drain"})
    assert client.draining.wait(5)
    assert not client.closed.is_set()


def test_when_the_engine_goes_waiting_jobs_fail_and_their_requests_are_cancelled(
    pair: tuple[EngineClient, Connection], redis_conn: redis.Redis
) -> None:
    client, engine_end = pair
    errors: list[BaseException] = []

    def run() -> None:
        try:
            client.run(payload("r4"))
        except EngineGone as exc:
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    received(engine_end)
    engine_end.close()
    runner.join(5)
    assert client.closed.is_set()
    assert [str(e) for e in errors] == ["the engine process stopped before this request ended"]
    assert redis_conn.get(cancel_key("r4")) == b"1"
    late = client.submit(payload("r5"))
    with pytest.raises(EngineGone):
        late.future.result(1)


def test_the_queue_process_can_take_its_own_action_when_the_engine_goes(redis_conn: redis.Redis) -> None:
    engine_end, theirs = link.socket_pair()
    gone = threading.Event()
    client = EngineClient(link.connect(theirs.detach()), redis_conn, on_closed=gone.set)
    client.start()
    engine_end.close()
    assert gone.wait(5)


@pytest.fixture()
def queue(pair: tuple[EngineClient, Connection], redis_conn: redis.Redis) -> Iterator[Queue]:
    """A queue of its own and the link's client bound as this process's engine, as in a queue process."""
    client, _ = pair
    jobs.bind(client)
    yield Queue(f"handover-{uuid.uuid4().hex}", connection=redis_conn, serializer=JSONSerializer)
    jobs.bind(None)


def enqueue(queue: Queue, request_id: str) -> None:
    queue.enqueue_call(JOB_FUNCTION, args=(payload(request_id).to_dict(),), job_id=request_id)


def test_a_slot_hands_the_request_over_before_rqs_heartbeat_after_the_dequeue(
    pair: tuple[EngineClient, Connection], queue: Queue, redis_conn: redis.Redis
) -> None:
    _, engine_end = pair
    arrived_by_heartbeat: list[bool] = []

    class Watched(SlotWorker):
        def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
            arrived_by_heartbeat.append(engine_end.poll(0))
            super().heartbeat(timeout, pipeline)

    enqueue(queue, "h1")
    worker = Watched([queue], connection=redis_conn, serializer=JSONSerializer)
    job, _ = worker.dequeue_job_and_maintain_ttl(1)
    assert job.id == worker.handed_over == "h1"
    # RQ beats before it listens (nothing sent yet) and again once it has the job (already sent).
    assert arrived_by_heartbeat == [False, True]
    assert received(engine_end)["payload"]["request_id"] == "h1"


def test_a_stopping_slot_hands_nothing_over_and_puts_the_job_back(
    pair: tuple[EngineClient, Connection], queue: Queue, redis_conn: redis.Redis
) -> None:
    client, engine_end = pair
    stopping = threading.Event()

    class StopsWhileListening(SlotWorker):
        def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
            super().heartbeat(timeout, pipeline)
            stopping.set()  # SIGTERM arrives while the slot waits on the queue

    enqueue(queue, "h2")
    worker = StopsWhileListening([queue], connection=redis_conn, serializer=JSONSerializer, stopping=stopping)
    assert worker.dequeue_job_and_maintain_ttl(1) is None
    assert queue.get_job_ids() == ["h2"]
    assert client.submitted("h2") is None
    assert not engine_end.poll(0.2)


def test_a_request_handed_over_is_abandoned_if_rqs_loop_fails_before_performing_its_job(
    pair: tuple[EngineClient, Connection], queue: Queue, redis_conn: redis.Redis
) -> None:
    client, engine_end = pair

    class LosesRedisAfterTheDequeue(SlotWorker):
        def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
            if self.handed_over is not None:
                raise redis.ConnectionError("Redis went away")
            super().heartbeat(timeout, pipeline)

    enqueue(queue, "h3")
    worker = LosesRedisAfterTheDequeue([queue], connection=redis_conn, serializer=JSONSerializer)
    with pytest.raises(redis.ConnectionError):
        worker.dequeue_job_and_maintain_ttl(1)
    assert received(engine_end)["payload"]["request_id"] == "h3"
    assert client.pending == 0  # no slot will wait for it
    assert redis_conn.get(cancel_key("h3")) == b"1"  # and the engine drops it at its next step


def test_rqs_loop_beats_at_most_every_few_seconds_and_does_not_rewrite_a_state_it_holds(
    queue: Queue, redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = SlotWorker([queue], connection=redis_conn, serializer=JSONSerializer)
    worker.register_birth()
    worker.heartbeat()  # the first beat goes out
    beaten = redis_conn.hget(worker.key, "last_heartbeat")
    assert beaten is not None and redis_conn.ttl(worker.key) > worker.worker_ttl
    worker.heartbeat()  # RQ's loop beats again right after a dequeue: not sent
    assert redis_conn.hget(worker.key, "last_heartbeat") == beaten
    worker.heartbeat(60)  # a beat with its own TTL (or in RQ's pipelines) always goes out
    assert redis_conn.hget(worker.key, "last_heartbeat") != beaten
    assert redis_conn.ttl(worker.key) <= 60
    monkeypatch.setattr(worker_module, "BEAT_EVERY_SECONDS", 0)
    worker.heartbeat()  # once the interval has passed, the loop's beat goes out again
    assert redis_conn.ttl(worker.key) > worker.worker_ttl

    worker.set_state("idle")
    redis_conn.hset(worker.key, "state", "written-by-the-test")
    worker.set_state("idle")  # RQ sets idle after a job and again before the next dequeue
    assert redis_conn.hget(worker.key, "state") == b"written-by-the-test"
    worker.set_state("busy")
    assert redis_conn.hget(worker.key, "state") == b"busy"
