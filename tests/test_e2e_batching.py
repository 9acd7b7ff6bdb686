"""Batching, cancellation and n > 1 through the real stack (gunicorn, Redis, RQ, worker process)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from scripts import localstack
from scripts.localstack import wait_for

pytestmark = pytest.mark.e2e


def chat_body(**changes) -> dict:  # type: ignore[no-untyped-def]
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, **changes}


def job(redis_conn, job_id: str) -> Job:  # type: ignore[no-untyped-def]
    return Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)


def test_concurrent_seeded_requests_match_their_solo_answers(openai_client) -> None:
    def ask(seed: int) -> str:
        completion = openai_client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": f"question {seed}"}],
            max_tokens=24,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return completion.choices[0].message.content

    solo = {seed: ask(seed) for seed in range(1, 5)}
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = dict(zip(range(1, 9), pool.map(ask, range(1, 9)), strict=True))
    assert {seed: together[seed] for seed in solo} == solo


def test_concurrent_requests_run_as_one_batch(stack, redis_conn) -> None:
    """Eight long requests at once are all started in RQ together: none waits for another."""
    results: list[requests.Response] = []

    def ask() -> None:
        results.append(
            requests.post(
                f"{stack.base_url}/v1/chat/completions", json=chat_body(max_tokens=200, ignore_eos=True), timeout=60
            )
        )

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    from rq import Queue

    queue = Queue("tokenline.demo", connection=redis_conn, serializer=JSONSerializer)
    wait_for(lambda: queue.started_job_registry.count >= 8, 20, "eight jobs started at once")
    for thread in threads:
        thread.join(60)
    assert [r.status_code for r in results] == [200] * 8


def ask_n(client, n: int, **kwargs):  # type: ignore[no-untyped-def]
    """Six tokens for each of n choices, seeded."""
    return client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=n,
        seed=2,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def test_n_choices_non_stream(openai_client) -> None:
    completion = ask_n(openai_client, 3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in completion.choices)
    assert len({c.message.content for c in completion.choices}) == 3
    assert completion.usage.completion_tokens == 18


def test_n_choices_stream_carries_each_choice_index(openai_client) -> None:
    chunks = list(ask_n(openai_client, 2, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    whole = ask_n(openai_client, 2)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == 12


@pytest.fixture(scope="module")
def one_slot(demo_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second model name served by a worker with a single batch slot, behind its own API."""
    logs = tmp_path_factory.mktemp("one-slot")
    env = localstack.environment(
        MODEL_PATH=str(demo_model),
        MODEL_NAME="demo-b1",
        REDIS_URL=redis_url,
        TOKENLINE_MAX_BATCH_SIZE="1",
        TOKENLINE_MAX_ITER_TIMES="2000",
        TOKENLINE_DEVICE="cpu",
    )
    port = localstack.free_port()
    worker = localstack.start_worker(env, "demo-b1", log=logs / "worker.log")
    api = localstack.start_api(env, port, log=logs / "api.log")
    try:
        localstack.wait_for_api(port, api)
        wait_for(lambda: localstack.worker_count(redis_url, "demo-b1") > 0, 60, "the one-slot worker")
        yield f"http://127.0.0.1:{port}"
    finally:
        localstack.stop(api, worker)


LONG = 2000  # tokens: several seconds of generation on the demo model, far longer than a heartbeat


def long_body(stream: bool) -> dict:
    return {
        "model": "demo-b1",
        "messages": [{"role": "user", "content": "hold"}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }


def open_stream(base_url: str, body: dict) -> tuple[requests.Response, str]:
    """Start a stream and read its first chunk; return the response and the request id.

    The line iterator is kept on the response: closing it (as garbage) would close the connection,
    and the server would rightly take that for a hang-up.
    """
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, stream=True, timeout=30)
    response.lines = response.iter_lines()  # type: ignore[attr-defined]
    first = next(line for line in response.lines if line)  # type: ignore[attr-defined]
    return response, first.decode().split('"id":"')[1].split('"')[0]


def queue_of_one_slot(redis_conn):  # type: ignore[no-untyped-def]
    from rq import Queue

    return Queue("tokenline.demo-b1", connection=redis_conn, serializer=JSONSerializer)


def test_a_queued_stream_whose_client_left_never_runs(one_slot: str, redis_conn) -> None:
    holder, holder_id = open_stream(one_slot, long_body(stream=True))
    holder_job = job(redis_conn, holder_id)
    wait_for(lambda: holder_job.get_status() == JobStatus.STARTED, 10, "the holder to take the only slot")
    waiting, request_id = open_stream(one_slot, {**long_body(stream=True), "max_tokens": 8})
    queued = job(redis_conn, request_id)
    assert queued.get_status() == JobStatus.QUEUED
    waiting.close()
    # The API's watch on the socket sees the hang-up, takes the job off the queue and cancels it in RQ.
    wait_for(lambda: queued.get_status() == JobStatus.CANCELED, 5, "the queued job to be cancelled")
    assert request_id not in queue_of_one_slot(redis_conn).job_ids
    holder.close()
    wait_for(lambda: holder_job.get_status() == JobStatus.FINISHED, 30, "the holder's job to be settled")
    assert holder_job.return_value() == {"finish_reason": "cancelled"}
    assert job(redis_conn, request_id).worker_name is None  # no worker ever took it


def test_a_non_stream_client_that_times_out_is_cancelled(one_slot: str, redis_conn) -> None:
    queue = queue_of_one_slot(redis_conn)
    before = set(queue.finished_job_registry.get_job_ids())
    with pytest.raises(requests.Timeout):
        requests.post(f"{one_slot}/v1/chat/completions", json=long_body(stream=False), timeout=0.5)
    wait_for(lambda: set(queue.finished_job_registry.get_job_ids()) - before, 10, "the abandoned job to end")
    (job_id,) = set(queue.finished_job_registry.get_job_ids()) - before
    assert job(redis_conn, job_id).return_value() == {"finish_reason": "cancelled"}


def test_disconnect_frees_the_slot_for_the_next_request(one_slot: str, redis_conn) -> None:
    response, request_id = open_stream(one_slot, long_body(stream=True))
    response.close()
    left = job(redis_conn, request_id)
    wait_for(lambda: left.get_status() == JobStatus.FINISHED, 10, "the left request to end")
    assert left.return_value() == {"finish_reason": "cancelled"}
    short = {"model": "demo-b1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert requests.post(f"{one_slot}/v1/chat/completions", json=short, timeout=30).status_code == 200
