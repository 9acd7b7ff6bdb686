"""The worker process's heartbeat: proof of life for healthchecks, admission and the API's fault detection.

Every WORKER_HEARTBEAT_INTERVAL the beacon thread refreshes a key of its own (TTL WORKER_HEARTBEAT_TTL)
and its score in its model's live set, both on Redis' clock, in one script. The API admits requests
for a model only while that set has a fresh member, and fails a started request whose worker's key
has expired (the worker was killed): the client hears of it within WORKER_HEARTBEAT_TTL plus a second.
"""

from __future__ import annotations

import json
import logging
import os
import socket

import redis

from schemas import keys
from schemas.clock import clock
from schemas.keys import WORKER_HEARTBEAT_TTL, live_workers_key, worker_heartbeat_key

logger = logging.getLogger(__name__)

# KEYS[1] heartbeat key, KEYS[2] live set; ARGV[1] process, ARGV[2] value, ARGV[3] ttl seconds,
# ARGV[4] "1" while taking jobs (a draining worker stays alive but leaves the live set).
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[2], now, ARGV[1])
else
  redis.call('ZREM', KEYS[2], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl * 1000)
redis.call('EXPIRE', KEYS[2], ttl * 2)
return now
"""
_END = """
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""


def process_name() -> str:
    """This worker process: `<host>.<pid>`, the name of its RQ worker too."""
    return keys.process_name(socket.gethostname(), os.getpid())


class Heartbeat:
    def __init__(self, connection: redis.Redis, model: str, device: str) -> None:
        self.connection = connection
        self.process = process_name()
        self.keys = [worker_heartbeat_key(self.process), live_workers_key(model)]
        self.value = json.dumps({"model": model, "device": device, "pid": os.getpid()})
        self._failing = False
        self._beat = connection.register_script(_BEAT)
        self._end = connection.register_script(_END)

    def beat(self, serving: bool = True) -> None:
        """Refresh the heartbeat, and measure this process's offset from Redis' clock with it (the
        engine times requests by it: schemas/clock.py)."""
        try:
            before = clock.wall()
            redis_ms = self._beat(self.keys, [self.process, self.value, WORKER_HEARTBEAT_TTL, "1" if serving else "0"])
            clock.measured(before, int(redis_ms), clock.wall())
        except redis.RedisError as exc:
            if not self._failing:
                logger.warning("heartbeat failed (Redis: %s); retrying", exc)
            self._failing = True
            return
        if self._failing:
            logger.info("heartbeat restored")
        self._failing = False

    def end(self) -> None:
        """Leave the live set at once: the API stops admitting requests for a model with no worker left."""
        try:
            self._end(self.keys, [self.process])
        except redis.RedisError as exc:
            logger.warning("could not remove the heartbeat: %s", exc)
