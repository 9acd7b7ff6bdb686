"""What the engine thread takes off the queue, and when it tells the queue process of a job taken (for a
slot to perform it in RQ) and of a request's end (the result of its RQ job).

The runtime is driven step by step in the test's thread, with a real engine on the demo model, a real
Redis and real RQ jobs, which its taker takes off a queue of the test's own; the test holds the queue
process's end of the link. Each message is sent before `_iterate` returns, so what has not arrived
after an iteration was not sent.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from rq import Queue
from rq.serializers import JSONSerializer

from schemas.job import JOB_FUNCTION, JobPayload, decode_events
from schemas.keys import cancel_key
from schemas.sampling import SamplingParams
from scripts.localstack import wait_for
from workers import link
from workers.engine import Engine
from workers.model import LoadedModel, load_model
from workers.runtime import Runtime
from workers.taker import Taker


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


@contextmanager
def runtime_with(
    loaded: LoadedModel, redis_url: str, slots: int, burst: bool = False
) -> Iterator[tuple[Runtime, Connection]]:
    """A runtime with `slots` slots (no engine thread: the test iterates it), and the queue process's
    end of its link."""
    ours, theirs = link.socket_pair()
    connection = redis.Redis.from_url(redis_url)
    taker = Taker(connection, f"runtime-{uuid.uuid4().hex}")
    runtime = Runtime(Engine(loaded, 512, slots), connection, ours, taker, burst=burst)
    queue_end = link.connect(theirs.detach())
    try:
        yield runtime, queue_end
    finally:
        runtime.outbox.reset()
        runtime.taker.close()
        queue_end.close()


@pytest.fixture()
def four_slots(loaded: LoadedModel, redis_url: str) -> Iterator[tuple[Runtime, Connection]]:
    with runtime_with(loaded, redis_url, 4) as pair:
        yield pair


def queue_of(runtime: Runtime) -> Queue:
    return Queue(connection=runtime.connection, serializer=JSONSerializer, name=runtime.taker.queue_key[9:])


def submit(runtime: Runtime, request_id: str, max_tokens: int) -> None:
    """Enqueue the request's job as the API does (an RQ job whose id is the request id)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    payload = JobPayload(request_id, "demo", (5, 6, 7), sampling, f"reply:{request_id}")
    queue_of(runtime).enqueue_call(JOB_FUNCTION, args=(payload.to_dict(),), job_id=request_id)


def messages(queue_end: Connection) -> list[dict[str, Any]]:
    out = []
    while queue_end.poll(0):
        out.append(link.receive(queue_end))
    return out


def ends(queue_end: Connection) -> dict[str, dict[str, Any]]:
    """The ends sent so far, by request id (the `take` messages are skipped)."""
    return {m["id"]: m for m in messages(queue_end) if m["op"] == "end"}


def iterate_until(runtime: Runtime, done: Any, limit: int = 200) -> None:
    for _ in range(limit):
        runtime._iterate()
        if done():
            return
    raise AssertionError("the condition did not hold within the iterations")


def run_one(runtime: Runtime, request_id: str) -> None:
    """A 50-token request, stepped until it decodes."""
    submit(runtime, request_id, max_tokens=50)
    iterate_until(runtime, lambda: len(runtime.engine.running) == 1)


def cancel_one_of_two(
    runtime: Runtime, queue_end: Connection, redis_conn: redis.Redis, stays: str, leaves: str, stays_tokens: int = 500
) -> None:
    """Run two requests, then flag `leaves` and step until the engine has dropped it."""
    submit(runtime, stays, max_tokens=stays_tokens)
    submit(runtime, leaves, max_tokens=500)
    iterate_until(runtime, lambda: len(runtime.engine.running) == 2)
    redis_conn.set(cancel_key(leaves), 1, ex=60)
    iterate_until(runtime, lambda: leaves not in runtime.engine.requests)


