"""When the engine thread tells the queue process that a request ended (the result of its RQ job).

The runtime is driven step by step in the test's thread, with a real engine on the demo model and a
real Redis; the test holds the queue process's end of the link. Each message is sent before
`_iterate` returns, so what has not arrived after an iteration was not sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from schemas.job import JobPayload, decode_events
from schemas.keys import cancel_key
from schemas.sampling import SamplingParams
from scripts.localstack import wait_for
from workers import link
from workers.engine import Engine
from workers.model import LoadedModel, load_model
from workers.runtime import Runtime


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


def make_runtime(loaded: LoadedModel, redis_url: str, slots: int) -> tuple[Runtime, Connection]:
    ours, theirs = link.socket_pair()
    runtime = Runtime(Engine(loaded, 512, slots), redis.Redis.from_url(redis_url), ours)  # no engine thread
    return runtime, link.connect(theirs.detach())


@pytest.fixture()
def four_slots(loaded: LoadedModel, redis_url: str) -> Iterator[tuple[Runtime, Connection]]:
    runtime, queue_end = make_runtime(loaded, redis_url, 4)
    yield runtime, queue_end
    runtime.outbox.reset()
    queue_end.close()


def submit(queue_end: Connection, request_id: str, max_tokens: int) -> None:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    payload = JobPayload(request_id, "demo", (5, 6, 7), sampling, f"reply:{request_id}")
    link.send(queue_end, {"op": "submit", "payload": payload.to_dict()})


def ends(queue_end: Connection) -> dict[str, dict[str, Any]]:
    """The ends sent so far, by request id (the `started` messages are skipped)."""
    out = {}
    while queue_end.poll(0):
        message = link.receive(queue_end)
        if message["op"] == "end":
            out[message["id"]] = message
    return out


def iterate_until(runtime: Runtime, done: Any, limit: int = 200) -> None:
    for _ in range(limit):
        runtime._iterate()
        if done():
            return
    raise AssertionError("the condition did not hold within the iterations")


def cancel_one_of_two(
    runtime: Runtime, queue_end: Connection, redis_conn: redis.Redis, stays: str, leaves: str, stays_tokens: int = 500
) -> None:
    """Run two requests, then flag `leaves` and step until the engine has dropped it."""
    submit(queue_end, stays, max_tokens=stays_tokens)
    submit(queue_end, leaves, max_tokens=500)
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
    runtime, queue_end = make_runtime(loaded, redis_url, 2)
    try:
        cancel_one_of_two(runtime, queue_end, redis_conn, "stays-2", "leaves-2")
        assert ends(queue_end)["leaves-2"]["result"] == {"finish_reason": "cancelled"}
        assert runtime.engine.has_work  # "stays-2" runs on, and a new job has a slot
    finally:
        runtime.outbox.reset()
        queue_end.close()


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
    runtime, queue_end = four_slots
    submit(queue_end, "old", max_tokens=50)
    iterate_until(runtime, lambda: len(runtime.engine.running) == 1)
    old_tokens = len(runtime.engine.running[0].output_ids)
    pubsub = redis_conn.pubsub()
    pubsub.subscribe("reply:old", "reply:new")
    try:
        for _ in range(2):  # subscribed before anything is published
            assert pubsub.get_message(timeout=5.0)["type"] == "subscribe"  # type: ignore[index]
        submit(queue_end, "new", max_tokens=50)
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
    submit(queue_end, "first", max_tokens=3)
    iterate_until(runtime, lambda: not runtime.engine.has_work)
    finished = time.monotonic()
    submit(queue_end, "next", max_tokens=3)  # its client's next request, say
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
    runtime, queue_end = make_runtime(loaded, redis_url, 1)
    try:
        submit(queue_end, "only", max_tokens=3)
        iterate_until(runtime, lambda: not runtime.engine.has_work)
        assert ends(queue_end)["only"]["result"]["finish_reason"] == "length"  # the one slot is free again
    finally:
        runtime.outbox.reset()
        queue_end.close()
