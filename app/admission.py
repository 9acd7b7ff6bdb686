"""Admission control and worker liveness, both decided in Redis so every API process agrees.

A model's queued plus running requests are counted against `maxLinkNum` in one script (MindIE's cap
on open links, per model here): over the cap the request gets 429 at once, and a model whose live set
(workers/heartbeat.py) has no fresh member gets 503 at once instead of queueing. The script is also
the push of the request's RQ job onto its queue, inside the enqueue's transaction (app/dispatch.py):
a refused job is deleted unseen, and admission costs no round trip of its own. Each admitted request
holds a place scored by when its hold expires (queueTimeout + e2eTimeout), so places that an API
process never gave back (it was killed) free themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from rq.job import Job

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

# KEYS[1] admitted set, KEYS[2] live workers, KEYS[3] the model's RQ queue, KEYS[4] the job's hash;
# ARGV[1] cap, ARGV[2] request id (= job id), ARGV[3] hold ms, ARGV[4] heartbeat freshness ms.
# 1: admitted, and the job id pushed onto the queue; 0 over the cap, -1 no live worker: the job's
# hash, written earlier in the same transaction, is deleted.
ADMIT_AND_PUSH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local verdict = 1
if redis.call('ZCOUNT', KEYS[2], now - tonumber(ARGV[4]), '+inf') == 0 then
  verdict = -1
else
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then verdict = 0 end
end
if verdict ~= 1 then
  redis.call('DEL', KEYS[4])
  return verdict
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('RPUSH', KEYS[3], ARGV[2])
return 1
"""


@dataclass
class Hold:
    """The admission of one request, as the keys and arguments of ADMIT_AND_PUSH (less the queue's and
    the job's keys); `at` is the script's place in the enqueue's pipeline, where its verdict comes back."""

    model: str
    request_id: str
    keys: list[str]
    args: list[int | str]
    at: int | None = None


class Admission:
    def __init__(self, connection: redis.Redis, settings: Settings) -> None:
        self.connection = connection
        self.cap = settings.max_link_num
        self.hold_ms = int((settings.queue_timeout + settings.e2e_timeout) * 1000)

    def hold(self, model: str, request_id: str) -> Hold:
        """A place for the request, to be taken as its job is pushed (see ADMIT_AND_PUSH)."""
        keys = [admitted_key(model), live_workers_key(model)]
        return Hold(model, request_id, keys, [self.cap, request_id, self.hold_ms, WORKER_HEARTBEAT_TTL * 1000])

    def settle(self, hold: Hold, verdict: int) -> None:
        """The script's verdict: the request was admitted, or raise Overloaded (429) / NoWorker (503)."""
        model = hold.model
        if verdict == -1:
            raise NoWorker(f"No worker is serving model '{model}' right now; try again shortly.")
        if verdict == 0:
            logger.info("over capacity model=%s cap=%d request_id=%s", model, self.cap, hold.request_id)
            raise Overloaded(
                f"Model '{model}' has {self.cap} requests queued or running (maxLinkNum); try again shortly."
            )

    def release(self, model: str, request_id: str) -> None:
        try:
            self.connection.zrem(admitted_key(model), request_id)
        except redis.RedisError as exc:  # the place frees itself when its hold expires
            logger.warning("could not release the place of request_id=%s: %s", request_id, exc)

    def live_workers(self, models: list[str]) -> dict[str, int]:
        return live_worker_counts(self.connection, models)

    def job_state(self, request_id: str) -> tuple[str | None, bool]:
        """The RQ status of the request's job, and whether the worker that started it is alive."""
        status, worker = self.connection.hmget(Job.key_for(request_id), ["status", "worker_name"])
        status = status.decode() if status else None
        if status != "started" or not worker:
            return status, True
        alive = bool(self.connection.exists(worker_heartbeat_key(worker_process(worker.decode()))))
        return status, alive


def live_worker_counts(connection: redis.Redis, models: list[str]) -> dict[str, int]:
    """The worker processes of each model with a fresh heartbeat (Redis' clock)."""
    seconds, micros = connection.time()
    since = seconds * 1000 + micros // 1000 - WORKER_HEARTBEAT_TTL * 1000
    pipe = connection.pipeline(transaction=False)
    for model in models:
        pipe.zcount(live_workers_key(model), since, "+inf")
    return dict(zip(models, (int(n) for n in pipe.execute()), strict=True))
