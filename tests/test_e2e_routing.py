"""Routing over three real workers of one model, through gunicorn (app/routing.py,
workers/serving/routing.py): a conversation's next turn goes to the worker that holds its history and
reuses it; prompts no worker holds go on the shared queue; a request routed to a worker that is then
killed is served by another, within the dead-worker bound."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import requests
from rq import Queue, Worker
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend

from schemas.blocks import block_keys
from schemas.keys import queue_name, worker_blocks_key, worker_queue_name
from scripts import localstack

MODEL = "routed"
BLOCK = 16  # cacheBlockSize's default
WORKERS = 3


@dataclass
class Fleet:
    url: str
    conn: redis.Redis
    workers: dict[str, subprocess.Popen[bytes]]  # by process name, `<host>.<pid>`


@pytest.fixture(scope="module")
def fleet(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("routing")
    env = {**stack_env, "MODEL_NAME": MODEL}
    procs = [localstack.start_worker(env, MODEL, log=logs / f"worker{i}.log") for i in range(WORKERS)]
    conn = redis.Redis.from_url(env["REDIS_URL"])
    try:
        with localstack.running_api(env, logs / "api.log") as url:
            localstack.wait_for(lambda: localstack.worker_count(env["REDIS_URL"], MODEL) == WORKERS, 120, "3 workers")
            host = socket.gethostname()
            yield Fleet(url, conn, {f"{host}.{p.pid}": p for p in procs})
    finally:
        resume(conn)
        localstack.stop(*procs)
        conn.close()


def complete(fleet: Fleet, prompt: str, max_tokens: int = 8) -> tuple[dict[str, Any], Job]:
    reply = requests.post(
        f"{fleet.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    job = Job.fetch(reply.headers["X-Request-Id"], connection=fleet.conn, serializer=JSONSerializer)
    return reply.json(), job


def served_by(job: Job) -> str:
    return job.worker_name.rsplit(".r", 1)[0]


def published(fleet: Fleet, worker: str, prompt: str) -> bool:
    """The worker has told Redis that its prefix cache holds every block of `prompt` it could reuse."""
    reply = requests.post(f"{fleet.url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=10)
    tokens = reply.json()["tokens"]
    keys = block_keys(tokens[: (len(tokens) - 1) // BLOCK * BLOCK], BLOCK, None)
    return all(fleet.conn.smismember(worker_blocks_key(worker), keys))


def conversation(topic: str) -> str:
    return f"System: you answer questions about {topic}. " + " ".join(f"{topic} fact {i}." for i in range(30))


def test_a_conversations_turns_go_to_the_worker_that_holds_its_history(fleet: Fleet) -> None:
    # `rq info` shows each worker on its own queue first, then the shared one. (A worker's heartbeat,
    # which the fleet waited for, may come a moment before RQ's own record of it.)
    def listening() -> dict[str, list[str]]:
        return {w.name: w.queue_names() for w in Worker.all(connection=fleet.conn) if w.name in fleet.workers}

    expected = {name: [worker_queue_name(MODEL, name), queue_name(MODEL)] for name in fleet.workers}
    localstack.wait_for(lambda: listening() == expected, 10, "every worker in RQ's registry")
    assert listening() == expected
    prompt = conversation("rivers")
    body, first = complete(fleet, prompt)
    assert first.origin == queue_name(MODEL)  # no worker held it: the shared queue
    holder = served_by(first)
    # Each turn goes out as soon as the last answer is in, as an agent sends it: a request's blocks
    # reach Redis before its last event (they waited for the worker's next beat, and the next turn
    # went to the shared queue most of the time).
    for turn in range(3):
        before = body["usage"]["prompt_tokens"]
        prompt += body["choices"][0]["text"] + f" User: and turn {turn}?"
        body, job = complete(fleet, prompt)
        assert (job.origin, served_by(job)) == (worker_queue_name(MODEL, holder), holder)
        # The turn before's prompt came from the cache (all but the block its end may retokenize).
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached % BLOCK == 0 and before - 2 * BLOCK < cached < body["usage"]["prompt_tokens"]


def test_prompts_no_worker_holds_go_on_the_shared_queue(fleet: Fleet) -> None:
    for topic in ("stars", "trees"):
        _, job = complete(fleet, conversation(topic))
        assert job.origin == queue_name(MODEL)


def test_a_request_routed_to_a_worker_that_is_killed_is_served_by_another(fleet: Fleet) -> None:
    prompt = conversation("storms")
    _, first = complete(fleet, prompt)
    holder = served_by(first)
    localstack.wait_for(lambda: published(fleet, holder, prompt), 10, "the blocks published")
    suspend(fleet.conn)  # no worker takes a job: the next turn waits on the holder's queue
    answers: list[requests.Response] = []
    follow_up = threading.Thread(
        target=lambda: answers.append(
            requests.post(
                f"{fleet.url}/v1/completions",
                json={"model": MODEL, "prompt": prompt + " User: more?", "max_tokens": 8},
                timeout=60,
            )
        )
    )
    follow_up.start()
    own_queue = Queue(worker_queue_name(MODEL, holder), connection=fleet.conn)
    localstack.wait_for(lambda: own_queue.count == 1, 10, "the follow-up routed to its holder")
    (routed,) = own_queue.get_job_ids()
    fleet.workers[holder].send_signal(signal.SIGKILL)
    fleet.workers[holder].wait(10)
    killed_at = time.monotonic()
    resume(fleet.conn)
    follow_up.join(30)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    # Served within the dead-worker bound (heartbeat TTL 3 s, checked every second) plus its own time.
    assert time.monotonic() - killed_at < 15
    job = Job.fetch(routed, connection=fleet.conn, serializer=JSONSerializer)
    assert job.origin == queue_name(MODEL) and served_by(job) in set(fleet.workers) - {holder}
