"""The engine thread, and the bridge from RQ jobs to it.

Each RQ worker thread (one per batch slot) runs `Runtime.run(payload)`: it hands the request to the
engine thread and waits for its end, so the job moves through RQ's registries as usual (queued →
started → finished or failed). The engine thread admits new requests between decode steps, reads the
cancel flags of its live requests in one round trip per step, and publishes each step's events
grouped by reply channel in one pipeline.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import redis

from schemas.errors import GenerationFailed, InvalidRequest
from schemas.job import Event, JobPayload, encode_events
from schemas.keys import cancel_key
from workers.engine import Engine

logger = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.5


@dataclass
class Tracked:
    """A request the engine thread is serving, and what its RQ job waits on."""

    payload: JobPayload
    future: Future[dict[str, Any]] = field(default_factory=Future)
    # Set once the request's first step has been published (or it ended): its RQ bookkeeping waits
    # for this, so that it does not compete with the prefill for the interpreter.
    first_step: threading.Event = field(default_factory=threading.Event)
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "finish_reason": self.finish_reasons[0] if len(self.finish_reasons) == 1 else self.finish_reasons,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
        }


class Runtime:
    def __init__(self, engine: Engine, connection: redis.Redis) -> None:
        self.engine = engine
        self.connection = connection
        self.inbox: queue.SimpleQueue[Tracked] = queue.SimpleQueue()
        self.tracked: dict[str, Tracked] = {}  # the engine thread's
        self._submitted: dict[str, Tracked] = {}  # the RQ threads'
        self._lock = threading.Lock()
        self._flags_due: dict[str, bool] | None = None  # engine thread: flags read with the last publish
        self._abort: str | None = None
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, payload: JobPayload) -> Tracked:
        """Hand a request to the engine thread (at most once per request id)."""
        with self._lock:
            tracked = self._submitted.get(payload.request_id)
            if tracked is not None:
                return tracked
            tracked = self._submitted[payload.request_id] = Tracked(payload)
        self.inbox.put(tracked)
        return tracked

    def submitted(self, request_id: object) -> JobPayload | None:
        """The payload of a request already handed over (parsed once, by the slot that dequeued it)."""
        with self._lock:
            tracked = self._submitted.get(request_id) if isinstance(request_id, str) else None
        return tracked.payload if tracked is not None else None

    def abandon(self, request_id: str) -> None:
        """The job ended without waiting for its request (RQ failed around it): stop the request."""
        with self._lock:
            tracked = self._submitted.pop(request_id, None)
        if tracked is not None:
            logger.warning("request_id=%s lost its RQ job; cancelling it", request_id)
            self.connection.set(cancel_key(request_id), 1, ex=60)

    def run(self, payload: JobPayload) -> dict[str, Any]:
        """Called in an RQ worker thread: serve one request to its end; the result is the job's.

        The slot worker usually submitted the request already, right after dequeueing it and before
        RQ's own bookkeeping; this then only waits for the end.
        """
        tracked = self.submit(payload)
        try:
            return tracked.future.result()
        except BaseException:
            # The job timed out or was stopped in this thread: the engine must drop the request too.
            self.connection.set(cancel_key(payload.request_id), 1, ex=60)
            raise
        finally:
            with self._lock:
                self._submitted.pop(payload.request_id, None)

    @property
    def idle(self) -> bool:
        return self.inbox.empty() and not self.tracked

    def abort_all(self, message: str) -> None:
        """From any thread: the engine thread ends every request it holds with an error, at its next turn."""
        self._abort = message

    def _loop(self) -> None:
        while True:
            try:
                if self._abort is not None:
                    message, self._abort = self._abort, None
                    self._fail_everything(message)
                self._iterate()
            except Exception as exc:  # the engine thread must outlive any fault, Redis outages included
                logger.exception("engine step failed; failing %d requests", len(self.tracked))
                self._fail_everything(f"generation failed: {type(exc).__name__}")

    def _fail_everything(self, message: str) -> None:
        events = self.engine.fail_all(message)
        failed = {e.request_id for e in events}
        error = GenerationFailed(message).envelope()["error"]
        events += [Event(rid, 0, "error", error=error) for rid in self.tracked if rid not in failed]
        try:
            self.publish(events)
        except redis.RedisError as exc:  # the API's relay reports the outage to its clients itself
            logger.warning("could not publish %d error events: %s", len(events), exc)
        finally:
            self._settle(events)

    def _iterate(self) -> None:
        arrivals = self._admit(block=not self.engine.has_work)
        try:
            if not self.engine.has_work:
                return
            # The flags were read with the last step's publish; newcomers need a fresh read before prefill.
            fresh = arrivals or self._flags_due is None
            flags = self._flags(list(self.engine.requests)) if fresh else self._flags_due
            events = self._cancel_flagged(flags)
            events += self.engine.step()
            self._flags_due = self.publish(events, read_flags=list(self.engine.requests))
            self._settle(events)
        finally:
            for tracked in arrivals:
                tracked.first_step.set()

    def _admit(self, block: bool) -> list[Tracked]:
        """Move new requests into the engine. The cancel check that follows in the same iteration
        drops those whose client already left before they are prefilled: they never run."""
        arrivals: list[Tracked] = []
        try:
            arrivals.append(self.inbox.get(timeout=IDLE_POLL_SECONDS) if block else self.inbox.get_nowait())
            while True:
                arrivals.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        self._flags_due = None if arrivals else self._flags_due
        for tracked in arrivals:
            request_id = tracked.payload.request_id
            self.tracked[request_id] = tracked
            try:
                self.engine.add_request(tracked.payload)
            except ValueError as exc:
                error = InvalidRequest(str(exc)).envelope()["error"]
                self.publish([Event(request_id, 0, "error", error=error)])
                self._settle([Event(request_id, 0, "error", error=error)])
                continue
            tracked.prompt_tokens = len(tracked.payload.prompt_token_ids)
            logger.debug("admitted request_id=%s prompt_tokens=%d", request_id, tracked.prompt_tokens)
        return arrivals

    def _flags(self, request_ids: list[str]) -> dict[str, bool]:
        pipe = self.connection.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(cancel_key(request_id))
        return dict(zip(request_ids, (bool(f) for f in pipe.execute()), strict=True))

    def _cancel_flagged(self, flags: dict[str, bool]) -> list[Event]:
        """Drop the live requests whose client has gone; return their final events."""
        events: list[Event] = []
        for request_id in list(self.engine.requests):
            if flags.get(request_id):
                logger.info("cancelled request_id=%s", request_id)
                events += self.engine.cancel(request_id)
        return events

    def _settle(self, events: list[Event]) -> None:
        """Resolve the jobs of the requests that ended in these events."""
        for event in events:
            tracked = self.tracked.get(event.request_id)
            if tracked is None or not event.final:
                continue
            if event.kind == "done":
                tracked.finish_reasons.append(event.finish_reason or "stop")
                tracked.completion_tokens += event.usage.completion_tokens if event.usage else 0
                if event.request_id in self.engine.requests:
                    continue  # other choices of this request are still running
                tracked.future.set_result(tracked.summary())
            elif event.kind == "cancelled":
                tracked.future.set_result({"finish_reason": "cancelled"})
            else:
                tracked.future.set_exception(RuntimeError((event.error or {}).get("message", "generation failed")))
            del self.tracked[event.request_id]
            logger.info("end request_id=%s %s", event.request_id, event.finish_reason or event.kind)

    def publish(self, events: list[Event], read_flags: Sequence[str] = ()) -> dict[str, bool]:
        """Publish the events, one message per reply channel, and read the cancel flags of
        `read_flags` in the same round trip."""
        by_channel: dict[str, list[Event]] = defaultdict(list)
        for event in events:
            tracked = self.tracked.get(event.request_id)
            if tracked is not None:
                by_channel[tracked.payload.reply_channel].append(event)
        pipe = self.connection.pipeline(transaction=False)
        for channel, batch in by_channel.items():
            pipe.publish(channel, encode_events(batch))
        for request_id in read_flags:
            pipe.exists(cancel_key(request_id))
        if not by_channel and not read_flags:
            return {}
        replies = pipe.execute()[len(by_channel) :]
        return dict(zip(read_flags, (bool(r) for r in replies), strict=True))
