"""The KV pool's size on a CPU: npuMemSize -1 stays within half the memory the host has available, and an
npuMemSize larger than that memory stops the worker's start naming the setting (a pool is written whole
at start-up: one larger than the host's memory is the kernel's OOM killer, for any process there)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from scripts import localstack
from workers.models import kv_pool
from workers.models.kv_pool import CPU_AVAILABLE_SHARE, KVLayout, KVShape, PoolSizeError, host_available_bytes

CPU = torch.device("cpu")
GIB = 2**30
# 30 layers of 3 KV heads of 64 (SmolLM2-135M) in float32: 46,080 bytes a token.
SHAPE = KVShape((0,) * 30, 3, 64, torch.float32)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        ({}, 20000000 * 1024),
        # a container's limit (cgroup v2) leaves less than the host has
        ({"sys/fs/cgroup/memory.max": "8589934592\n", "sys/fs/cgroup/memory.current": "1073741824\n"}, 7 * GIB),
        ({"sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/memory.current": "1073741824\n"}, 20000000 * 1024),
        # cgroup v1: "no limit" is a number near 2**63
        (
            {
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
                "sys/fs/cgroup/memory/memory.usage_in_bytes": "1073741824\n",
            },
            20000000 * 1024,
        ),
        (
            {
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "4294967296\n",
                "sys/fs/cgroup/memory/memory.usage_in_bytes": "1073741824\n",
            },
            3 * GIB,
        ),
    ],
)
def test_the_hosts_available_memory_is_memavailable_within_the_cgroups_limit(
    tmp_path: Path, cgroup: dict[str, str], expected: int
) -> None:
    assert host_available_bytes(write(tmp_path, {"proc/meminfo": MEMINFO, **cgroup})) == expected


def test_the_hosts_available_memory_is_unknown_where_nothing_says_it(tmp_path: Path) -> None:
    assert host_available_bytes(tmp_path) is None
    assert 0 < host_available_bytes() < 2**50  # type: ignore[operator]  # this host says it


def test_minus_one_on_a_cpu_takes_two_contexts_a_slot_within_half_the_available_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Huawei's sample config (maxBatchSize 200, maxSeqLen 2560) on SmolLM2 would want 46 GiB for two
    full contexts a slot; a host with 8 GiB available gets a 4 GiB pool, said in the log. A batch the
    host holds gets its two contexts a slot."""
    monkeypatch.setattr(kv_pool, "host_available_bytes", lambda: 8 * GIB)
    with caplog.at_level(logging.WARNING, logger="workers.models.kv_pool"):
        small = KVLayout.plan(SHAPE, CPU, -1, 16, 4, 2560, 512)
    assert small.num_blocks == 2 * 4 * (2560 + 16) // 16 and not caplog.records
    with caplog.at_level(logging.WARNING, logger="workers.models.kv_pool"):
        huge = KVLayout.plan(SHAPE, CPU, -1, 128, 200, 2560, 8192)
    assert huge.bytes <= CPU_AVAILABLE_SHARE * 8 * GIB and huge.num_blocks == 4 * GIB // (128 * 46080)
    assert caplog.messages == [
        "npuMemSize -1: 2 full contexts per batch slot would take 46.143 GiB; the KV pool takes 4.000 GiB, "
        "50% of the 8.000 GiB this host has available (set npuMemSize, or lower maxBatchSize or maxSeqLen)"
    ]


def test_an_npumemsize_beyond_the_available_memory_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_pool, "host_available_bytes", lambda: 8 * GIB)
    assert KVLayout.plan(SHAPE, CPU, 7.5, 16, 4, 2560, 512).bytes <= 7.5 * GIB
    refused = r"^npuMemSize 9 GiB is more than the 8\.000 GiB of memory this host has available$"
    with pytest.raises(PoolSizeError, match=refused):
        KVLayout.plan(SHAPE, CPU, 9, 16, 4, 2560, 512)


def test_the_worker_stops_its_start_on_a_pool_larger_than_the_host(demo_model: Path) -> None:
    """Exit code 2 and the reason, before it allocates anything of the pool (or touches Redis)."""
    result = localstack.refused_worker(demo_model, TOKENLINE_NPU_MEM_SIZE="1000000")
    assert result.returncode == 2, result.stderr
    assert "tokenline worker: model m: npuMemSize 1e+06 GiB is more than the " in result.stderr
    assert "Traceback" not in result.stderr
