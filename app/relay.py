"""Token relay: one pub/sub subscription per API process, fanned out to the open requests.

The process subscribes once to its own reply channel (before any job is queued) and a listener
thread (a greenlet under gevent) hands each event to the request it belongs to. A request reads its
events in order: a sequence gap, or no event within the timeout, ends it with an error, never with a
silently truncated answer.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator

import redis

from schemas.clock import clock
from schemas.errors import GenerationFailed, RelayTimeout, RequestTimeout, ServiceUnavailable, SlowClient
from schemas.job import Event, decode_events
from schemas.keys import reply_channel

logger = logging.getLogger(__name__)

RECONNECT_DELAY_SECONDS = 0.5
# The listener pings Redis over its subscription this often, and takes it for lost when nothing at all
# (an event, a reply) has come for STALL_SECONDS after a request to it (a ping, the subscribe): a Redis
# that hangs (stopped, or cut off by the network) keeps the connection open, and without a ping its
# silence looks like a quiet hour. The time counts from the request, not from the last reply, and what
# arrived meanwhile is read before it is taken for lost: a process that did not run for seconds (a
# request's long CPU work on gevent's loop, a SIGSTOP) finds Redis as it left it, not away.
PING_SECONDS = 1.0
STALL_SECONDS = 2.0
POLL_SECONDS = 0.5  # how often the listener looks at the time while nothing comes
PING_MESSAGE = "tokenline-relay"
DROPPED_REMEMBERED = 4096  # orphaned requests the relay remembers having asked a worker to drop


class RelayBroken(GenerationFailed):
    """The relay lost its connection to Redis: events may have been lost. A 503 with Retry-After, as
    every request meets while Redis is away: the fault is the service's, and passes."""

    status = 503
    retry_after = 1


class ApiStopping(RelayBroken):
    """This API process is stopping (a reload, a restart) and its graceful time runs out: the request
    ends now with an error its client can act on (retry: another process serves it), not cut off. A
    503 `service_unavailable`, as every retryable refusal is: nothing failed in the generation."""

    type = "service_unavailable"
    code = "service_unavailable"


class FirstEventTimeout(RelayTimeout):
    """Nothing came for the request within the first-event timeout (it may still be queued)."""


class Subscription:
    """The events of one request, in order, as the listener receives them.

    The inbox holds at most `buffer` events: a client that reads more slowly than its request is
    generated overflows it, and the request is cancelled instead of piling up memory in the API.
    """

    def __init__(self, request_id: str, choices: int, buffer: int = 0) -> None:
        self.request_id = request_id
        self.choices = choices
        self.inbox: queue.Queue[Event | Exception] = queue.Queue(maxsize=buffer)
        self.finished = False
        self.overflowed = False
        self.closed = False  # the relay stopped delivering to it: the request ended
        self.interrupted: Exception | None = None

    def interrupt(self, error: Exception) -> None:
        """From any thread: end the request with `error` now, whatever is queued in the inbox."""
        self.interrupted = error
        # Wakes a waiting reader; a reader whose inbox is full is not waiting, and sees `interrupted` next.
        with contextlib.suppress(queue.Full):
            self.inbox.put_nowait(error)

    def events(
        self,
        first_timeout: float,
        token_timeout: float,
        heartbeat: float | None = None,
        deadline: float | None = None,
    ) -> Iterator[Event | None]:
        """Yield events until every choice is done, or the request errs or is cancelled.

        With `heartbeat`, None is yielded after each such quiet interval, so that the caller can
        write a keep-alive (and so learn that its client has gone) while the request waits. A choice
        the worker preempted ("waiting", not yielded) is bounded by `first_timeout` until its next
        event, as a request still queued is: it waits for memory, not on a stuck worker.
        `deadline` (time.monotonic()) ends the request with RequestTimeout, whatever arrives.
        """
        expected, done, timeout = 0, 0, first_timeout
        waiting: set[int] = set()  # the choices the worker preempted, until their next event
        while True:
            quiet_until = time.monotonic() + timeout
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise RequestTimeout("The request exceeded its time limit and was cancelled.")
                wait = min(quiet_until, deadline or quiet_until) - now
                if quiet_until <= now:
                    error = FirstEventTimeout if expected == 0 else RelayTimeout
                    raise error(f"No response from the model worker within {timeout:g} seconds.")
                try:
                    item = self.inbox.get(timeout=min(wait, heartbeat) if heartbeat else wait)
                    break
                except queue.Empty:
                    if heartbeat and time.monotonic() < quiet_until:
                        yield None
            if self.interrupted is not None:
                raise self.interrupted
            if self.overflowed:
                raise SlowClient("The client read the stream too slowly; the request was cancelled.")
            if isinstance(item, Exception):
                raise item
            if item.seq != expected:
                raise GenerationFailed(
                    f"Lost events from the worker (expected {expected}, got {item.seq}).", code="lost_events"
                )
            expected += 1
            if item.kind == "waiting":  # preempted: it waits for the pool as a queued request waits
                waiting.add(item.index)
                timeout = first_timeout
                continue
            waiting.discard(item.index)
            timeout = first_timeout if waiting else token_timeout
            done += item.kind == "done"
            if item.kind in ("error", "cancelled") or done == self.choices:
                self.finished = True
            yield item
            if self.finished:
                return