def test_a_cancelled_requests_end_waits_its_delay_while_others_run_and_once_the_engine_is_idle(
    four_slots: tuple[Runtime, Connection], redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import runtime as runtime_module

    delay = 2.0
    monkeypatch.setattr(runtime_module, "CANCELLED_END_DELAY_SECONDS", delay)
    monkeypatch.setattr(runtime_module, "FINISHED_END_DELAY_SECONDS", 0.0)  # "stays" ends as it finishes
    monkeypatch.setattr(runtime_module, "IDLE_POLL_SECONDS", 30.0)  # an idle engine must wake for a due end
    runtime, queue_end = four_slots
    flagged = time.monotonic()
    cancel_one_of_two(runtime, queue_end, redis_conn, "stays", "leaves", stays_tokens=30)
    assert list(runtime.engine.requests) == ["stays"]
    seen = ends(queue_end)
    assert "leaves" not in seen  # held back while "stays" runs, though the engine dropped it at once
    iterate_until(runtime, lambda: not runtime.engine.has_work)
    runtime._send_later_ends()  # what the next turn begins with, now on an idle engine
    seen.update(ends(queue_end))
    assert seen["stays"]["result"]["finish_reason"] == "length"
    assert "leaves" not in seen  # still held back

    runtime._iterate()  # the idle engine waits for a request until the held-back end is due
    assert time.monotonic() - flagged < 10  # not through its 30-second poll

    def told() -> bool:
        runtime._send_later_ends()  # what the next turn begins with
        seen.update(ends(queue_end))
        return "leaves" in seen

    wait_for(told, 5, "the held-back end", interval=0.01)
    assert time.monotonic() - flagged >= delay
    assert seen["leaves"]["result"] == {"finish_reason": "cancelled"}
    assert list(seen) == ["stays", "leaves"]


def test_a_cancelled_requests_end_goes_at_once_when_no_slot_would_stay_free(
    loaded: LoadedModel, redis_url: str, redis_conn: redis.Redis
) -> None:
    with runtime_with(loaded, redis_url, 2) as (runtime, queue_end):
        cancel_one_of_two(runtime, queue_end, redis_conn, "stays-2", "leaves-2")
        assert ends(queue_end)["leaves-2"]["result"] == {"finish_reason": "cancelled"}
        assert runtime.engine.has_work  # "stays-2" runs on, and a new job has a slot


def test_a_held_back_end_goes_when_its_delay_is_over(
    four_slots: tuple[Runtime, Connection], redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "CANCELLED_END_DELAY_SECONDS", 0.0)
    runtime, queue_end = four_slots
    cancel_one_of_two(runtime, queue_end, redis_conn, "stays-3", "leaves-3")
    runtime._iterate()  # the next turn finds it due
    assert ends(queue_end)["leaves-3"]["result"] == {"finish_reason": "cancelled"}
    assert runtime.engine.has_work


def test_a_newcomers_first_token_is_published_with_the_running_rows_token_of_the_same_pass(
    four_slots: tuple[Runtime, Connection], redis_conn: redis.Redis
) -> None:
    runtime, _ = four_slots
    run_one(runtime, "old")
    old_tokens = len(runtime.engine.running[0].output_ids)
    pubsub = redis_conn.pubsub()
    pubsub.subscribe("reply:old", "reply:new")
    try:
        for _ in range(2):  # subscribed before anything is published
            assert pubsub.get_message(timeout=5.0)["type"] == "subscribe"  # type: ignore[index]
        submit(runtime, "new", max_tokens=50)
        wait_for(runtime.taker.ready, 5, "the taker's BLMOVE to answer")  # else it joins a step later
        runtime._iterate()
        runtime.outbox.replies()  # every publish of the iteration has been answered, so delivered
        messages = []
        while (message := pubsub.get_message(timeout=1.0)) is not None:
            messages.append((message["channel"].decode(), [(e.seq, e.kind) for e in decode_events(message["data"])]))
    finally:
        pubsub.close()
    # One forward pass: the newcomer's first token and the running row's next, one message per channel.
    assert sorted(channel for channel, _ in messages) == ["reply:new", "reply:old"]
    assert dict(messages)["reply:new"] == [(0, "token")]
    assert [kind for _, kind in dict(messages)["reply:old"]] == ["token"]
    assert len(runtime.engine.running[0].output_ids) == old_tokens + 1


def test_a_finished_requests_end_waits_its_delay_while_the_next_request_is_served(
    four_slots: tuple[Runtime, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import runtime as runtime_module

    delay = 1.0
    monkeypatch.setattr(runtime_module, "FINISHED_END_DELAY_SECONDS", delay)
    monkeypatch.setattr(runtime_module, "IDLE_POLL_SECONDS", 30.0)  # an idle engine must wake for a due end
    runtime, queue_end = four_slots
    submit(runtime, "first", max_tokens=3)
    iterate_until(runtime, lambda: not runtime.engine.has_work)
    finished = time.monotonic()
    submit(runtime, "next", max_tokens=3)  # its client's next request, say
    iterate_until(runtime, lambda: not runtime.engine.has_work)
    assert ends(queue_end) == {}  # neither end yet: their RQ bookkeeping waits
    seen: dict[str, dict[str, Any]] = {}

    def told() -> bool:
        runtime._iterate()  # an idle engine: it waits for a request until the first held-back end is due
        seen.update(ends(queue_end))
        return "first" in seen

    wait_for(told, 5, "the held-back end", interval=0)
    assert time.monotonic() - finished >= delay
    assert seen["first"]["result"]["finish_reason"] == "length"
    assert seen["first"]["result"]["usage"]["completion_tokens"] == 3


def test_a_finished_requests_end_goes_at_once_when_no_slot_would_stay_free(loaded: LoadedModel, redis_url: str) -> None:
    with runtime_with(loaded, redis_url, 1) as (runtime, queue_end):
        submit(runtime, "only", max_tokens=3)
        iterate_until(runtime, lambda: not runtime.engine.has_work)
        assert ends(queue_end)["only"]["result"]["finish_reason"] == "length"  # the one slot is free again


def test_a_job_is_handed_to_its_slot_once_its_first_step_is_out_and_before_its_end(
    four_slots: tuple[Runtime, Connection], redis_conn: redis.Redis
) -> None:
    runtime, queue_end = four_slots
    submit(runtime, "t1", max_tokens=20)
    pubsub = redis_conn.pubsub()
    pubsub.subscribe("reply:t1")
    try:
        assert pubsub.get_message(timeout=5.0)["type"] == "subscribe"  # type: ignore[index]
        runtime._iterate()  # taken, prefilled, first token published, then handed over
        runtime.outbox.replies()
        first = pubsub.get_message(timeout=1.0)
    finally:
        pubsub.close()
    assert [(e.seq, e.kind) for e in decode_events(first["data"])][:1] == [(0, "token")]  # type: ignore[index]
    assert messages(queue_end) == [{"op": "take", "id": "t1"}]
    assert redis_conn.lrange(runtime.taker.intermediate_key, 0, -1) == [b"t1"]  # as RQ's dequeue leaves it
    assert queue_of(runtime).count == 0


def test_a_one_token_requests_take_comes_before_its_end(loaded: LoadedModel, redis_url: str) -> None:
    with runtime_with(loaded, redis_url, 1) as (runtime, queue_end):  # one slot: the end is not held back
        submit(runtime, "t2", max_tokens=1)
        runtime._iterate()
        assert [(m["op"], m["id"]) for m in messages(queue_end)] == [("take", "t2"), ("end", "t2")]


def test_a_refused_job_goes_to_its_slot_at_once_with_the_reason_and_is_not_served(
    four_slots: tuple[Runtime, Connection],
) -> None:
    runtime, queue_end = four_slots
    queue_of(runtime).enqueue_call(JOB_FUNCTION, args=({"v": 1, "request_id": "bad"},), job_id="bad")
    queue_of(runtime).enqueue_call("os.getcwd", job_id="evil")
    iterate_until(runtime, lambda: queue_of(runtime).count == 0)
    told = {m["id"]: m for m in messages(queue_end)}
    assert set(told) == {"bad", "evil"}
    assert told["bad"]["op"] == told["evil"]["op"] == "take"
    assert told["bad"]["refused"].startswith("invalid job payload: ")
    assert "sampling" in told["bad"]["refused"]  # the missing fields are named
    assert told["evil"]["refused"] == "job function 'os.getcwd' is not served by this worker"
    assert not runtime.engine.has_work and runtime.tracked == {}


def test_a_job_whose_client_left_before_the_take_is_never_prefilled(
    four_slots: tuple[Runtime, Connection], redis_conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "CANCELLED_END_DELAY_SECONDS", 0.0)
    runtime, queue_end = four_slots
    submit(runtime, "gone", max_tokens=20)
    redis_conn.set(cancel_key("gone"), 1, ex=60)  # the API's flag, set after a worker may have taken it
    prefills: list[int] = []
    monkeypatch.setattr(runtime.engine, "_prefill", lambda sequences: prefills.append(len(sequences)))
    runtime._iterate()
    runtime._iterate()  # the held-back end is due
    assert prefills == []
    assert [(m["op"], m["id"]) for m in messages(queue_end)] == [("take", "gone"), ("end", "gone")]
    assert not runtime.engine.has_work


def test_no_more_jobs_are_taken_than_the_worker_has_slots(loaded: LoadedModel, redis_url: str) -> None:
    with runtime_with(loaded, redis_url, 2) as (runtime, _):
        for request_id in ("s1", "s2", "s3"):
            submit(runtime, request_id, max_tokens=400)
        iterate_until(runtime, lambda: len(runtime.engine.running) == 2)
        for _ in range(5):
            runtime._iterate()
        assert sorted(runtime.engine.requests) == ["s1", "s2"]
        assert queue_of(runtime).get_job_ids() == ["s3"]  # still queued, for another worker
        assert not runtime.taker.blocked  # no BLMOVE waits while every slot is held


def test_a_drain_puts_back_what_the_waiting_blmove_took_and_then_tells_the_queue_process(
    four_slots: tuple[Runtime, Connection], redis_conn: redis.Redis
) -> None:
    runtime, queue_end = four_slots
    assert runtime.taker.listen()  # a BLMOVE waits on the queue, as on an idle engine
    runtime.drain()  # SIGTERM: the main thread asks
    submit(runtime, "late", max_tokens=5)
    wait_for(runtime.taker.ready, 5, "the BLMOVE to take the job")
    runtime._iterate()
    assert messages(queue_end) == [{"op": "drain"}]
    assert queue_of(runtime).get_job_ids() == ["late"]  # back at the front, for another worker
    assert redis_conn.lrange(runtime.taker.intermediate_key, 0, -1) == []
    assert runtime.drained and not runtime.engine.has_work
    submit(runtime, "later", max_tokens=5)
    runtime._iterate()
    assert queue_of(runtime).get_job_ids() == ["late", "later"]


def test_a_burst_runtime_serves_what_is_queued_then_drains(loaded: LoadedModel, redis_url: str) -> None:
    with runtime_with(loaded, redis_url, 4, burst=True) as (runtime, queue_end):
        submit(runtime, "b1", max_tokens=3)
        submit(runtime, "b2", max_tokens=3)
        iterate_until(runtime, lambda: runtime.drained)
        told = messages(queue_end)
        assert told[-1] == {"op": "drain"}
        assert {m["id"] for m in told if m["op"] == "take"} == {"b1", "b2"}
        assert not runtime.taker.blocked


def test_a_job_taken_during_a_step_is_read_as_the_step_is_published_and_joins_at_the_next(
    four_slots: tuple[Runtime, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime, _ = four_slots
    run_one(runtime, "old")
    assert runtime.taker.blocked  # room is left: a BLMOVE waits while "old" decodes
    decode = runtime.engine.decode

    def decode_while_a_job_arrives() -> list[Any]:
        submit(runtime, "new", max_tokens=5)
        wait_for(lambda: runtime.taker.connection.can_read(timeout=0), 5, "the BLMOVE to take it")  # type: ignore[union-attr]
        return decode()

    monkeypatch.setattr(runtime.engine, "decode", decode_while_a_job_arrives)
    runtime._iterate()
    assert runtime.taker.reading is not None  # the read of "new" went out with the step's events
    assert "new" not in runtime.engine.requests
    monkeypatch.setattr(runtime.engine, "decode", decode)
    runtime._iterate()
    assert [s.request.request_id for s in runtime.engine.running] == ["old", "new"]
    assert runtime.taker.reading is None and runtime.taker.blocked
