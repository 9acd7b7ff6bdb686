"""Redis' clock, read from this host's: the one clock every process of a deployment shares.

A request's latencies span hosts: the API stamps when it queued the request, a worker on another host
times its first token and its end. Hosts' clocks disagree (by seconds where NTP is missing), so both
sides read Redis' clock instead: each process keeps the offset of Redis' `TIME` from its own wall
clock, measured at a round trip (the worker's heartbeat every second, the API's relay every
SYNC_SECONDS), and reads its wall clock plus that offset. Liveness already compares heartbeats in
Redis' clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

SYNC_SECONDS = 30.0  # how old the API's offset may grow before its relay measures it again


class RedisClock:
    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.offset = 0.0  # Redis' clock minus this host's, in seconds
        self.synced_at: float | None = None  # time.monotonic() of the last measurement

    def now(self) -> float:
        """Seconds since the epoch, by Redis' clock (by this host's until the first measurement)."""
        return self.wall() + self.offset

    def measured(self, before: float, redis_ms: int, after: float) -> None:
        """Take Redis' time (milliseconds) read between `before` and `after` (this host's wall clock)."""
        self.offset = redis_ms / 1000 - (before + after) / 2
        self.synced_at = time.monotonic()

    def sync(self, connection: redis.Redis) -> None:
        """Measure the offset with one `TIME`; RedisError if Redis does not answer."""
        before = self.wall()
        seconds, micros = connection.time()
        self.measured(before, seconds * 1000 + micros // 1000, self.wall())

    def sync_if_stale(self, connection: redis.Redis) -> None:
        if self.synced_at is None or time.monotonic() - self.synced_at > SYNC_SECONDS:
            self.sync(connection)


# This process's: the worker's heartbeat and the API's requests keep it measured.
clock = RedisClock()