class RedisState:
    """Whether this API process has found Redis away, so that an outage is logged once when it starts
    and once when it ends (not once per request), and the relay refuses at once while it lasts."""

    def __init__(self) -> None:
        self.down = False
        self._lock = threading.Lock()

    def lost(self, exc: BaseException) -> None:
        with self._lock:
            if self.down:
                return
            self.down = True
        logger.warning("Redis is unavailable (%s); answering 503 until it is back", exc)

    def back(self) -> None:
        with self._lock:
            if not self.down:
                return
            self.down = False
        logger.info("Redis is back")


class Relay:
    def __init__(self, connection: redis.Redis, cancel: Callable[[str], None]) -> None:
        self.connection = connection
        self.cancel = cancel  # flags a request for the worker to drop (Dispatcher.cancel)
        self.channel = reply_channel(f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.subscriptions: dict[str, Subscription] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()  # the last requests asked to be dropped
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self.redis = RedisState()
        # Called from the listener each time Redis answers it (app/__init__.py: the places whose
        # release failed while Redis was away are given back).
        self.on_reply: Callable[[], None] | None = None

    def ensure_started(self, timeout: float = 5.0) -> None:
        """Subscribe (once per process, also after a fork) and wait until Redis confirms it; while
        Redis is known to be away (the listener lost it, or a command failed since its last reply),
        refuse at once. The listener's next reply from Redis ends that."""
        if self._pid == os.getpid() and self._ready.is_set() and not self.redis.down:
            return
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._ready.clear()
                threading.Thread(target=self._listen, name="relay", daemon=True).start()
        deadline = time.monotonic() + timeout
        while self.redis.down or not self._ready.wait(0.01):
            if self.redis.down or time.monotonic() > deadline:
                raise ServiceUnavailable("The queue (Redis) is unavailable; try again shortly.")

    def open(self, request_id: str, choices: int = 1, buffer: int = 0) -> Subscription:
        self.ensure_started()
        subscription = Subscription(request_id, choices, buffer)
        self.subscriptions[request_id] = subscription
        return subscription

    def close(self, request_id: str) -> None:
        subscription = self.subscriptions.pop(request_id, None)
        if subscription is not None:
            subscription.closed = True

    def interrupt_all(self, error: Exception) -> None:
        """End every open request with (a copy of) `error` now."""
        for subscription in list(self.subscriptions.values()):
            subscription.interrupt(copy.copy(error))

    def stop(self) -> None:
        """End the listener (at its next poll); open requests get an error."""
        self._stopped.set()
        self._fail_all(RelayBroken("The token relay was stopped."))

    def _listen(self) -> None:
        while not self._stopped.is_set():
            pubsub = self.connection.pubsub()
            try:
                pubsub.subscribe(self.channel)
                # The last ping, and the oldest request Redis has not answered since it last spoke.
                pinged = unanswered = time.monotonic()
                while not self._stopped.is_set():
                    message = pubsub.get_message(timeout=POLL_SECONDS)
                    now = time.monotonic()
                    if message is None and unanswered is not None and now - unanswered > STALL_SECONDS:
                        message = pubsub.get_message(timeout=0.0)  # what came while this process did not run
                        if message is None:
                            raise redis.TimeoutError(f"no reply from Redis in {now - unanswered:.1f} seconds")
                    if message is not None:
                        unanswered = None
                    if now - pinged >= PING_SECONDS:
                        pubsub.ping(PING_MESSAGE)
                        pinged = now
                        unanswered = now if unanswered is None else unanswered
                    if message is None:
                        continue
                    if message["type"] == "subscribe":  # Redis confirmed: events cannot be missed now
                        self._ready.set()
                        self._answered()
                    elif message["type"] == "pong" and self._ready.is_set():
                        self._answered()  # a command that failed meanwhile did not find it away for good
                    elif message["type"] == "message":
                        self._deliver(message["data"])
            except Exception as exc:
                if self._stopped.is_set():
                    return
                self.redis.lost(exc)
                self._ready.clear()
                self._fail_all(RelayBroken("The connection to Redis was lost during generation."))
                time.sleep(RECONNECT_DELAY_SECONDS)
            finally:
                pubsub.close()

    def _answered(self) -> None:
        self.redis.back()
        # Redis just answered: the moment to measure this process's offset from its clock (requests are
        # stamped by it), off the requests' path; if Redis fails it now, at a later reply.
        with contextlib.suppress(redis.RedisError):
            clock.sync_if_stale(self.connection)
        if self.on_reply is not None:
            try:
                self.on_reply()
            except Exception:
                logger.exception("relay: the reply callback failed")

    def _deliver(self, data: bytes) -> None:
        try:
            events = decode_events(data)
        except (ValueError, KeyError, TypeError):
            logger.error("relay dropped a malformed message on %s", self.channel)
            return
        for event in events:
            subscription = self.subscriptions.get(event.request_id)
            if subscription is None:
                self._orphaned(event)
                continue
            if subscription.overflowed:
                continue
            try:
                subscription.inbox.put_nowait(event)
            except queue.Full:
                self._overflow(subscription)

    def _orphaned(self, event: Event) -> None:
        """An event of a request this process no longer relays (it failed, timed out, or its client
        left): the worker is asked to drop it, once, in case the cancel sent then was lost (Redis was
        away, say) and the worker generates for no one."""
        if event.final or event.request_id in self._dropped:
            return
        self._dropped[event.request_id] = None
        if len(self._dropped) > DROPPED_REMEMBERED:
            self._dropped.popitem(last=False)
        logger.info(
            "request_id=%s: events for a request no longer relayed; asking its worker to drop it", event.request_id
        )
        self.cancel(event.request_id)

    def _overflow(self, subscription: Subscription) -> None:
        """The client fell `buffer` events behind: stop the generation; the stream ends with an error."""
        subscription.overflowed = True
        logger.warning(
            "request_id=%s: client too slow, %d events behind; cancelling",
            subscription.request_id,
            subscription.inbox.maxsize,
        )
        self.cancel(subscription.request_id)

    def _fail_all(self, error: Exception) -> None:
        for subscription in list(self.subscriptions.values()):
            try:  # each request its own error: the metrics count an error once (app/metrics.py)
                subscription.inbox.put_nowait(copy.copy(error))
            except queue.Full:  # a reader that far behind has been cancelled already
                subscription.overflowed = True
