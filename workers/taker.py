"""The engine thread's dequeue: RQ jobs taken off a model's queue as RQ's own dequeue takes them.

RQ's worker moves a job id from the queue's list to the queue's intermediate list (BLMOVE) and then
reads the job. The engine thread does the same move itself, on a connection of its own, and reads
only what it needs (the job's `data` field, RQ's compressed and serialized call, and the request's
cancel flag), with any further jobs already queued, in one round trip (a Lua script). The job's RQ
bookkeeping (queued → started → finished or failed) stays with a slot thread of the queue process,
to which the engine hands each job once the request's first step is out (workers/runtime.py). A lone
request's first token thus waits for no other process (README "Benchmark" has the figures).

The RQ internals relied on (the intermediate list's key, the `data` field's encoding) are covered by
tests/test_taker.py, with jobs enqueued by RQ itself.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import cancel_key

logger = logging.getLogger(__name__)

# A blocked BLMOVE returns empty after this long; a drain waits at most this long for it to answer.
BLOCK_SECONDS = 1
# After a Redis error, the taker waits this long before it takes again (the running requests go on).
RETRY_SECONDS = 1.0
# One round trip for the jobs already moved (ARGV[4...]) and up to ARGV[3] more still queued, moved as
# RQ's dequeue moves them (KEYS: the queue, its intermediate list): each job's id, RQ `data` field and
# cancel flag (ARGV[1], ARGV[2]: the key prefixes). The job and flag keys are named from the ids, as
# RQ's own Lua does; RQ needs a single Redis, not a cluster.
TAKE_MORE = """
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
for _ = 1, tonumber(ARGV[3]) do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  ids[#ids + 1] = id
end
local out = {}
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', ARGV[1] .. id, 'data')
  out[#out + 1] = redis.call('GET', ARGV[2] .. id)
end
return out
"""


@dataclass(frozen=True)
class Taken:
    """A job taken off the queue: its payload to serve, or why it cannot be served (its slot fails it)."""

    job_id: str
    payload: JobPayload | None = None
    refused: str | None = None
    cancelled: bool = False  # the client left before the job was taken


def read_call(data: bytes | None) -> tuple[str, list[Any]]:
    """The function name and positional arguments of a job's `data` field, as RQ's Job decodes it."""
    if data is None:
        raise ValueError("the job has no data (it expired or was deleted)")
    func_name, _instance, args, _kwargs = JSONSerializer.loads(zlib.decompress(data))
    return func_name, list(args or ())


def judge(job_id: str, data: bytes | None, flag: Any) -> Taken:
    """What the engine does with a job: serve its request, or hand it to its slot to fail with a reason."""
    try:
        func_name, args = read_call(data)
    except (ValueError, TypeError, zlib.error) as exc:
        return Taken(job_id, refused=f"unreadable job: {exc}")
    if func_name != JOB_FUNCTION:
        return Taken(job_id, refused=f"job function {func_name!r} is not served by this worker")
    try:
        payload = JobPayload.from_dict(args[0] if args else None)
    except ValueError as exc:
        return Taken(job_id, refused=str(exc))
    if payload.request_id != job_id:
        return Taken(job_id, refused="invalid job payload: request_id is not the job's id")
    return Taken(job_id, payload, cancelled=flag is not None)


class Taker:
    """Takes jobs off one RQ queue for the engine thread, which alone calls it.

    While the engine has room, one BLMOVE waits on the queue (`listen`); the engine thread waits on
    this object's socket beside its link and, once it is readable, calls `take`. A Redis error is
    logged and the taker pauses for RETRY_SECONDS: the requests already running are not its concern.
    """

    def __init__(self, connection: redis.Redis, queue_name: str, name: str | None = None) -> None:
        queue = Queue(queue_name, connection=connection, serializer=JSONSerializer)
        self.name = name  # the connection's client name (CLIENT LIST), if any
        self.queue_key = queue.key
        self.intermediate_key = queue.intermediate_queue_key
        self.pool = connection.connection_pool
        self.connection: redis.Connection | None = None
        self.blocked = False  # a BLMOVE has been sent and not answered
        self.reading: str | None = None  # the job whose read `prefetch` sent, not yet collected
        self.paused_until = 0.0
        self.failing = False  # the last attempt failed

    def fileno(self) -> int:
        return self.connection._sock.fileno()  # type: ignore[union-attr]

    def listen(self) -> bool:
        """Have a BLMOVE waiting on the queue (or the read of a job it took under way: the connection
        answers in order, so nothing else is sent before that read is collected); False while paused
        after an error."""
        if self.blocked or self.reading is not None:
            return True
        if time.monotonic() < self.paused_until:
            return False
        try:
            connection = self._connection()
            connection.send_command("BLMOVE", self.queue_key, self.intermediate_key, "LEFT", "RIGHT", BLOCK_SECONDS)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return False
        self.blocked = True
        return True

    def ready(self) -> bool:
        """Something to take: the BLMOVE has answered (a job, or empty after BLOCK_SECONDS), or the read
        of a job it took is under way (`prefetch`)."""
        if self.reading is not None:
            return True
        try:
            return self.blocked and bool(self.connection.can_read(timeout=0))  # type: ignore[union-attr]
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return False

    def prefetch(self, room: int) -> None:
        """If the BLMOVE has taken a job, send the read of its payload without waiting for the answer
        (called as a busy engine's step ends: the answer comes while it publishes the step, and `take`
        at the next step finds it there, instead of waiting a round trip while the other core is busy)."""
        if self.reading is not None or not self.ready():
            return
        try:
            first = self._answer()
            if first is None:  # the BLMOVE's time ran out
                self.listen()
                return
            self._request([first], room - 1)
            self.reading = first
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)

    def take(self, room: int) -> list[Taken]:
        """After `ready`: the job the BLMOVE moved, if any, and up to `room` - 1 more already queued.
        If room is left, the next BLMOVE goes out at once: its answer comes while the engine works."""
        try:
            if self.reading is not None:
                self.reading = None
                taken = self._collect()
            else:
                first = self._answer()
                taken = self._read([first], room - 1) if first is not None else []
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return []
        if len(taken) < room:
            self.listen()
        return taken

    def take_now(self, room: int) -> list[Taken]:
        """Up to `room` jobs already queued, without waiting (a burst worker's dequeue)."""
        try:
            return self._read([], room)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return []

    def stop(self) -> bool:
        """Stop listening, from the engine thread: the jobs the BLMOVE (and a prefetch's read) took, if
        any, go back to the front of the queue, in their order. False while the BLMOVE has not answered
        yet (call again)."""
        if not self.blocked and self.reading is None:
            return True
        if not self.ready():
            return not self.blocked  # an error ended the wait
        try:
            if self.reading is not None:
                self.reading = None
                ids = [taken.job_id for taken in self._collect()]
            else:
                first = self._answer()
                ids = [first] if first is not None else []
            for job_id in reversed(ids):
                self.put_back(job_id)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
        return True

    def put_back(self, job_id: str) -> None:
        """Undo a take: the job leaves the intermediate list for the front of the queue."""
        connection = self._connection()
        commands = [
            ("MULTI",),
            ("LREM", self.intermediate_key, 1, job_id),
            ("LPUSH", self.queue_key, job_id),
            ("EXEC",),
        ]
        connection.send_packed_command(connection.pack_commands(commands))
        for _ in commands:
            connection.read_response()
        logger.info("job %s goes back to the front of its queue", job_id)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.disconnect()
        self.connection, self.blocked, self.reading = None, False, None

    def _answer(self) -> str | None:
        self.blocked = False
        job_id = self.connection.read_response()  # type: ignore[union-attr]
        return job_id.decode() if isinstance(job_id, bytes) else None

    def _read(self, ids: list[str], more: int) -> list[Taken]:
        """The jobs `ids` (already moved) and up to `more` others still queued, moved now: one round trip."""
        self._request(ids, more)
        return self._collect()

    def _request(self, ids: list[str], more: int) -> None:
        """Send `_read`'s script (TAKE_MORE)."""
        connection = self._connection()
        args = (Job.redis_job_namespace_prefix, cancel_key(""), max(more, 0), *ids)
        connection.send_command("EVAL", TAKE_MORE, 2, self.queue_key, self.intermediate_key, *args)

    def _collect(self) -> list[Taken]:
        """The answer to `_request`: each job's id, data and cancel flag, judged."""
        reply = self.connection.read_response()  # type: ignore[union-attr]
        triples = [reply[i : i + 3] for i in range(0, len(reply), 3)]
        return [judge(job_id.decode(), data, flag) for job_id, data, flag in triples]

    def _connection(self) -> redis.Connection:
        if self.connection is None:
            connection = self.pool.make_connection()
            connection.connect()
            self.connection = connection  # type: ignore[assignment]
            if self.failing:
                logger.info("taking jobs again")
                self.failing = False
            if self.name:
                connection.send_command("CLIENT", "SETNAME", self.name)
                connection.read_response()
        return self.connection  # type: ignore[return-value]

    def _failed(self, exc: BaseException) -> None:
        # Said once per outage, not at every retry.
        logger.log(logging.DEBUG if self.failing else logging.WARNING, "taking jobs failed (%s); retrying", exc)
        self.failing = True
        self.close()
        self.paused_until = time.monotonic() + RETRY_SECONDS
