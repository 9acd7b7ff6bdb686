"""The link between a worker's queue process and its engine process (workers/link.py), on a real socket
pair and a real Redis: this test plays the engine process's side of the protocol, and the slots are
real RQ workers performing real RQ jobs."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import cancel_key
from scripts.localstack import wait_for
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


def take(client: EngineClient, engine_end: Connection, job_id: str, **fields: Any) -> None:
    """The engine hands a job over; returns once the queue process has it."""
    link.send(engine_end, {"op": "take", "id": job_id, **fields})
    wait_for(lambda: client.has_taken, 5, "the take to arrive")


def run_in_thread(client: EngineClient, job_id: str) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(client.run(job_id))
        except Exception as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    return runner, outcome


def test_a_job_taken_is_queued_for_a_slot_once(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    take(client, engine_end, "r1")
    assert client.pending == 1
    assert client.next_taken(None) == "r1"
    assert client.next_taken(None) is None
    assert client.next_taken(0.05) is None


def test_the_end_of_a_request_is_the_result_of_its_job(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    take(client, engine_end, "r2")
    runner, outcome = run_in_thread(client, "r2")
    link.send(engine_end, {"op": "end", "id": "r2", "result": {"finish_reason": "length"}})
    runner.join(5)
    assert outcome == [{"finish_reason": "length"}]
    assert client.pending == 0  # forgotten once its job has its result


def test_an_end_that_comes_before_the_slot_waits_is_kept(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    link.send(engine_end, {"op": "take", "id": "r6"})
    link.send(engine_end, {"op": "end", "id": "r6", "result": {"finish_reason": "stop"}})  # a one-token request
    wait_for(lambda: client.has_taken, 5, "the take to arrive")
    runner, outcome = run_in_thread(client, "r6")
    runner.join(5)
    assert outcome == [{"finish_reason": "stop"}]


def test_an_error_end_fails_the_job_with_its_message(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    take(client, engine_end, "r3")
    runner, outcome = run_in_thread(client, "r3")
    link.send(engine_end, {"op": "end", "id": "r3", "error": "The worker shut down before this request finished."})
    runner.join(5)
    assert [type(e) for e in outcome] == [RuntimeError]
    assert str(outcome[0]) == "The worker shut down before this request finished."


def test_a_refused_job_fails_with_the_reason_and_is_not_cancelled(
    pair: tuple[EngineClient, Connection], redis_conn: redis.Redis
) -> None:
    client, engine_end = pair
    take(client, engine_end, "r7", refused="invalid job payload: {'n': ['Not a valid integer.']}")
    runner, outcome = run_in_thread(client, "r7")
    runner.join(5)
    assert [type(e) for e in outcome] == [ValueError]
    assert str(outcome[0]) == "invalid job payload: {'n': ['Not a valid integer.']}"
    assert client.pending == 0
    assert redis_conn.get(cancel_key("r7")) is None


def test_a_job_the_engine_did_not_take_is_not_waited_for(pair: tuple[EngineClient, Connection]) -> None:
    client, _ = pair
    with pytest.raises(RuntimeError, match="was not taken by this worker's engine"):
        client.run("never-taken")


def test_a_drain_message_sets_draining(pair: tuple[EngineClient, Connection]) -> None:
    client, engine_end = pair
    link.send(engine_end, {"op": "drain"})
    assert client.draining.wait(5)
    assert not client.closed.is_set()


def test_when_the_engine_goes_waiting_jobs_fail_and_their_requests_are_cancelled(
    pair: tuple[EngineClient, Connection], redis_conn: redis.Redis
) -> None:
    client, engine_end = pair
    take(client, engine_end, "r4")
    runner, outcome = run_in_thread(client, "r4")
    engine_end.close()
    runner.join(5)
    assert client.closed.is_set()
    assert [str(e) for e in outcome] == ["the engine process stopped before this request ended"]
    assert isinstance(outcome[0], EngineGone)
    assert redis_conn.get(cancel_key("r4")) == b"1"


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


def taken_off(queue: Queue, redis_conn: redis.Redis, request_id: str) -> None:
    """Enqueue a job and move it as the engine's taker does (workers/taker.py)."""
    queue.enqueue_call(JOB_FUNCTION, args=(payload(request_id).to_dict(),), job_id=request_id)
    assert redis_conn.lmove(queue.key, queue.intermediate_queue_key) == request_id.encode()


