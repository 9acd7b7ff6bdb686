"""Admission control and worker liveness, both decided in Redis so every API process agrees.

A model's queued plus running requests are counted against `maxLinkNum` in one script (MindIE's cap
on open links, per model here): over the cap the request gets 429 at once, and a model whose live set
(workers/ops/heartbeat.py) has no fresh member gets 503 at once instead of queueing. The request's RQ
job is enqueued only once admitted (app/dispatch.py). Each admitted request holds a place scored by
when its hold expires (queueTimeout + e2eTimeout), so places that an API process never gave back (it
was killed) free themselves.
"""

from __future__ import annotations

import logging
import threading

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from schemas.config import Settings
from schemas.errors import NoWorker, Overloaded
from schemas.keys import (
    WORKER_HEARTBEAT_TTL,
    admitted_key,
    live_workers_key,
    worker_heartbeat_key,
    worker_process,
)

logger = logging.getLogger(__name__)

# KEYS[1] admitted set, KEYS[2] live workers; ARGV[1] cap, ARGV[2] hold ms, ARGV[3] heartbeat
# freshness ms, ARGV[4...] the request ids, admitted all together or none. 1: admitted; 0: over the
# cap; -1: no live worker.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('ZCOUNT', KEYS[2], now - tonumber(ARGV[3]), '+inf') == 0 then return -1 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) + #ARGV - 3 > tonumber(ARGV[1]) then return 0 end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class Admission:
    def __init__(self, connection: redis.Redis, settings: Settings) -> None:
        self.connection = connection
        self.cap = settings.max_link_num
        self.hold_ms = int((settings.queue_timeout + settings.e2e_timeout) * 1000)
        self._admit = connection.register_script(ADMIT)
        # Places whose release could not reach Redis, by model: given back when it answers again
        # (`release_deferred`), not held for queueTimeout + e2eTimeout (the model answered 429 meanwhile).
        self._unreleased: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def admit(self, model: str, *request_ids: str) -> None:
        """Take a place for each request, all or none, or raise Overloaded (429) / NoWorker (503)."""
        keys = [admitted_key(model), live_workers_key(model)]
        verdict = self._admit(keys, [self.cap, self.hold_ms, WORKER_HEARTBEAT_TTL * 1000, *request_ids])
        if verdict == -1:
            raise NoWorker(f"No worker is serving model '{model}' right now; try again shortly.")
        if verdict == 0:
            logger.info("over capacity model=%s cap=%d request_id=%s", model, self.cap, ",".join(request_ids))
            raise Overloaded(
                f"Model '{model}' has {self.cap} requests queued or running (maxLinkNum); try again shortly."
            )

    def release(self, model: str, *request_ids: str, defer: bool = False) -> None:
        """Give the requests' places back; where Redis is away (or known to be: `defer`), once it
        answers again."""
        if not request_ids:
            return
        if not defer:
            try:
                self.connection.zrem(admitted_key(model), *request_ids)
                return
            except redis.RedisError as exc:
                logger.debug("could not release the place of request_id=%s: %s", ",".join(request_ids), exc)
        with self._lock:
            self._unreleased.setdefault(model, set()).update(request_ids)

    def release_deferred(self) -> None:
        """Give back the places whose release failed while Redis was away (the relay calls this each
        time Redis answers it)."""
        if not self._unreleased:
            return
        with self._lock:
            pending, self._unreleased = self._unreleased, {}
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                for model, ids in pending.items():
                    pipe.zrem(admitted_key(model), *ids)
                pipe.execute()
        except redis.RedisError:
            with self._lock:
                for model, ids in pending.items():
                    self._unreleased.setdefault(model, set()).update(ids)
            return
        logger.info("gave back %d places held while Redis was away", sum(map(len, pending.values())))

    def live_workers(self, models: list[str]) -> dict[str, int]:
        return live_worker_counts(self.connection, models)

    def job_state(self, request_id: str) -> tuple[str | None, bool]:
        """The RQ status of the request's job (None: it no longer exists), and whether the worker that
        started it is alive."""
        try:
            job = Job.fetch(request_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return None, True
        status = job.get_status(refresh=False)
        if status != JobStatus.STARTED or not job.worker_name:
            return status, True
        alive = bool(self.connection.exists(worker_heartbeat_key(worker_process(job.worker_name))))
        return status, alive


def live_worker_counts(connection: redis.Redis, models: list[str]) -> dict[str, int]:
    """The worker processes of each model with a fresh heartbeat (Redis' clock)."""
    seconds, micros = connection.time()
    since = seconds * 1000 + micros // 1000 - WORKER_HEARTBEAT_TTL * 1000
    pipe = connection.pipeline(transaction=False)
    for model in models:
        pipe.zcount(live_workers_key(model), since, "+inf")
    return dict(zip(models, (int(n) for n in pipe.execute()), strict=True))


def live_worker_names(connection: redis.Redis, model: str) -> set[str]:
    """The worker processes (`<host>.<pid>`) of the model with a fresh heartbeat (Redis' clock)."""
    with connection.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.zrange(live_workers_key(model), 0, -1, withscores=True)
        (seconds, micros), live = pipe.execute()
    since = seconds * 1000 + micros // 1000 - WORKER_HEARTBEAT_TTL * 1000
    return {name.decode() if isinstance(name, bytes) else name for name, score in live if score >= since}
