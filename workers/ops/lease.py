"""Device leases in Redis: N workers started with `--device auto` on one host take N different devices.

A lease is a key `tokenline:device:<node>:<id>` holding the owner's name, with a TTL. The owner renews
it from a thread while it runs and deletes it when it stops; a killed owner's lease expires after the
TTL. Renewal and release compare the owner first (in Lua), so a worker never extends or drops a lease
that has passed to someone else. This module imports no torch: the lease is taken before the
accelerator library starts, so ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES can still be set.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import redis

from schemas.keys import device_lease_key

logger = logging.getLogger(__name__)

# KEYS[1] lease key; ARGV[1] owner; ARGV[2] ttl ms. 1 = renewed (or re-taken after it expired), 0 = lost.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class DeviceBusy(RuntimeError):
    """The one device asked for is leased by another worker."""


class DeviceLease:
    """One held lease; `start_renewing` keeps it alive, `release` gives it back."""

    def __init__(self, connection: redis.Redis, node: str, device_id: int, owner: str, ttl: float) -> None:
        self.connection = connection
        self.node = node
        self.device_id = device_id
        self.owner = owner
        self.ttl = ttl
        self.key = device_lease_key(node, device_id)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"{self.node}/{self.device_id}"

    def renew(self) -> bool:
        """Extend the lease; False when another worker holds the device now."""
        return bool(self.connection.eval(_RENEW, 1, self.key, self.owner, int(self.ttl * 1000)))

    def start_renewing(self, on_lost: Callable[[DeviceLease], None]) -> None:
        """Renew every ttl/3 from a daemon thread; call `on_lost` once if the device passes to another worker."""

        def loop() -> None:
            while not self._stopped.wait(self.ttl / 3):
                try:
                    held = self.renew()
                except redis.RedisError as exc:  # Redis away: nobody else can take it meanwhile; keep trying
                    logger.warning("could not renew device lease %r: %s", self, exc)
                    continue
                if not held:
                    logger.error("device lease %r was taken by another worker", self)
                    on_lost(self)
                    return

        self._thread = threading.Thread(target=loop, name="device-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stopped.set()
        try:
            self.connection.eval(_RELEASE, 1, self.key, self.owner)
        except redis.RedisError as exc:  # it expires by itself after the TTL
            logger.warning("could not release device lease %r: %s", self, exc)


def try_lease(connection: redis.Redis, node: str, device_id: int, owner: str, ttl: float) -> DeviceLease | None:
    lease = DeviceLease(connection, node, device_id, owner, ttl)
    taken = connection.set(lease.key, owner, nx=True, px=int(ttl * 1000))
    return lease if taken else None


def lease_one(connection: redis.Redis, node: str, device_id: int, owner: str, ttl: float) -> DeviceLease:
    """The explicitly named device, or DeviceBusy at once."""
    lease = try_lease(connection, node, device_id, owner, ttl)
    if lease is None:
        holder = connection.get(device_lease_key(node, device_id))
        raise DeviceBusy(f"device {device_id} on node {node!r} is leased by {holder.decode() if holder else '?'}")
    return lease


def lease_any(
    connection: redis.Redis,
    node: str,
    device_ids: Sequence[int],
    owner: str,
    ttl: float,
    stop: threading.Event | None = None,
) -> DeviceLease | None:
    """The first free device of `device_ids`, waiting for one while all are held; None if `stop` is set."""
    stop = stop or threading.Event()
    announced = False
    while not stop.is_set():
        for device_id in device_ids:
            lease = try_lease(connection, node, device_id, owner, ttl)
            if lease is not None:
                return lease
        if not announced:
            logger.warning(
                "all devices %s on node %r are leased by other workers; waiting for one to free", list(device_ids), node
            )
            announced = True
        stop.wait(min(1.0, ttl / 3))
    return None


class GroupLease:
    """The leases of a device group, held together (a tensor-parallel worker's devices)."""

    def __init__(self, leases: list[DeviceLease]) -> None:
        self.leases = leases

    def __repr__(self) -> str:
        return f"{self.leases[0].node}/{','.join(str(lease.device_id) for lease in self.leases)}"

    @property
    def device_ids(self) -> list[int]:
        return [lease.device_id for lease in self.leases]

    def start_renewing(self, on_lost: Callable[[GroupLease], None]) -> None:
        for lease in self.leases:
            lease.start_renewing(on_lost=lambda _: on_lost(self))

    def release(self) -> None:
        for lease in self.leases:
            lease.release()


def lease_group(
    connection: redis.Redis,
    node: str,
    groups: Sequence[Sequence[int]],
    owner: str,
    ttl: float,
    stop: threading.Event | None = None,
) -> GroupLease | None:
    """Every device of the first group that is wholly free, waiting while none is; None if `stop` is set.
    A group is taken device by device and given back whole when one of its devices is held."""
    stop = stop or threading.Event()
    announced = False
    while not stop.is_set():
        for group in groups:
            taken: list[DeviceLease] = []
            for device_id in group:
                lease = try_lease(connection, node, device_id, owner, ttl)
                if lease is None:
                    break
                taken.append(lease)
            if len(taken) == len(group):
                return GroupLease(taken)
            for lease in taken:
                lease.release()
        if not announced:
            logger.warning(
                "every device group %s on node %r has a device leased by another worker; waiting for one to free",
                [list(g) for g in groups],
                node,
            )
            announced = True
        stop.wait(min(1.0, ttl / 3))
    return None


def holders(connection: redis.Redis, node: str, device_ids: Sequence[int]) -> dict[int, str | None]:
    """Who holds each device now (None: free)."""
    values = connection.mget([device_lease_key(node, i) for i in device_ids])
    return {i: v.decode() if v else None for i, v in zip(device_ids, values, strict=True)}


def release_dead_owner(connection: redis.Redis, node: str, device_ids: Sequence[int], owner: str) -> list[int]:
    """Give back the leases a process held that is known to be dead (its supervisor saw it exit), so
    that its successor need not wait for their TTL; the devices released."""
    released = []
    for device_id in device_ids:
        if connection.eval(_RELEASE, 1, device_lease_key(node, device_id), owner):
            released.append(device_id)
    return released
