"""Device leases: workers started with `--device auto` on one host take different devices, through Redis."""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid
from pathlib import Path

import pytest
import redis

from schemas.keys import device_lease_key
from scripts import localstack
from workers.ops.lease import DeviceBusy, holders, lease_any, lease_group, lease_one, try_lease


@pytest.fixture()
def node() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def test_two_leases_take_different_devices(redis_conn: redis.Redis, node: str) -> None:
    first = lease_any(redis_conn, node, [0, 1], "w1", ttl=10)
    second = lease_any(redis_conn, node, [0, 1], "w2", ttl=10)
    assert first is not None and second is not None
    assert (first.device_id, second.device_id) == (0, 1)
    assert holders(redis_conn, node, [0, 1]) == {0: "w1", 1: "w2"}


def test_lease_any_waits_while_every_device_is_held(redis_conn: redis.Redis, node: str) -> None:
    held = lease_any(redis_conn, node, [0], "w1", ttl=10)
    assert held is not None
    stop = threading.Event()
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(lease_any(redis_conn, node, [0], "w2", 10, stop)))
    waiter.start()
    localstack.wait_for(lambda: redis_conn.get(device_lease_key(node, 0)) == b"w1", 2, "the first lease")
    held.release()
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert result[0] is not None and result[0].device_id == 0  # type: ignore[attr-defined]
    assert holders(redis_conn, node, [0]) == {0: "w2"}


def test_lease_any_returns_none_when_stopped(redis_conn: redis.Redis, node: str) -> None:
    assert lease_any(redis_conn, node, [0], "w1", ttl=10) is not None
    stop = threading.Event()
    stop.set()
    assert lease_any(redis_conn, node, [0], "w2", 10, stop) is None


def test_a_group_is_leased_whole_or_not_at_all(redis_conn: redis.Redis, node: str) -> None:
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    lease_one(redis_conn, node, 2, "single", ttl=10)  # one device of the first group is held
    group = lease_group(redis_conn, node, groups, "tp4", ttl=10)
    assert group is not None and group.device_ids == [4, 5, 6, 7]
    # The first group's free devices were given back, not kept.
    expected = {0: None, 1: None, 2: "single", 3: None, **dict.fromkeys([4, 5, 6, 7], "tp4")}
    assert holders(redis_conn, node, range(8)) == expected
    stop = threading.Event()
    stop.set()
    assert lease_group(redis_conn, node, groups, "another", 10, stop) is None  # none is free: it would wait
    group.release()
    assert holders(redis_conn, node, [4, 5, 6, 7]) == dict.fromkeys([4, 5, 6, 7])


def test_an_explicit_device_held_by_another_is_refused_naming_the_holder(redis_conn: redis.Redis, node: str) -> None:
    lease_one(redis_conn, node, 3, "w1", ttl=10)
    with pytest.raises(DeviceBusy, match=r"device 3 .* leased by w1"):
        lease_one(redis_conn, node, 3, "w2", ttl=10)


def test_an_unrenewed_lease_expires_and_the_device_is_free_again(redis_conn: redis.Redis, node: str) -> None:
    assert try_lease(redis_conn, node, 0, "dead", ttl=0.3) is not None
    localstack.wait_for(lambda: not redis_conn.exists(device_lease_key(node, 0)), 5, "the lease to expire")
    assert try_lease(redis_conn, node, 0, "next", ttl=10) is not None


def test_renewal_keeps_the_lease_and_release_only_drops_ones_own(redis_conn: redis.Redis, node: str) -> None:
    mine = try_lease(redis_conn, node, 0, "me", ttl=1)
    assert mine is not None
    assert mine.renew()
    assert redis_conn.pttl(mine.key) > 500
    redis_conn.set(mine.key, "other")  # the device passed to another worker (say, after a Redis restart)
    assert not mine.renew()
    mine.release()
    assert redis_conn.get(mine.key) == b"other"


