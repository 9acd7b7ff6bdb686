"""The engine thread's publishing on a real Redis: a step's events go out without waiting for Redis'
replies, which (with the cancel flags read alongside) are read before the next step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from schemas.job import Event, JobPayload, decode_events
from schemas.keys import cancel_key
from schemas.sampling import SamplingParams
from scripts.localstack import wait_for
from workers import link
from workers.runtime import Outbox, Runtime, Tracked
from workers.taker import Taker


@pytest.fixture()
def runtime(redis_url: str) -> Iterator[Runtime]:
    ours, theirs = link.socket_pair()
    connection = redis.Redis.from_url(redis_url)
    taker = Taker(connection, "outbox-test")
    runtime = Runtime(None, connection, ours, taker)  # type: ignore[arg-type]  # no engine thread
    yield runtime
    runtime.outbox.reset()
    ours.close()
    theirs.close()


@pytest.fixture()
def listener(redis_conn: redis.Redis) -> Iterator[redis.client.PubSub]:
    pubsub = redis_conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("reply:a")
    yield pubsub
    pubsub.close()


def track(runtime: Runtime, request_id: str) -> None:
    payload = JobPayload(request_id, "demo", (1, 2), SamplingParams(max_tokens=4), "reply:a", 1)
    runtime.tracked[request_id] = Tracked(payload)


def received(pubsub: redis.client.PubSub, count: int) -> list[Event]:
    events: list[Event] = []

    def more() -> bool:
        message = pubsub.get_message(timeout=0.1)
        if message is not None:
            events.extend(decode_events(message["data"]))
        return len(events) >= count

    wait_for(more, 5, f"{count} events")
    return events


def test_steps_go_out_unanswered_in_order_and_the_flags_come_with_the_replies(
    runtime: Runtime, listener: redis.client.PubSub, redis_conn: redis.Redis
) -> None:
    for request_id in ("r1", "r2"):
        track(runtime, request_id)
    redis_conn.set(cancel_key("r2"), 1)
    for seq in range(3):  # three steps, no reply read in between
        runtime._post([Event("r1", seq, "token", index=0, text=f"t{seq}")], read_flags=["r1", "r2"])
    assert runtime.outbox.owed == 6
    assert [(e.seq, e.text) for e in received(listener, 3)] == [(0, "t0"), (1, "t1"), (2, "t2")]
    assert runtime._replies() == {"r1": False, "r2": True}  # the last step's read
    assert runtime.outbox.owed == 0
    assert runtime._replies() is None  # nothing owed: the next step reads the flags afresh


def test_a_post_without_a_read_leaves_no_flags_to_trust(runtime: Runtime, listener: redis.client.PubSub) -> None:
    track(runtime, "r1")
    runtime._post([Event("r1", 0, "token", index=0, text="a")], read_flags=["r1"])
    runtime._post([Event("r1", 1, "cancelled")], read_flags=[])
    assert runtime._replies() is None
    assert runtime.publish([], read_flags=["r1"]) == {"r1": False}


def test_a_lost_connection_fails_the_read_and_the_next_post_reconnects(
    runtime: Runtime, listener: redis.client.PubSub, redis_conn: redis.Redis
) -> None:
    track(runtime, "r1")
    runtime._post([Event("r1", 0, "token", index=0, text="a")], read_flags=["r1"])
    assert runtime._replies() == {"r1": False}
    redis_conn.client_kill_filter(_id=outbox_client_id(runtime.outbox, redis_conn))
    with pytest.raises(redis.ConnectionError):  # when sending or when reading, as the kernel has it
        runtime._post([Event("r1", 1, "token", index=0, text="b")], read_flags=["r1"])
        runtime._replies()
    assert runtime.outbox.connection is None and runtime.outbox.owed == 0
    assert runtime.publish([Event("r1", 2, "token", index=0, text="c")], read_flags=["r1"]) == {"r1": False}
    assert [e.text for e in received(listener, 2)] == ["a", "c"]


def closed_by_server(connection: redis.Connection) -> bool:
    try:
        return connection.can_read(timeout=0.1)
    except redis.ConnectionError:  # redis-py reports the end of the stream so
        return True


def outbox_client_id(outbox: Outbox, redis_conn: redis.Redis) -> int:
    """The server's id of the outbox's connection (the one whose local port is ours)."""
    port = outbox.connection._sock.getsockname()[1]  # type: ignore[union-attr]
    return next(int(c["id"]) for c in redis_conn.client_list() if c["addr"].endswith(f":{port}"))


def test_a_connection_closed_while_nothing_was_owed_is_replaced_before_use(
    runtime: Runtime, listener: redis.client.PubSub, redis_conn: redis.Redis
) -> None:
    runtime.outbox = Outbox(runtime.connection.connection_pool, idle_check=0)  # check before every idle use
    track(runtime, "r1")
    assert runtime.publish([Event("r1", 0, "token", index=0, text="a")], read_flags=["r1"]) == {"r1": False}
    redis_conn.client_kill_filter(_id=outbox_client_id(runtime.outbox, redis_conn))
    wait_for(lambda: closed_by_server(runtime.outbox.connection), 5, "the close to reach us")  # type: ignore[arg-type]
    assert runtime.publish([Event("r1", 1, "token", index=0, text="b")], read_flags=["r1"]) == {"r1": False}
    assert [e.text for e in received(listener, 2)] == ["a", "b"]
