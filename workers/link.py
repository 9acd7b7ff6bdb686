"""The link between a worker's two processes: the engine process and its queue process.

`python -m workers` (the engine process) holds the device, the model and the engine thread, which
takes the model's RQ jobs off the queue itself (workers/taker.py); it starts `python -m workers.slots`
(the queue process), whose RQ slot threads perform those jobs in RQ and keep their bookkeeping. The
engine process tells it, over a socket pair, one JSON object per message:

    {"op": "take", "id": ...}                      a slot performs this job (it was taken off the queue)
    {"op": "take", "id": ..., "refused": "..."}    ... and fails it with this reason: it is not served
    {"op": "end", "id": ..., "result": {...}}      its request ended; the job's result
    {"op": "end", "id": ..., "error": "..."}       it failed; the job fails with this
    {"op": "drain"}                                nothing more will be taken: finish and exit

A job's take comes before its end. RQ's bookkeeping of a job (Python work and a few dozen Redis
commands) thus runs in an interpreter of its own, on another core, instead of taking turns with the
engine thread's decode steps, and it starts once the request's first step is out (the engine hands
the job over then), so that it does not compete with the prefill. The queue process sends nothing;
each process watches the other: the engine process stops when the queue process exits, and the queue
process exits at once when the engine process dies (the API then fails its requests as lost).
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import redis

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
    """A job the engine took, as its slot and its job function see it."""

    refused: str | None = None  # the engine does not serve it: the job fails with this
    future: Future[dict[str, Any]] = field(default_factory=Future)


class EngineClient:
    """The queue process's side: the jobs the engine took, for the slots to perform, and their ends.

    A reader thread records each job taken and queues its id for the next idle slot (`next_taken`),
    resolves a job's future when its end arrives, sets `draining` when told to drain, and calls
    `on_closed` when the engine process has gone (by default: fail the waiting jobs).
    """

    def __init__(
        self, connection: Connection, redis_connection: redis.Redis, on_closed: Callable[[], None] | None = None
    ) -> None:
        self.connection = connection
        self.on_closed = on_closed or self.fail_pending
        self.redis = redis_connection
        self._lock = threading.Lock()
        self._pending: dict[str, Pending] = {}
        self._taken: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.draining = threading.Event()
        self.closed = threading.Event()  # the engine process has gone
        self.reader = threading.Thread(target=self._read, name="link", daemon=True)

    def start(self) -> None:
        self.reader.start()

    def next_taken(self, timeout: float | None) -> str | None:
        """The id of the next job taken and not yet performed, waiting up to `timeout` (None: do not wait)."""
        try:
            return self._taken.get(timeout=timeout) if timeout else self._taken.get_nowait()
        except queue.Empty:
            return None

    @property
    def has_taken(self) -> bool:
        """Some job taken waits for a slot."""
        return not self._taken.empty()

    @property
    def pending(self) -> int:
        """The jobs taken that have not yet ended in their slots."""
        with self._lock:
            return len(self._pending)

    def run(self, job_id: str) -> dict[str, Any]:
        """Called by the job function in a slot thread: wait for the request's end; the result is the job's."""
        with self._lock:
            pending = self._pending.get(job_id)
        if pending is None:
            raise RuntimeError(f"job {job_id} was not taken by this worker's engine")
        if pending.refused is not None:
            self._forget(job_id)
            raise ValueError(pending.refused)
        try:
            return pending.future.result()
        except BaseException:
            # The job timed out or was stopped in this thread: the engine must drop the request too.
            self.cancel(job_id)
            raise
        finally:
            self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self._pending.pop(job_id, None)

    def abandon(self, job_id: str) -> None:
        """The job ended without waiting for its request (RQ failed around it): stop the request."""
        with self._lock:
            pending = self._pending.pop(job_id, None)
        if pending is not None and pending.refused is None and not pending.future.done():
            logger.warning("request_id=%s lost its RQ job; cancelling it", job_id)
            self.cancel(job_id)

    def cancel(self, request_id: str) -> None:
        self.redis.set(cancel_key(request_id), 1, ex=CANCEL_TTL_SECONDS)

    def _read(self) -> None:
        try:
            while True:
                message = receive(self.connection)
                if message["op"] == "take":
                    self._took(message)
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

    def _took(self, message: dict[str, Any]) -> None:
        job_id = message.get("id")
        if not isinstance(job_id, str):
            raise ValueError(f"malformed take: {message!r}")
        with self._lock:
            self._pending[job_id] = Pending(refused=message.get("refused"))
        self._taken.put(job_id)

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
