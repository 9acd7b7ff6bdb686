"""The API's health endpoints: liveness (the process serves HTTP), readiness (a request can be served:
Redis answers and some model has a live worker) and the status (Redis and workers per model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from scripts import localstack

pytestmark = pytest.mark.e2e


def test_a_stack_with_a_worker_is_live_and_ready(stack) -> None:  # type: ignore[no-untyped-def]
    assert requests.get(f"{stack.base_url}/health/live", timeout=10).json() == {"status": "ok"}
    ready = requests.get(f"{stack.base_url}/health/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["workers"]["demo"] >= 1


def test_an_api_no_worker_serves_yet_is_live_but_not_ready(
    stack_env: dict[str, str], demo_model: Path, tmp_path: Path
) -> None:
    """What a load balancer or a readiness probe needs while gunicorn is up before the workers."""
    env = {**stack_env, "MODEL_PATH": str(demo_model), "MODEL_NAME": "unserved"}
    with localstack.running_api(env, tmp_path / "api.log") as url:
        assert requests.get(f"{url}/health/live", timeout=10).status_code == 200
        ready = requests.get(f"{url}/health/ready", timeout=10)
        assert ready.status_code == 503 and ready.headers["Retry-After"] == "1"
        assert ready.json() == {
            "status": "unavailable",
            "redis": "ok",
            "workers": {"unserved": 0},
            "reason": "no live worker serves any model",
        }
        status = requests.get(f"{url}/health", timeout=10)
        assert status.status_code == 200 and status.json()["workers"] == {"unserved": 0}
