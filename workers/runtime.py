"""The engine thread of a worker's engine process.

The engine thread takes its model's RQ jobs off the queue itself (workers/taker.py), admits their
requests between decode steps, publishes each step's events grouped by reply channel with a read of
its live requests' cancel flags in the same batch of commands (whose replies, the flags among them, it
reads just before the next step), and hands each job over the link to the queue process (workers/link.py)
once its request's first step is out, so that a slot thread there keeps the job's RQ bookkeeping; it
tells the queue process when the request ended: the end becomes the result (or the failure) of the job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import redis

from schemas.errors import GenerationFailed, InvalidRequest
from schemas.job import Event, JobPayload, encode_events
from schemas.keys import cancel_key
from workers import link
from workers.engine import Engine
from workers.taker import Taken, Taker

logger = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.5
# The end of a cancelled request (its RQ job's result) is told to the queue process this long after
# the engine dropped it: the RQ bookkeeping of a job (~3 ms of the queue process's CPU) for clients that
# have left then yields to the requests running, or arriving, meanwhile. While others ran, this took a
# short request after 16 hang-ups from 1.60-1.67 times as long as on an idle server to 1.24-1.31;
# holding the ends back also once the engine is idle (16 hang-ups leave it so), from 1.18-1.22 to
# 1.08-1.09, side by side (README "Benchmark"). A cancellation is told at once when it would leave no
# RQ slot free.
CANCELLED_END_DELAY_SECONDS = 1.0
# The end of a finished request is held back too, for less: a client that got its answer sends its next
# request at once, and the bookkeeping of the job just ended then ran beside that request's hand-over and
# prefill on a machine with few cores. Held back, it runs beside later decode steps. In 12 rounds
# alternating between two stacks (bench/sidebyside.py), a lone request's first token came in 8.61 ms
# against 8.91 (sooner in 11 of 12), at 4 clients in 18.6 ms against 24.5 (10 of 12); 16 clients
# unchanged (README "Benchmark").
FINISHED_END_DELAY_SECONDS = 0.2
# An outbox connection unused for this long is checked before use: Redis (or a proxy) may have closed it.
OUTBOX_IDLE_CHECK_SECONDS = 1.0


@dataclass
class Tracked:
    """A request the engine thread is serving."""

    payload: JobPayload
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


class Outbox:
    """Commands sent over a connection of its own, whose replies are read later.

    A step's events go out at once and the engine thread moves on; Redis answers while it does, and
    the replies are read when they are needed, by which time they have come. A request's events keep
    their order: every publish goes over this one connection. After a Redis error the connection
    starts afresh, and the replies still owed are lost with it; a connection that was closed while
    nothing was owed on it is replaced before it is used (as redis-py's pool does).
    """

    def __init__(self, pool: redis.ConnectionPool, idle_check: float = OUTBOX_IDLE_CHECK_SECONDS) -> None:
        self.pool = pool
        self.idle_check = idle_check
        self.connection: redis.Connection | None = None
        self.owed = 0  # replies not yet read
        self.used = 0.0  # time.monotonic() of the last send

    def send(self, commands: list[tuple[Any, ...]]) -> None:
        if self.connection is not None and not self.owed and time.monotonic() - self.used >= self.idle_check:
            self._drop_if_closed()
        if self.connection is None:
            self.connection = self.pool.make_connection()  # type: ignore[assignment]
        self.used = time.monotonic()
        try:
            self.connection.send_packed_command(self.connection.pack_commands(commands))  # type: ignore[union-attr]
        except BaseException:
            self.reset()
            raise
        self.owed += len(commands)

    def replies(self) -> list[Any]:
        """The replies owed, in order; waits for those not yet come."""
        replies = []
        try:
            while self.owed:
                replies.append(self.connection.read_response())  # type: ignore[union-attr]
                self.owed -= 1
        except BaseException:
            self.reset()
            raise
        return replies

    def _drop_if_closed(self) -> None:
        """Nothing is owed, so anything readable is the server's close (or junk): start afresh."""
        try:
            readable = self.connection.can_read(timeout=0)  # type: ignore[union-attr]
        except (redis.ConnectionError, OSError):
            readable = True
        if readable:
            self.reset()

    def reset(self) -> None:
        if self.connection is not None:
            self.connection.disconnect()
        self.connection, self.owed = None, 0


class Runtime:
    def __init__(
        self, engine: Engine, connection: redis.Redis, queue_link: Connection, taker: Taker, burst: bool = False
    ) -> None:
        self.engine = engine
        self.connection = connection
        self.link = queue_link
        self.taker = taker
        self.burst = burst  # take what is queued, then drain
        self._unannounced: set[str] = set()  # jobs taken whose slot has not been told yet
        self._drain_asked = False
        self.drained = False  # the queue process has been told to drain: nothing more is taken
        self.tracked: dict[str, Tracked] = {}
        self.link_closed = threading.Event()  # the queue process has gone
        self._send_lock = threading.Lock()  # the engine thread reports ends; the main thread, a drain
        self.outbox = Outbox(connection.connection_pool)
        self._flags_read: list[str] = []  # the requests whose flags the outbox's last reply holds
        self._abort: str | None = None
        self._later: list[tuple[str, dict[str, Any], float]] = []  # ends held back, with their deadlines
        self.aborted = threading.Event()  # set once an abort_all has been carried out
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def drain(self) -> None:
        """From any thread: take no new jobs; the engine thread then tells the queue process to exit once
        its jobs have ended (after every take, so that each job the engine took has its slot)."""
        self._drain_asked = True

    def _drain_if_asked(self) -> None:
        if self.drained or not self._drain_asked or not self.taker.stop():
            return  # a BLMOVE still waiting may yet take a job, which goes back to the queue
        self.taker.close()
        self.drained = True
        self._send({"op": "drain"})

    def abort_all(self, message: str) -> None:
        """From any thread: the engine thread ends every request it holds with an error, at its next turn."""
        self._abort = message

    def _loop(self) -> None:
        while True:
            try:
                if self._abort is not None:
                    message, self._abort = self._abort, None
                    self._fail_everything(message)
                    self.aborted.set()
                self._iterate()
            except Exception as exc:  # the engine thread must outlive any fault, Redis outages included
                logger.exception("engine step failed; failing %d requests", len(self.tracked))
                self._fail_everything(f"generation failed: {type(exc).__name__}")

    def _fail_everything(self, message: str) -> None:
        self._send_later_ends(force=True)
        for request_id in [rid for rid in self._unannounced if rid not in self.tracked]:
            self._announce(request_id, message)  # taken, but the fault came before it was served
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
        self._send_later_ends()
        flags = self._replies()  # to the last step's publish: its cancel flags
        self._drain_if_asked()
        arrivals = self._admit(wait=0 if self.engine.has_work else self._idle_wait())
        if not self.engine.has_work:
            return
        if flags is None:  # no step's read to go by: the requests already running need a fresh one
            running = [rid for rid in self.engine.requests if rid not in arrivals]
            flags = self._flags(running) if running else {}
        flags.update(arrivals)  # the newcomers' flags came with their jobs
        events = self._cancel_flagged(flags)
        events += self.engine.admit()
        if events:  # the newcomers' first tokens go out before the decode (or with it, after a mixed pass)
            self._post(events, read_flags=())
            self._settle(events)
        events = self.engine.decode()
        if self._taking:
            self.taker.prefetch(self.room)  # a job taken meanwhile is read while the step is published
        self._post(events, read_flags=list(self.engine.requests))
        self._settle(events)
        for request_id in arrivals:
            self._announce(request_id)

    def _idle_wait(self) -> float:
        """How long an idle engine waits for a request: until the next held-back end is due, at most
        IDLE_POLL_SECONDS."""
        if not self._later:
            return IDLE_POLL_SECONDS
        return min(IDLE_POLL_SECONDS, max(0.0, min(due for _, _, due in self._later) - time.monotonic()))

    def _admit(self, wait: float) -> dict[str, bool]:
        """Take the jobs queued for this worker, as many as it has free slots, waiting up to `wait`
        seconds for the first; their requests join the engine. Returns each newcomer's cancel flag,
        read with its job: the cancel check that follows in the same iteration drops those whose client
        left after the take (one that left while its job was queued took it off the queue,
        app/dispatch.py) before they are prefilled: they never run."""
        arrivals: dict[str, bool] = {}
        for taken in self._take(wait):
            request_id, payload = taken.job_id, taken.payload
            if request_id in self.tracked or request_id in self._unannounced:
                logger.warning("job %s taken twice; served once", request_id)  # its slot has it already
                continue
            self._unannounced.add(request_id)
            if payload is None:  # its slot fails the job with the reason
                logger.warning("refused job %s: %s", request_id, taken.refused)
                self._announce(request_id, taken.refused)
                continue
            self.tracked[request_id] = Tracked(payload)
            try:
                self.engine.add_request(payload)
            except ValueError as exc:
                error = InvalidRequest(str(exc)).envelope()["error"]
                self.publish([Event(request_id, 0, "error", error=error)])
                self._settle([Event(request_id, 0, "error", error=error)])
                continue
            self.tracked[request_id].prompt_tokens = len(payload.prompt_token_ids)
            arrivals[request_id] = taken.cancelled
            logger.debug("admitted request_id=%s prompt_tokens=%d", request_id, len(payload.prompt_token_ids))
        return arrivals

    @property
    def _taking(self) -> bool:
        return self.room > 0 and not (self.drained or self._drain_asked or self.link_closed.is_set())

    @property
    def room(self) -> int:
        """Free RQ slots: each request tracked, and each whose end is held back, holds one."""
        return self.engine.max_batch_size - len(self.tracked) - len(self._later)

    def _take(self, timeout: float) -> list[Taken]:
        """The jobs taken off the queue, waiting up to `timeout` for the first; meanwhile the link is
        watched for the queue process's exit."""
        if self.link_closed.is_set():
            time.sleep(timeout)  # nothing more will be served; the main thread is stopping the process
            return []
        if not self._taking:
            self._watch_link(timeout)
            return []
        if self.burst:
            taken = self.taker.take_now(self.room)
            if not taken and not self.tracked:
                self._drain_asked = True  # the queue is empty and no request is left: the worker exits
            return taken
        self.taker.listen()
        if not self.taker.ready():
            # Not blocked (any more): paused after a Redis error; then only the link is watched.
            ready = wait([self.link, self.taker] if self.taker.blocked else [self.link], timeout)
            if self.link in ready:
                self._watch_link(0)
            if self.taker not in ready:
                return []
        return self.taker.take(self.room)

    def _watch_link(self, timeout: float) -> None:
        """Wait up to `timeout` on the link, which only closes (the queue process has gone)."""
        try:
            if self.link.poll(timeout):
                link.receive(self.link)
        except (EOFError, OSError, ValueError):
            logger.info("the queue process closed the link")
            self.link_closed.set()

    def _flags(self, request_ids: list[str]) -> dict[str, bool]:
        return self.publish([], read_flags=request_ids)

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
                end: dict[str, Any] = {"result": tracked.summary()}
                if self._hold_back(event.request_id, end, FINISHED_END_DELAY_SECONDS):
                    continue
            elif event.kind == "cancelled":
                end = {"result": {"finish_reason": "cancelled"}}
                if self._hold_back(event.request_id, end, CANCELLED_END_DELAY_SECONDS):
                    continue
            else:
                end = {"error": (event.error or {}).get("message", "generation failed")}
            del self.tracked[event.request_id]
            logger.info("end request_id=%s %s", event.request_id, event.finish_reason or event.kind)
            self._send_end(event.request_id, end)

    def _hold_back(self, request_id: str, end: dict[str, Any], delay: float) -> bool:
        """Keep a request's end for `delay` seconds if an RQ slot stays free beside it; the engine is
        done with the request either way."""
        in_slots = len(self.tracked) + len(self._later)  # this request is still among the tracked
        if in_slots >= self.engine.max_batch_size:
            return False
        del self.tracked[request_id]
        logger.info(
            "end request_id=%s %s (told to the queue process later)", request_id, end["result"]["finish_reason"]
        )
        self._later.append((request_id, end, time.monotonic() + delay))
        return True

    def _send_later_ends(self, force: bool = False) -> None:
        """Tell the ends held back that are due; all of them when the slots run short."""
        if not self._later:
            return
        if force or len(self.tracked) + len(self._later) >= self.engine.max_batch_size:
            due, self._later = self._later, []
        else:
            now = time.monotonic()
            due = [held for held in self._later if held[2] <= now]
            self._later = [held for held in self._later if held[2] > now]
        for request_id, end, _ in due:
            self._send_end(request_id, end)

    def _send_end(self, request_id: str, end: dict[str, Any]) -> None:
        self._announce(request_id)
        self._send({"op": "end", "id": request_id, **end})

    def _announce(self, request_id: str, refused: str | None = None) -> None:
        """Hand a job taken to the queue process, whose slot then keeps its RQ bookkeeping: once the
        request's first step is out (that work would slow the prefill down on a machine with few cores),
        before its end, or at once if it is refused (its slot fails it with the reason)."""
        if request_id not in self._unannounced:
            return
        self._unannounced.discard(request_id)
        self._send({"op": "take", "id": request_id, **({"refused": refused} if refused else {})})

    def _send(self, message: dict[str, Any]) -> None:
        if self.link_closed.is_set():
            return
        try:
            with self._send_lock:
                link.send(self.link, message)
        except OSError as exc:
            logger.warning("the queue process is unreachable (%s); %s not sent", exc, message["op"])
            self.link_closed.set()

    def publish(self, events: list[Event], read_flags: Sequence[str] = ()) -> dict[str, bool]:
        """Publish the events, one message per reply channel, and read the cancel flags of
        `read_flags` (one MGET) in the same round trip."""
        self._post(events, read_flags)
        return self._replies() or {}

    def _post(self, events: list[Event], read_flags: Sequence[str]) -> None:
        """Send the events and the flags' read without waiting for Redis' replies (see `_replies`)."""
        by_channel: dict[str, list[Event]] = defaultdict(list)
        for event in events:
            tracked = self.tracked.get(event.request_id)
            if tracked is not None:
                by_channel[tracked.payload.reply_channel].append(event)
        commands: list[tuple[Any, ...]] = [("PUBLISH", ch, encode_events(batch)) for ch, batch in by_channel.items()]
        if read_flags:
            commands.append(("MGET", *(cancel_key(request_id) for request_id in read_flags)))
        if commands:
            self._flags_read = list(read_flags)
            self.outbox.send(commands)

    def _replies(self) -> dict[str, bool] | None:
        """Read the replies owed to the last `_post`; the cancel flags it read, if it read any."""
        owed = self.outbox.owed
        replies = self.outbox.replies()
        if not owed or not self._flags_read:
            return None
        read, self._flags_read = self._flags_read, []
        return dict(zip(read, (f is not None for f in replies[-1]), strict=True))
