"""`python -m workers.ops.health`, the worker image's healthcheck: it reads the worker's heartbeat key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts import localstack

pytestmark = pytest.mark.e2e


def health(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.ops.health"], cwd=localstack.ROOT, env=env, capture_output=True, text=True
    )


def test_healthy_while_a_worker_on_this_host_beats(stack, stack_env: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    result = health(stack_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"healthy: tokenline:worker:{localstack.socket.gethostname()}.{stack.worker.pid}")


def test_unhealthy_when_redis_is_unreachable(stack_env: dict[str, str]) -> None:
    dead = {**stack_env, "REDIS_URL": f"redis://127.0.0.1:{localstack.free_port()}/0"}
    result = health(dead)
    assert result.returncode == 1
    assert "unhealthy: Redis" in result.stderr
