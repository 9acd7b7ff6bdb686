"""`python -m workers.ops.health`: exit 0 while a worker process on this host has a fresh heartbeat.

The container healthcheck of the worker image. It reads REDIS_URL (and TOKENLINE_CONFIG) like the
worker, imports no torch, and looks for `tokenline:worker:<hostname>.*`, which a live worker refreshes
every half second and which expires a few seconds after it stops.
"""

from __future__ import annotations

import socket
import sys

import redis

from schemas.config import ConfigError, load_settings
from schemas.keys import worker_heartbeat_key


def main() -> int:
    try:
        settings = load_settings(require_model=False)
    except ConfigError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    pattern = worker_heartbeat_key(f"{socket.gethostname()}.*")
    try:
        connection = redis.Redis.from_url(settings.redis_url, socket_timeout=3)
        alive = next(connection.scan_iter(match=pattern, count=1000), None)
    except redis.RedisError as exc:
        print(f"unhealthy: Redis: {exc}", file=sys.stderr)
        return 1
    if alive is None:
        print(f"unhealthy: no heartbeat matching {pattern}", file=sys.stderr)
        return 1
    print(f"healthy: {alive.decode()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
