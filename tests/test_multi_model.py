"""Several models behind one API: each worker serves its model's queue, and the API routes by name."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import redis
import requests
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from scripts import localstack

pytestmark = pytest.mark.e2e


def test_the_api_routes_each_model_to_its_own_workers(
    demo_model: Path, redis_url: str, redis_conn: redis.Redis, tmp_path: Path
) -> None:
    config = tmp_path / "tokenline.json"
    config.write_text(
        json.dumps(
            {
                "ModelConfig": [
                    {"modelName": "alpha", "modelWeightPath": str(demo_model)},
                    {"modelName": "beta", "modelWeightPath": str(demo_model)},
                ]
            }
        )
    )
    env = localstack.environment(
        TOKENLINE_CONFIG=str(config), REDIS_URL=redis_url, TOKENLINE_DEVICE="cpu", TOKENLINE_MAX_BATCH_SIZE="2"
    )
    env.pop("MODEL_PATH", None)
    env.pop("MODEL_NAME", None)
    workers = {name: localstack.start_worker(env, name, log=tmp_path / f"{name}.log") for name in ("alpha", "beta")}
    port = localstack.free_port()
    api = localstack.start_api(env, port, log=tmp_path / "api.log")
    try:
        localstack.wait_for_api(port, api)
        for name in workers:
            localstack.wait_for(lambda n=name: localstack.worker_count(redis_url, n) == 1, 60, f"worker {name}")
        models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        answers = {}
        for name in ("alpha", "beta", "alpha"):
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            response = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            answers.setdefault(name, []).append(response.json()["id"])
        unknown = requests.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "gamma", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        anthropic_listing(f"http://127.0.0.1:{port}", demo_model)
    finally:
        localstack.stop(api, *workers.values())
    assert [m["id"] for m in models["data"]] == ["alpha", "beta"]
    # The same in every API process: when the model's files were last written.
    assert {m["created"] for m in models["data"]} == {int(demo_model.stat().st_mtime)}
    for name, ids in answers.items():
        for job_id in ids:
            job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
            localstack.wait_for(lambda j=job: j.get_status() == JobStatus.FINISHED, 10, "the job to finish")
            assert job.origin == f"tokenline.{name}"
            # A worker process's RQ worker is named <host>.<pid>: the model's own worker process ran it.
            assert job.worker_name == f"{socket.gethostname()}.{workers[name].pid}"
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def anthropic_listing(url: str, demo_model: Path) -> None:
    """The anthropic SDK lists the models of the same route, with its own fields and pages (`limit`,
    `after_id`, `before_id`); a query parameter the route does not take is a 400 naming it."""
    from anthropic import Anthropic, BadRequestError

    claude = Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=10)
    (alpha, beta) = claude.models.list().data
    assert (alpha.type, alpha.id, alpha.display_name, beta.id) == ("model", "alpha", "alpha", "beta")
    assert alpha.created_at.timestamp() == int(demo_model.stat().st_mtime)
    first = claude.models.list(limit=1)
    assert ([m.id for m in first.data], first.has_more, first.first_id, first.last_id) == (
        ["alpha"],
        True,
        "alpha",
        "alpha",
    )
    assert [m.id for m in first] == ["alpha", "beta"]  # the SDK pages on with after_id
    assert [m.id for m in claude.models.list(before_id="beta").data] == ["alpha"]
    assert claude.models.list(after_id="beta").data == []
    for query, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"page": 2}, "page")):
        response = requests.get(f"{url}/v1/models", params=query, timeout=10)
        assert (response.status_code, response.json()["error"]["param"]) == (400, param)
    assert requests.get(f"{url}/v1/models", params={"after_id": "gamma"}, timeout=10).status_code == 404
    with pytest.raises(BadRequestError, match="limit"):
        claude.models.list(limit=1001)
