"""The publisher thread: each step's events to Redis, the cancel flags back, each ended job into RQ.

One pipelined round trip per batch of steps: a PUBLISH per reply channel (a JSON list of events),
the RQ records of the requests that ended (schemas/ledger.py), and an MGET of the live requests'
cancel flags, whose answers become `Cancel` messages for the engine thread. Steps that pile up while
a round trip is under way go out together, in order, so the engine thread never waits on Redis.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import redis

from schemas import ledger
from schemas.job import Event, encode_events
from schemas.keys import cancel_key
from workers.serving.loop import EngineLoop, InFlight, Poster

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Post:
    events: list[Event]
    ended: list[str]
    live: list[str]


class Publisher(Poster):
    def __init__(self, connection: redis.Redis, loop: EngineLoop) -> None:
        self.connection = connection
        self.loop = loop
        self.posts: queue.SimpleQueue[_Post | None] = queue.SimpleQueue()
        self._failing = False
        self._idle = threading.Event()
        self._idle.set()
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)

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

    def _send(self, posts: list[_Post]) -> None:
        events = [e for p in posts for e in p.events]
        ended = [rid for p in posts for rid in p.ended]
        live = [rid for rid in posts[-1].live if rid in self.loop.inflight]
        by_channel: dict[str, list[Event]] = defaultdict(list)
        for event in events:
            inflight = self.loop.inflight.get(event.request_id)
            if inflight is not None:
                inflight.record(event)
                by_channel[inflight.payload.reply_channel].append(event)
        finished = [f for f in (self.loop.inflight.pop(rid, None) for rid in dict.fromkeys(ended)) if f]
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                for channel, batch in by_channel.items():
                    pipe.publish(channel, encode_events(batch))
                for inflight in finished:
                    self._record_end(inflight, pipe)
                if live:
                    pipe.mget([cancel_key(rid) for rid in live])
                replies = pipe.execute()
        except redis.RedisError as exc:
            if not self._failing:
                logger.warning("publishing failed (Redis: %s); the API reports the outage to its clients", exc)
            self._failing = True
            return
        finally:
            for _ in finished:
                self.loop.free_slot()
        if self._failing:
            logger.info("publishing restored")
        self._failing = False
        if live:
            for request_id, flag in zip(live, replies[-1], strict=True):
                if flag is not None:
                    self.loop.cancel(request_id)

    @staticmethod
    def _record_end(inflight: InFlight, pipe: Any) -> None:
        job, execution, worker = inflight.job, inflight.execution, inflight.worker_name
        reason = inflight.outcome if inflight.outcome != "done" else ",".join(inflight.finish_reasons)
        logger.info("end request_id=%s %s", job.id, reason)
        if inflight.outcome == "error":
            ledger.fail(job, execution, inflight.error, worker, pipe)
        else:
            ledger.finish(job, execution, inflight.result(), worker, pipe)
