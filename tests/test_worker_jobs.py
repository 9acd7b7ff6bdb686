"""RQ semantics with the real worker process: job ids, registries, refused callables, bad payloads."""

from __future__ import annotations

import socket
import threading

import pytest
import requests
from rq import Queue, Worker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from schemas.job import JOB_FUNCTION
from schemas.keys import process_name, queue_name
from scripts.localstack import wait_for
from tests.chat_runs import first_token

pytestmark = pytest.mark.e2e


def fetch(redis_conn, job_id: str) -> Job:  # type: ignore[no-untyped-def]
    return Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)


def test_request_id_is_the_rq_job_id_and_the_job_finishes(openai_client, redis_conn) -> None:
    completion = openai_client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    job = fetch(redis_conn, completion.id)
    wait_for(lambda: job.get_status() == JobStatus.FINISHED, 10, "the job to finish")
    assert job.func_name == JOB_FUNCTION
    assert job.origin == queue_name("demo")
    assert job.return_value() == {
        "finish_reason": "length",
        "usage": {
            "prompt_tokens": completion.usage.prompt_tokens,
            "completion_tokens": 5,
            "total_tokens": completion.usage.prompt_tokens + 5,
        },
    }


def test_a_job_naming_another_callable_is_refused_and_not_run(stack, redis_conn) -> None:
    queue = Queue(queue_name("demo"), connection=redis_conn, serializer=JSONSerializer)
    job = queue.enqueue("os.getcwd", job_id="evil-1")
    wait_for(lambda: job.get_status() == JobStatus.FAILED, 10, "the refused job to fail")
    assert "is not served by this worker" in job.latest_result().exc_string
    assert stack.worker.poll() is None


def test_a_malformed_payload_fails_its_job_and_the_worker_serves_on(stack, redis_conn) -> None:
    queue = Queue(queue_name("demo"), connection=redis_conn, serializer=JSONSerializer)
    job = queue.enqueue(JOB_FUNCTION, {"v": 1, "request_id": "x"}, job_id="bad-payload-1")
    wait_for(lambda: job.get_status() == JobStatus.FAILED, 10, "the bad job to fail")
    assert "invalid job payload" in job.latest_result().exc_string
    response = requests.post(f"{stack.base_url}/generate", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert response.status_code == 200


def test_client_leaving_mid_stream_cancels_the_job(stack, redis_conn) -> None:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 256,
        "ignore_eos": True,
        "stream": True,
    }
    with requests.post(f"{stack.base_url}/v1/chat/completions", json=body, stream=True, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        request_id = first.decode().split('"id":"')[1].split('"')[0]
        first_token(lines)  # the worker generates it
    job = fetch(redis_conn, request_id)
    wait_for(lambda: job.get_status() == JobStatus.FINISHED, 15, "the cancelled job to end")
    assert job.return_value() == {"finish_reason": "cancelled"}


def test_rq_shows_the_worker_busy_while_it_serves_and_idle_after(stack, redis_conn) -> None:
    """`rq info` and rq-dashboard read the worker's state from RQ's worker hash: busy while a request
    is in flight (RQ's loop waits for the next job meanwhile), idle once none is."""
    queue = Queue(queue_name("demo"), connection=redis_conn, serializer=JSONSerializer)
    (worker,) = Worker.all(queue=queue)
    body = {"model": "demo", "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with requests.post(f"{stack.base_url}/v1/completions", json=body, stream=True, timeout=30) as response:
        lines = response.iter_lines()
        next(line for line in lines if line)  # the request is in flight
        worker.refresh()
        assert worker.get_state() == "busy"
        assert [line for line in lines if line][-1] == b"data: [DONE]"
    wait_for(lambda: worker.refresh() or worker.get_state() == "idle", 10, "the worker's state to be idle")


def test_a_worker_process_is_one_rq_worker_that_rq_lists_with_its_jobs_started(stack, redis_conn) -> None:
    """One RQ registration per process, whatever maxBatchSize: requests in flight together are in RQ's
    StartedJobRegistry together, started by that one worker, and each ends finished."""
    queue = Queue(queue_name("demo"), connection=redis_conn, serializer=JSONSerializer)
    name = process_name(socket.gethostname(), stack.worker.pid)
    assert [w.name for w in Worker.all(queue=queue)] == [name]
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 256, "ignore_eos": True}
    started: list[set[str]] = []
    results: list[dict] = []

    def post() -> None:
        results.append(requests.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30).json())

    threads = [threading.Thread(target=post) for _ in range(3)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        started.append(set(queue.started_job_registry.get_job_ids()))
    ids = {r["id"] for r in results}
    assert len(ids) == 3
    assert any(ids <= seen for seen in started)  # all three started at once
    wait_for(lambda: all(fetch(redis_conn, i).get_status() == JobStatus.FINISHED for i in ids), 10, "finished")
    assert {fetch(redis_conn, i).worker_name for i in ids} == {name}