def test_a_lost_lease_is_reported_once(redis_conn: redis.Redis, node: str) -> None:
    mine = try_lease(redis_conn, node, 0, "me", ttl=0.3)
    assert mine is not None
    lost = threading.Event()
    redis_conn.set(mine.key, "other")
    mine.start_renewing(on_lost=lambda lease: lost.set())
    assert lost.wait(5)
    mine.release()


# Worker processes: the lease is taken before torch starts, and a killed worker's device frees itself.

LEASE_TTL = 2.0


def start_worker(env: dict[str, str], logs: Path, name: str):  # type: ignore[no-untyped-def]
    return localstack.start_worker(env, "lease-test", log=logs / f"{name}.log", extra_args=("--device", "auto"))


def owner(proc) -> str:  # type: ignore[no-untyped-def]
    return f"{socket.gethostname()}.{proc.pid}"


@pytest.mark.e2e
def test_auto_workers_hold_different_devices_and_a_killed_ones_device_frees(
    demo_model: Path, redis_url: str, redis_conn: redis.Redis, node: str, tmp_path: Path
) -> None:
    env = localstack.environment(
        MODEL_PATH=str(demo_model),
        MODEL_NAME="lease-test",
        REDIS_URL=redis_url,
        TOKENLINE_NPU_DEVICE_IDS="0,1",
        TOKENLINE_NODE=node,
        TOKENLINE_DEVICE_LEASE_TTL=str(LEASE_TTL),
        TOKENLINE_MAX_BATCH_SIZE="2",
    )
    first, second = start_worker(env, tmp_path, "first"), start_worker(env, tmp_path, "second")
    third = None
    try:
        both = {owner(first), owner(second)}
        localstack.wait_for(lambda: set(holders(redis_conn, node, [0, 1]).values()) == both, 30, "two leases")
        held = {v: k for k, v in holders(redis_conn, node, [0, 1]).items()}
        # Each process narrowed the visible devices to its own lease before torch started.
        for proc, name in ((first, "first"), (second, "second")):
            device = held[owner(proc)]
            localstack.wait_for(lambda n=name: "leased device" in (tmp_path / f"{n}.log").read_text(), 30, name)
            assert f"leased device {node}/{device}" in (tmp_path / f"{name}.log").read_text()

        third = start_worker(env, tmp_path, "third")  # waits: both devices are held
        localstack.wait_for(lambda: "are leased by other workers" in (tmp_path / "third.log").read_text(), 30, "wait")

        freed = held[owner(first)]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        # Nobody releases a SIGKILLed worker's lease: it expires after the TTL and the waiting worker takes it.
        localstack.wait_for(
            lambda: holders(redis_conn, node, [freed])[freed] == owner(third), LEASE_TTL + 10, "the freed device"
        )
        assert holders(redis_conn, node, [0, 1])[1 - freed] == owner(second)
    finally:
        # The third worker (and maybe the second) is still importing torch when stopped: on a slow, busy
        # CPU that takes longer than stop's default 15 s before SIGKILL, and a killed worker keeps its lease.
        localstack.stop(first, second, third, timeout=60)
    # Stopped while loading, each ended by itself (no SIGKILL) and gave its lease back at once.
    assert (second.returncode, third.returncode) == (0, 0)
    assert holders(redis_conn, node, [0, 1]) == {0: None, 1: None}


def test_a_leased_id_with_no_gpu_behind_it_stops_the_worker_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that leased an id of GPU_DEVICE_IDS the host has no GPU for (CUDA_VISIBLE_DEVICES set
    to it, CUDA then sees none) says so; on this CPU machine CUDA sees none either way."""
    from workers.models.device import resolve_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(RuntimeError) as caught:
        resolve_device("auto", "cuda")
    assert str(caught.value) == (
        "device 'cuda:0' requested but CUDA is not available (CUDA_VISIBLE_DEVICES=5: is there a GPU with that id? "
        "npuDeviceIds names them)"
    )
