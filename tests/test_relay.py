"""The relay on a real Redis: ordered delivery, gaps and silence end a request with an error."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from app.admission import Admission
from app.dispatch import Dispatcher
from app.relay import Relay, RelayBroken
from schemas.config import Settings
from schemas.errors import ClientGone, GenerationFailed, RelayTimeout
from schemas.job import Event, Usage, encode_events
from schemas.keys import cancel_key
from scripts.localstack import wait_for


@pytest.fixture()
def relay(redis_url: str, settings: Settings) -> Iterator[Relay]:
    connection = redis.Redis.from_url(redis_url)
    relay = Relay(connection, cancel=Dispatcher(connection, settings, Admission(connection, settings)).cancel)
    yield relay
    relay.stop()
    wait_for(lambda: connection.pubsub_numsub(relay.channel)[0][1] == 0, 5, "the relay to unsubscribe")
    connection.close()


def publish(conn: redis.Redis, channel: str, *events: Event) -> None:
    conn.publish(channel, encode_events(list(events)))


def test_subscription_is_confirmed_before_open_returns(relay: Relay, redis_conn: redis.Redis) -> None:
    relay.open("r1")
    assert redis_conn.pubsub_numsub(relay.channel) == [(relay.channel.encode(), 1)]


def test_events_reach_their_own_request_in_order(relay: Relay, redis_conn: redis.Redis) -> None:
    a, b = relay.open("a"), relay.open("b")
    publish(redis_conn, relay.channel, Event("a", 0, "token", text="x"), Event("b", 0, "token", text="y"))
    publish(redis_conn, relay.channel, Event("a", 1, "done", finish_reason="stop", usage=Usage(1, 1)))
    publish(redis_conn, relay.channel, Event("b", 1, "done", finish_reason="length", usage=Usage(1, 1)))
    assert [(e.kind, e.text) for e in a.events(5, 5)] == [("token", "x"), ("done", "")]
    assert [e.finish_reason for e in b.events(5, 5)] == [None, "length"]
    assert a.finished and b.finished


def test_a_sequence_gap_is_an_error(relay: Relay, redis_conn: redis.Redis) -> None:
    sub = relay.open("gap")
    publish(redis_conn, relay.channel, Event("gap", 0, "token", text="x"), Event("gap", 2, "token", text="z"))
    events = sub.events(5, 5)
    assert next(events).text == "x"
    with pytest.raises(GenerationFailed, match="Lost events"):
        next(events)


def test_silence_is_a_timeout_error_after_the_token_timeout(relay: Relay, redis_conn: redis.Redis) -> None:
    sub = relay.open("quiet")
    publish(redis_conn, relay.channel, Event("quiet", 0, "token", text="x"))
    events = sub.events(5, 0.3)
    next(events)
    started = time.monotonic()
    with pytest.raises(RelayTimeout):
        next(events)
    assert 0.3 <= time.monotonic() - started < 2


def test_a_preempted_choice_waits_as_a_queued_request_and_the_formats_never_see_it(
    relay: Relay, redis_conn: redis.Redis
) -> None:
    sub = relay.open("swapped")
    publish(redis_conn, relay.channel, Event("swapped", 0, "token", text="x"), Event("swapped", 1, "waiting"))
    events = sub.events(5, 0.3)  # first (queue) timeout 5 s, token timeout 0.3 s
    assert next(events).text == "x"
    # Three token timeouts after "waiting" (within the first timeout), the choice runs again.
    threading.Timer(1.0, publish, (redis_conn, relay.channel, Event("swapped", 2, "token", text="y"))).start()
    started = time.monotonic()
    assert next(events).text == "y" and time.monotonic() - started >= 0.9
    with pytest.raises(RelayTimeout):  # running again: the token timeout is back
        next(events)
    assert time.monotonic() - started < 3


def test_events_of_closed_requests_are_dropped_and_their_worker_asked_to_stop(
    relay: Relay, redis_conn: redis.Redis
) -> None:
    sub = relay.open("gone")
    relay.close("gone")
    ended = relay.open("ended")
    relay.close("ended")
    publish(redis_conn, relay.channel, Event("gone", 0, "token", text="x"), Event("ended", 3, "done"))
    keep = relay.open("kept")
    publish(redis_conn, relay.channel, Event("kept", 0, "cancelled"))
    assert [e.kind for e in keep.events(5, 5)] == ["cancelled"]
    assert sub.inbox.empty() and ended.inbox.empty()
    # A request still generating for no one (its cancel lost with Redis, say) is cancelled again; one
    # whose last event came is left alone.
    assert redis_conn.exists(cancel_key("gone")) and not redis_conn.exists(cancel_key("ended"))


def test_n_choices_end_after_every_choice_is_done(relay: Relay, redis_conn: redis.Redis) -> None:
    sub = relay.open("n2", choices=2)
    publish(
        redis_conn,
        relay.channel,
        Event("n2", 0, "done", index=0, finish_reason="stop", usage=Usage(1, 1)),
        Event("n2", 1, "done", index=1, finish_reason="length", usage=Usage(1, 2)),
    )
    assert [e.index for e in sub.events(5, 5)] == [0, 1]


def test_an_interrupt_ends_a_waiting_reader_at_once(relay: Relay) -> None:
    sub = relay.open("waiting")
    raised: list[Exception] = []

    def read() -> None:
        try:
            list(sub.events(60, 60))
        except ClientGone as exc:
            raised.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    sub.interrupt(ClientGone("gone"))
    reader.join(10)
    assert not reader.is_alive() and len(raised) == 1


def test_an_interrupt_overtakes_queued_events(relay: Relay, redis_conn: redis.Redis) -> None:
    sub = relay.open("behind", buffer=2)
    publish(redis_conn, relay.channel, Event("behind", 0, "token", text="x"), Event("behind", 1, "token", text="y"))
    wait_for(sub.inbox.full, 5, "the inbox to fill")
    sub.interrupt(ClientGone("gone"))
    with pytest.raises(ClientGone):
        next(sub.events(5, 5))
    assert not sub.overflowed  # an interrupt is not a slow reader: the relay cancels nothing itself


def test_each_request_failed_by_a_lost_relay_gets_its_own_error(redis_url: str) -> None:
    """The metrics count an error once (app/metrics.py): one error shared by every request that a
    Redis outage failed counted one of them."""
    connection = redis.Redis.from_url(redis_url)
    relay = Relay(connection, cancel=lambda request_id: None)
    first, second = relay.open("r1"), relay.open("r2")
    relay.stop()
    errors = []
    for subscription in (first, second):
        with pytest.raises(RelayBroken) as caught:
            list(subscription.events(5, 5))
        errors.append(caught.value)
    connection.close()
    assert errors[0] is not errors[1]
