"""The link between a worker's two processes: the engine process and its queue process.

`python -m workers` (the engine process) holds the device, the model and the engine thread; it starts
`python -m workers.slots` (the queue process), whose RQ slot threads take jobs off the model's queue
and keep RQ's bookkeeping. The two talk over a socket pair, one JSON object per message:

    queue → engine   {"op": "submit", "payload": {...}}          serve this request (a payload it validated)
    engine → queue   {"op": "started", "id": ...}                its first step has been published
                     {"op": "end", "id": ..., "result": {...}}   it ended; the job's result
                     {"op": "end", "id": ..., "error": "..."}    it failed; the job fails with this
                     {"op": "drain"}                             take no new jobs; finish and exit

RQ's bookkeeping of a job (Python work and a few dozen Redis commands) thus runs in an interpreter
of its own, on another core, instead of taking turns with the engine thread's decode steps; a slot
starts it once its request's first step is out, so that it does not compete with the prefill. Each
process watches the other: the engine process stops when the queue process exits, and the queue
process exits at once when the engine process dies (the API then fails its requests as lost).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import redis

from schemas.job import JobPayload
from schemas.keys import CANCEL_TTL_SECONDS, cancel_key

logger = logging.getLogger(__name__)


def socket_pair() -> tuple[Connection, socket.socket]:
    """The engine's end as a Connection, and the socket to hand to the queue process."""
    ours, theirs = socket.socketpair()
    return Connection(ours.detach()), theirs


def connect(fd: int) -> Connection:
    return Connection(fd)


def send(connection: Connection, message: dict[str, Any]) -> None:
    connection.send_bytes(json.dumps(message, separators=(",", ":")).encode())


def receive(connection: Connection) -> dict[str, Any]:
    """The next message; EOFError when the other process has gone."""
    message = json.loads(connection.recv_bytes())
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError(f"malformed link message: {message!r}")
    return message


class EngineGone(Exception):
    """The engine process closed the link before answering."""


@dataclass
class Pending:
    """A request handed to the engine, as its slot and its job function see it."""

    payload: JobPayload
    future: Future[dict[str, Any]] = field(default_factory=Future)
    started: threading.Event = field(default_factory=threading.Event)  # its first step is out, or it ended


class EngineClient:
    """The queue process's side: hands requests to the engine process and waits for their end.

    `submit` is called by a slot thread right after it dequeues a job (before RQ's bookkeeping), and
    `run` by the job function; both name the same request, which is sent to the engine once. A reader
    thread resolves each request's future when its end arrives, sets `draining` when told to drain,
    and calls `on_closed` when the engine process has gone (by default: fail the waiting jobs).
    """

    def __init__(
        self, connection: Connection, redis_connection: redis.Redis, on_closed: Callable[[], None] | None = None
    ) -> None:
        self.connection = connection
        self.on_closed = on_closed or self.fail_pending
        self.redis = redis_connection
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[str, Pending] = {}
        self.draining = threading.Event()
        self.closed = threading.Event()  # the engine process has gone
        self.reader = threading.Thread(target=self._read, name="link", daemon=True)

    def start(self) -> None:
        self.reader.start()

    def submit(self, payload: JobPayload) -> Pending:
        """Hand a request to the engine (at most once per request id); its future holds the job's result."""
        with self._lock:
            pending = self._pending.get(payload.request_id)
            if pending is not None:
                return pending
            pending = self._pending[payload.request_id] = Pending(payload)
        if self.closed.is_set():
            self._resolve(pending, EngineGone("the engine process has stopped"))
            return pending
        with self._send_lock:
            send(self.connection, {"op": "submit", "payload": payload.to_dict()})
        return pending

    @property
    def pending(self) -> int:
        """The requests handed over whose jobs have not yet taken their end."""
        with self._lock:
            return len(self._pending)

    def submitted(self, request_id: object) -> JobPayload | None:
        """The payload of a request already handed over (parsed once, by the slot that dequeued it)."""
        with self._lock:
            pending = self._pending.get(request_id) if isinstance(request_id, str) else None
        return pending.payload if pending is not None else None

    def run(self, payload: JobPayload) -> dict[str, Any]:
        """Called by the job function in a slot thread: serve one request to its end; the result is the job's."""
        pending = self.submit(payload)
        try:
            return pending.future.result()
        except BaseException:
            # The job timed out or was stopped in this thread: the engine must drop the request too.
            self.cancel(payload.request_id)
            raise
        finally:
            with self._lock:
                self._pending.pop(payload.request_id, None)

    def abandon(self, request_id: str) -> None:
        """The job ended without waiting for its request (RQ failed around it): stop the request."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is not None and not pending.future.done():
            logger.warning("request_id=%s lost its RQ job; cancelling it", request_id)
            self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        self.redis.set(cancel_key(request_id), 1, ex=CANCEL_TTL_SECONDS)

    def _read(self) -> None:
        try:
            while True:
                message = receive(self.connection)
                if message["op"] == "started":
                    self._started(message)
                elif message["op"] == "end":
                    self._end(message)
                elif message["op"] == "drain":
                    self.draining.set()
        except (EOFError, OSError, ValueError) as exc:
            logger.log(logging.DEBUG if self.draining.is_set() else logging.ERROR, "engine link closed: %r", exc)
        finally:
            self.closed.set()
            self.on_closed()

    def fail_pending(self) -> None:
        """Fail the jobs still waiting: the engine will not answer them."""
        with self._lock:
            waiting = list(self._pending.values())
        for pending in waiting:
            self._resolve(pending, EngineGone("the engine process stopped before this request ended"))

    def _started(self, message: dict[str, Any]) -> None:
        with self._lock:
            pending = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if pending is not None:
            pending.started.set()

    def _end(self, message: dict[str, Any]) -> None:
        with self._lock:
            pending = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if pending is not None:
            self._resolve(pending, RuntimeError(message["error"]) if "error" in message else message.get("result"))

    @staticmethod
    def _resolve(pending: Pending, outcome: Exception | dict[str, Any] | None) -> None:
        if not pending.future.done():
            if isinstance(outcome, Exception):
                pending.future.set_exception(outcome)
            else:
                pending.future.set_result(outcome or {})
        pending.started.set()