def test_a_slot_performs_the_job_the_engine_took_through_rqs_registries(
    pair: tuple[EngineClient, Connection], queue: Queue, redis_conn: redis.Redis
) -> None:
    client, engine_end = pair
    taken_off(queue, redis_conn, "h1")
    worker = SlotWorker([queue], connection=redis_conn, serializer=JSONSerializer)
    take(client, engine_end, "h1")
    job, dequeued_from = worker.dequeue_job_and_maintain_ttl(1)
    assert (job.id, dequeued_from.name) == ("h1", queue.name)
    performer = threading.Thread(target=worker.execute_job, args=(job, queue))
    performer.start()
    wait_for(lambda: job.get_status() == JobStatus.STARTED, 5, "the job to start in RQ")
    assert queue.started_job_registry.get_job_ids() == ["h1"]
    assert redis_conn.lrange(queue.intermediate_queue_key, 0, -1) == []  # RQ's own cleanup of the move
    link.send(engine_end, {"op": "end", "id": "h1", "result": {"finish_reason": "length"}})
    performer.join(10)
    assert job.get_status() == JobStatus.FINISHED
    assert job.return_value() == {"finish_reason": "length"}


def test_an_idle_slot_makes_no_redis_call_and_leaves_when_stopping(
    pair: tuple[EngineClient, Connection], queue: Queue, redis_conn: redis.Redis
) -> None:
    stopping = threading.Event()
    worker = SlotWorker([queue], connection=redis_conn, serializer=JSONSerializer, stopping=stopping)
    threading.Timer(1.2, stopping.set).start()
    # The first poll beats, sets the slot's state and cleans the registries (RQ's maintenance); the
    # next beat is due after BEAT_EVERY_SECONDS, the next cleaning after RQ's maintenance interval.
    assert worker.dequeue_job_and_maintain_ttl(1) is None
    stopping.clear()
    calls: list[tuple[Any, ...]] = []
    original = redis_conn.execute_command

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    redis_conn.execute_command = counted  # type: ignore[method-assign]
    threading.Timer(2.5, stopping.set).start()  # two polls
    try:
        assert worker.dequeue_job_and_maintain_ttl(1) is None
    finally:
        del redis_conn.execute_command
    assert [c for c in calls if c[0] not in ("HGET",)] == []  # get_state reads its own key at most


def test_a_stopping_slot_still_performs_a_job_the_engine_took(
    pair: tuple[EngineClient, Connection], queue: Queue, redis_conn: redis.Redis
) -> None:
    client, engine_end = pair
    taken_off(queue, redis_conn, "h2")
    take(client, engine_end, "h2")
    worker = SlotWorker([queue], connection=redis_conn, serializer=JSONSerializer, stopping=threading.Event())
    worker.stopping.set()
    job, _ = worker.dequeue_job_and_maintain_ttl(1)
    assert job.id == "h2"
    assert worker.dequeue_job_and_maintain_ttl(1) is None  # nothing else taken: it leaves


def test_a_job_taken_is_abandoned_if_rqs_loop_fails_before_performing_it(
    pair: tuple[EngineClient, Connection], queue: Queue, redis_conn: redis.Redis
) -> None:
    client, engine_end = pair

    class LosesRedisAfterTheDequeue(SlotWorker):
        def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
            if self.taken is not None:
                raise redis.ConnectionError("Redis went away")
            super().heartbeat(timeout, pipeline)

    taken_off(queue, redis_conn, "h3")
    take(client, engine_end, "h3")
    worker = LosesRedisAfterTheDequeue([queue], connection=redis_conn, serializer=JSONSerializer)
    with pytest.raises(redis.ConnectionError):
        worker.dequeue_job_and_maintain_ttl(1)
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
