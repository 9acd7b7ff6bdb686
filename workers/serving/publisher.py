"""The publisher thread: each step's events to Redis, the cancel flags back, each ended job into RQ.

One pipelined round trip per batch of steps: a PUBLISH per reply channel (a JSON list of events),
the RQ records of the requests that ended (written by the job table, serving/inflight.py), and an
MGET of the live requests' cancel flags, whose answers become `Cancel` messages for the engine
thread. Steps that pile up while a round trip is under way go out together, in order, so the engine
thread never waits on Redis.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from schemas.job import Event, encode_events
from schemas.keys import admitted_key, cancel_key
from workers.serving.inflight import JobTable
from workers.serving.loop import EngineLoop, Poster

if TYPE_CHECKING:
    from workers.serving.routing import RoutingAgent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Post:
    events: list[Event]
    ended: list[str]
    live: list[str]


class Publisher(Poster):
    def __init__(self, connection: redis.Redis, loop: EngineLoop, jobs: JobTable, model: str) -> None:
        self.connection = connection
        self.model = model
        self.loop = loop
        self.jobs = jobs
        self.posts: queue.SimpleQueue[_Post | None] = queue.SimpleQueue()
        self._failing = False
        self._idle = threading.Event()
        self._idle.set()
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        # Set once the worker publishes its prefix cache for routing (workers/serving/routing.py).
        self.routing: RoutingAgent | None = None

    def start(self) -> None:
        self.thread.start()

    def post(self, events: list[Event], ended: list[str], live: list[str]) -> None:
        self._idle.clear()
        self.posts.put(_Post(events, ended, live))

    def flush(self, timeout: float) -> bool:
        """Wait until every post so far has been sent."""
        return self._idle.wait(timeout)

    def stop(self) -> None:
        self.posts.put(None)
        self.thread.join(5)

    def _run(self) -> None:
        while True:
            batch = [self.posts.get()]
            while not self.posts.empty():
                batch.append(self.posts.get_nowait())
            stopping = None in batch
            posts = [p for p in batch if p is not None]
            if posts:
                self._send(posts)
            if self.posts.empty():
                self._idle.set()
            if stopping:
                return

    def _unheard(self, batches: list[tuple[str, list[Event]]]) -> None:
        """No API process listens on these channels (PUBLISH reached no one): the one that queued these
        requests died (a killed gunicorn worker), or its relay lost Redis and failed them. Their events
        are lost either way and nobody will read the rest: the requests are dropped, not run to their
        end, and their places given back. (An API process subscribes before it queues anything, so a
        live one always listens.)"""
        dropped: dict[str, str] = {}  # request id: its channel
        for channel, events in batches:
            dropped.update((e.request_id, channel) for e in events if not e.final)
        for request_id, channel in dropped.items():
            logger.info("request_id=%s: no API process listens on %s; dropping it", request_id, channel)
            self.loop.cancel(request_id)
        if dropped:  # a dead API process cannot give their places under maxLinkNum back (one round trip)
            try:
                self.connection.zrem(admitted_key(self.model), *dropped)
            except redis.RedisError as exc:  # the places free themselves when their hold expires
                logger.debug("could not give back the places of %s: %s", ",".join(dropped), exc)

    def _send(self, posts: list[_Post]) -> None:
        events = [e for p in posts for e in p.events]
        ended = [rid for p in posts for rid in p.ended]
        live = [rid for rid in posts[-1].live if rid in self.jobs]
        by_channel = self.jobs.record(events)
        freed = 0
        # Where a request ends, the cache's new blocks go to Redis before its last events do: a client
        # who continues the conversation at once is routed to this worker's cache (the beacon's next
        # beat, up to half a second later, came after the next turn had gone elsewhere).
        routing = self.routing if ended else None
        try:
            with routing.lock if routing is not None else contextlib.nullcontext():
                with self.connection.pipeline(transaction=False) as pipe:
                    if routing is not None:
                        routing.publish(pipe)
                    first = len(pipe)
                    for channel, batch in by_channel.items():
                        pipe.publish(channel, encode_events(batch))
                    freed = self.jobs.end(ended, pipe)
                    if live:
                        pipe.mget([cancel_key(rid) for rid in live])
                    replies = pipe.execute()
                if routing is not None:
                    routing.published(replies)
        except redis.RedisError as exc:
            if routing is not None:
                routing.failed()
            if not self._failing:
                logger.warning("publishing failed (Redis: %s); the API reports the outage to its clients", exc)
            self._failing = True
            # Their events are lost, and the API fails a request whose events skip (or that was open
            # when its connection broke): generating the rest would hold batch slots for no one.
            for request_id in dict.fromkeys(e.request_id for e in events if not e.final):
                self.loop.cancel(request_id)
            return
        finally:
            self.jobs.free(freed)
        if self._failing:
            logger.info("publishing restored")
        self._failing = False
        unheard = [item for item, receivers in zip(by_channel.items(), replies[first:], strict=False) if not receivers]
        if unheard:
            self._unheard(unheard)
        if live:
            for request_id, flag in zip(live, replies[-1], strict=True):
                if flag is not None:
                    self.loop.cancel(request_id)
