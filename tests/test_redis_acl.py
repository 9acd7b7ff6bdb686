"""The compose Redis (deploy/redis/start-redis.sh) run for real: each role's ACL user serves the stack,
and no role can reach beyond RQ's and tokenline's keys or run admin commands."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from scripts import localstack

pytestmark = pytest.mark.e2e

PASSWORDS = {"api": "api-pass-1", "worker": "worker-pass-2", "dashboard": "dash-pass-3"}


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    logs = tmp_path_factory.mktemp("acl-redis")
    port = localstack.free_port()
    env = {
        "PATH": f"{Path(localstack.redis_server_binary()).parent}:/usr/bin:/bin",
        "REDIS_ACL_FILE": str(logs / "users.acl"),
        **{f"REDIS_{role.upper()}_PASSWORD": password for role, password in PASSWORDS.items()},
    }
    script = localstack.ROOT / "deploy" / "redis" / "start-redis.sh"
    with open(logs / "redis.log", "wb") as log:
        proc = subprocess.Popen(
            ["sh", str(script), "--port", str(port), "--bind", "127.0.0.1"], env=env, stdout=log, stderr=log
        )
    localstack.wait_for(lambda: localstack._port_open(port) or proc.poll() is not None, 10, "redis with ACLs")
    assert proc.poll() is None, (logs / "redis.log").read_text()
    yield port
    localstack.stop(proc)


def url(port: int, role: str) -> str:
    return f"redis://{role}:{PASSWORDS[role]}@127.0.0.1:{port}/0"


def test_the_stack_runs_with_one_user_per_role(acl_redis: int, demo_model: Path, tmp_path: Path) -> None:
    common = {"MODEL_PATH": str(demo_model), "MODEL_NAME": "acl", "TOKENLINE_DEVICE": "cpu"}
    worker_env = localstack.environment(**common, REDIS_URL=url(acl_redis, "worker"))
    api_env = localstack.environment(**common, REDIS_URL=url(acl_redis, "api"))
    worker = localstack.start_worker(worker_env, "acl", log=tmp_path / "worker.log")
    port = localstack.free_port()
    api = localstack.start_api(api_env, port, log=tmp_path / "api.log")
    try:
        localstack.wait_for_api(port, api)
        localstack.wait_for(lambda: localstack.worker_count(url(acl_redis, "dashboard"), "acl") > 0, 60, "worker")
        body = {"model": "acl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        response = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
    finally:
        localstack.stop(api, worker)
    assert response.status_code == 200
    assert response.text.endswith("data: [DONE]\n\n")
    assert '"error"' not in response.text
    assert "NOPERM" not in (tmp_path / "worker.log").read_text()


@pytest.mark.parametrize("role", sorted(PASSWORDS))
def test_no_role_reaches_other_keys_or_admin_commands(acl_redis: int, role: str) -> None:
    connection = redis.Redis.from_url(url(acl_redis, role))
    assert connection.ping()
    connection.set("tokenline:acl-probe", 1)
    for forbidden in (
        lambda: connection.set("someone-elses-key", 1),
        lambda: connection.flushall(),
        lambda: connection.keys("*"),
        lambda: connection.config_get("requirepass"),
        lambda: connection.client_list(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()


def test_the_default_user_is_off(acl_redis: int) -> None:
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(f"redis://api:wrong@127.0.0.1:{acl_redis}/0").ping()


@pytest.mark.parametrize("dev_mode", ["0", None])
def test_the_development_passwords_are_refused_outside_development_mode(tmp_path: Path, dev_mode: str | None) -> None:
    env = {
        "PATH": f"{Path(localstack.redis_server_binary()).parent}:/usr/bin:/bin",
        "REDIS_ACL_FILE": str(tmp_path / "users.acl"),
        "REDIS_API_PASSWORD": "a-strong-one",
        "REDIS_WORKER_PASSWORD": "tokenline-worker-dev",
        "REDIS_DASHBOARD_PASSWORD": "another-strong-one",
        **({"TOKENLINE_DEV_MODE": dev_mode} if dev_mode is not None else {}),
    }
    script = localstack.ROOT / "deploy" / "redis" / "start-redis.sh"
    port = localstack.free_port()
    result = subprocess.run(
        ["sh", str(script), "--port", str(port), "--bind", "127.0.0.1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 2
    assert "refusing the development password 'tokenline-worker-dev'" in result.stderr
    assert not (tmp_path / "users.acl").exists() and not localstack._port_open(port)


def test_development_mode_accepts_the_development_passwords(tmp_path: Path) -> None:
    env = {
        "PATH": f"{Path(localstack.redis_server_binary()).parent}:/usr/bin:/bin",
        "REDIS_ACL_FILE": str(tmp_path / "users.acl"),
        "TOKENLINE_DEV_MODE": "1",
        **{f"REDIS_{role.upper()}_PASSWORD": f"tokenline-{role}-dev" for role in PASSWORDS},
    }
    port = localstack.free_port()
    script = localstack.ROOT / "deploy" / "redis" / "start-redis.sh"
    proc = subprocess.Popen(["sh", str(script), "--port", str(port), "--bind", "127.0.0.1"], env=env)
    try:
        localstack.wait_for(lambda: localstack._port_open(port) or proc.poll() is not None, 10, "redis")
        assert proc.poll() is None
    finally:
        localstack.stop(proc)
