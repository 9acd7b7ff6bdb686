"""Faults injected into a real stack: killed and stopped workers, Redis restarts, floods, timeouts,
slow and vanishing clients. Each test names the fault and asserts the exact outcome.

This module runs its own redis-server (a test restarts it) and its own workers and APIs, under model
names of their own, so nothing here disturbs the session stack.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend
from rq.worker import Worker

from schemas.job import JOB_FUNCTION
from schemas.keys import WORKER_HEARTBEAT_TTL, admitted_key, queue_name
from scripts import localstack

pytestmark = pytest.mark.e2e

LONG = 2000  # tokens: several seconds of generation


@dataclass
class FaultRedis:
    port: int
    url: str
    log: Path
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.proc = localstack.start_redis(self.port, log=self.log)

    def hang(self) -> None:
        """Stop the server without closing its connections: what a network partition looks like."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def fault_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultRedis]:
    port = localstack.free_port()
    log = tmp_path_factory.mktemp("fault-redis") / "redis.log"
    server = FaultRedis(port, f"redis://127.0.0.1:{port}/0", log, localstack.start_redis(port, log=log))
    yield server
    localstack.stop(server.proc)


@pytest.fixture()
def conn(fault_redis: FaultRedis) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(fault_redis.url)
    yield connection
    connection.close()


def environment(demo_model: Path, fault_redis: FaultRedis, model: str, **overrides: str) -> dict[str, str]:
    defaults = {"TOKENLINE_MAX_BATCH_SIZE": "2", "TOKENLINE_MAX_ITER_TIMES": str(LONG)}
    return localstack.environment(
        MODEL_PATH=str(demo_model),
        MODEL_NAME=model,
        REDIS_URL=fault_redis.url,
        TOKENLINE_DEVICE="cpu",
        TOKENLINE_LOG_LEVEL="INFO",
        **{**defaults, **overrides},
    )


@contextmanager
def worker(env: dict[str, str], logs: Path, name: str = "worker") -> Iterator[subprocess.Popen[bytes]]:
    proc = localstack.start_worker(env, env["MODEL_NAME"], log=logs / f"{name}.log")
    try:
        registered(env, proc, logs / f"{name}.log")
        yield proc
    finally:
        localstack.stop(proc)


@contextmanager
def worker_and_api(env: dict[str, str], logs: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A worker and an API, started side by side (the API comes up while the worker loads), both up."""
    proc = localstack.start_worker(env, env["MODEL_NAME"], log=logs / "worker.log")
    try:
        with api(env, logs) as url:
            registered(env, proc, logs / "worker.log")
            yield proc, url
    finally:
        localstack.stop(proc)


def registered(env: dict[str, str], proc: subprocess.Popen[bytes], log: Path) -> None:
    """Wait until the worker has registered with RQ; fail with its log if it exited first."""
    localstack.wait_for(
        lambda: localstack.worker_count(env["REDIS_URL"], env["MODEL_NAME"]) > 0 or proc.poll() is not None,
        60,
        f"worker {log.stem}",
    )
    assert proc.poll() is None, log.read_text()[-3000:]


def api(env: dict[str, str], logs: Path, name: str = "api") -> AbstractContextManager[str]:
    return localstack.running_api(env, logs / f"{name}.log")


def chat(max_tokens: int = LONG, stream: bool = True, **extra: object) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }


def with_model(body: dict, model: str) -> dict:
    return {**body, "model": model}


class Stream:
    """An SSE stream read line by line on its own thread, with arrival times."""

    def __init__(self, url: str, body: dict) -> None:
        self.response = requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=120)
        self.data: list[tuple[float, str]] = []
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self.response.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    self.data.append((time.monotonic(), line[len("data: ") :]))
        except (requests.RequestException, AttributeError, ValueError):
            pass  # the test closed the response under this thread
        finally:
            self.ended.set()

    @property
    def id(self) -> str:
        return json.loads(self.data[0][1])["id"]

    def contents(self) -> int:
        return sum(1 for _, d in self.data if '"content":"' in d and '"content":""' not in d)

    def error(self) -> dict | None:
        for _, data in self.data:
            if data.startswith('{"error"'):
                return json.loads(data)["error"]
        return None

    def usage(self) -> dict:
        return json.loads(self.data[-2][1])["usage"]

    @property
    def done(self) -> bool:
        return bool(self.data) and self.data[-1][1] == "[DONE]"


def job(conn: redis.Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def ended_with(conn: redis.Redis, job_id: str) -> object:
    """The job's result once it has one (finished or failed), else None."""
    try:
        found = job(conn, job_id)
    except Exception:
        return None
    if found.get_status() in (JobStatus.FINISHED, JobStatus.FAILED):
        return found.latest_result()
    return None


# --- workers die or stop ---------------------------------------------------------------------------


def test_kill_9_mid_stream_ends_every_affected_request_with_an_error_and_fails_the_job(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, tmp_path: Path
) -> None:
    env = environment(demo_model, fault_redis, "doomed")
    with worker_and_api(env, tmp_path) as (proc, url):
        stream = Stream(url, with_model(chat(), "doomed"))
        non_stream: list[requests.Response] = []
        waiter = threading.Thread(
            target=lambda: non_stream.append(
                requests.post(f"{url}/v1/chat/completions", json=with_model(chat(stream=False), "doomed"), timeout=60)
            )
        )
        waiter.start()
        localstack.wait_for(lambda: stream.contents() >= 5, 30, "the stream to flow")
        localstack.wait_for(lambda: len(StartedJobRegistry(queue_name("doomed"), connection=conn)) == 2, 30, "2 jobs")
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        assert stream.ended.wait(WORKER_HEARTBEAT_TTL + 5)
        waiter.join(WORKER_HEARTBEAT_TTL + 5)
        noticed = stream.data[-2][0] - killed_at

    # The stream: an error event, then [DONE], within the heartbeat TTL and one check interval.
    assert stream.error()["code"] == "worker_lost"
    assert stream.done
    assert noticed <= WORKER_HEARTBEAT_TTL + 2, noticed
    # The JSON request: 502 in the error envelope.
    assert non_stream[0].status_code == 502
    assert non_stream[0].json()["error"]["code"] == "worker_lost"
    # RQ: failed with the reason, out of the started registry, not retried.
    failed = FailedJobRegistry(queue_name("doomed"), connection=conn, serializer=JSONSerializer)
    assert stream.id in failed.get_job_ids()
    assert job(conn, stream.id).get_status() == JobStatus.FAILED
    assert "WorkerLost" in job(conn, stream.id).latest_result().exc_string
    assert len(StartedJobRegistry(queue_name("doomed"), connection=conn)) == 0
    assert Queue(queue_name("doomed"), connection=conn).count == 0


def test_kill_9_mid_prefill_ends_the_request_with_an_error_within_5_s(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, tmp_path: Path
) -> None:
    """The job is started in RQ before the engine sees it, so a worker killed while it prefills a long
    prompt (one thread: a few hundred milliseconds) leaves a started job whose worker is dead."""
    env = environment(
        demo_model, fault_redis, "prefilling", TOKENLINE_MAX_ITER_TIMES="16", TOKENLINE_PREFILL_THREADS="1"
    )
    started = StartedJobRegistry(queue_name("prefilling"), connection=conn)
    with worker_and_api(env, tmp_path) as (proc, url):
        body = {
            **with_model(chat(max_tokens=8), "prefilling"),
            "messages": [{"role": "user", "content": "hello " * 1900}],
        }
        stream = Stream(url, body)
        localstack.wait_for(lambda: len(started) == 1, 30, "the job to start", interval=0.002)
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        tokens_before_the_kill = stream.contents()
        assert stream.ended.wait(10)
    assert tokens_before_the_kill == 0  # it died in the prefill
    assert stream.error()["code"] == "worker_lost" and stream.done
    assert stream.data[-2][0] - killed_at <= 5
    assert job(conn, stream.id).get_status() == JobStatus.FAILED


def test_requests_for_a_model_whose_last_worker_died_get_503_within_5_s(
    demo_model: Path, fault_redis: FaultRedis, tmp_path: Path
) -> None:
    """Queued or arriving after a kill -9 of the only worker: nobody will take them, so 503 with
    Retry-After, within 5 s of the death (heartbeat-based), not after queueTimeout."""
    env = environment(demo_model, fault_redis, "lonely")
    with worker_and_api(env, tmp_path) as (proc, url):
        running_streams = [Stream(url, with_model(chat(), "lonely")) for _ in range(2)]  # both slots
        localstack.wait_for(lambda: all(s.contents() > 0 for s in running_streams), 30, "both slots busy")
        queued = Stream(url, with_model(chat(), "lonely"))
        localstack.wait_for(lambda: queued.data, 10, "the queued request's first chunk")
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        arriving = requests.post(f"{url}/v1/chat/completions", json=with_model(chat(stream=False), "lonely"))
        arriving_took = time.monotonic() - killed_at
        assert queued.ended.wait(10)
        queued_took = queued.data[-2][0] - killed_at
        for stream in running_streams:
            assert stream.ended.wait(10)
    assert arriving.status_code == 503
    assert arriving.json()["error"]["code"] == "no_worker"
    assert arriving.headers["Retry-After"] == "5"
    assert arriving_took <= 5, arriving_took
    assert queued.error()["code"] == "no_worker" and queued.done
    assert queued_took <= 5, queued_took
    assert [s.error()["code"] for s in running_streams] == ["worker_lost"] * 2


def test_rq_suspend_pauses_taking_new_requests_and_rq_resume_serves_them(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, tmp_path: Path
) -> None:
    env = environment(demo_model, fault_redis, "pausable")
    with worker_and_api(env, tmp_path) as (_, url):
        suspend(conn)
        try:
            paused = Stream(url, with_model(chat(max_tokens=4), "pausable"))
            localstack.wait_for(lambda: paused.data, 10, "the request's first chunk")
            # Queued, not taken, while RQ says the workers are suspended.
            assert not paused.ended.wait(3)
            assert job(conn, paused.id).get_status() == JobStatus.QUEUED
            assert paused.contents() == 0
        finally:
            resume(conn)
        assert paused.ended.wait(30)
    assert paused.error() is None and paused.done and paused.contents() > 0
    assert job(conn, paused.id).get_status() == JobStatus.FINISHED


def test_a_burst_worker_serves_what_is_queued_then_exits(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, tmp_path: Path
) -> None:
    env = environment(demo_model, fault_redis, "burst")
    queue = Queue(queue_name("burst"), connection=conn, serializer=JSONSerializer)
    sampling = {"max_tokens": 5, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "ignore_eos": True}
    sampling |= {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    listener = conn.pubsub()  # an API process's place: a worker drops requests whose events reach no one
    listener.subscribe("tokenline:reply:burst")
    jobs = [
        queue.enqueue(
            JOB_FUNCTION,
            {
                "v": 1,
                "request_id": f"burst-{i}",
                "model": "burst",
                "prompt_token_ids": [5, 6, 7],
                "n": 1,
                "reply_channel": "tokenline:reply:burst",
                "sampling": sampling,
            },
            job_id=f"burst-{i}",
        )
        for i in range(2)
    ]
    proc = localstack.start_worker(env, "burst", log=tmp_path / "burst.log", extra_args=("--burst",))
    # The worker serves the queue to its end and exits, cleanly.
    try:
        assert proc.wait(60) == 0
    finally:
        listener.close()
    assert [j.get_status() for j in jobs] == [JobStatus.FINISHED] * 2
    assert [j.return_value()["usage"]["completion_tokens"] for j in jobs] == [5, 5]
    assert "stopped" in (tmp_path / "burst.log").read_text()
    assert Worker.all(queue=queue) == []  # the worker left RQ's worker registry


def test_sigterm_drains_in_flight_requests_and_takes_no_new_ones(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, tmp_path: Path
) -> None:
    env = environment(demo_model, fault_redis, "draining")
    with worker_and_api(env, tmp_path) as (proc, url):
        body = chat(max_tokens=300, stream_options={"include_usage": True})
        stream = Stream(url, with_model(body, "draining"))
        localstack.wait_for(lambda: stream.contents() >= 3, 30, "the stream to flow")
        proc.send_signal(signal.SIGTERM)
        # The draining worker has left the live set: a new request is refused at once.
        localstack.wait_for(lambda: localstack.worker_count(fault_redis.url, "draining") == 0, 5, "live set")
        refused = requests.post(f"{url}/v1/chat/completions", json=with_model(chat(stream=False), "draining"))
        assert stream.ended.wait(60)
        assert proc.wait(30) == 0
    assert stream.error() is None
    assert stream.usage()["completion_tokens"] == 300 and stream.done
    assert job(conn, stream.id).get_status() == JobStatus.FINISHED
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_worker"
    assert refused.headers["Retry-After"] == "5"


def test_sigterm_past_the_grace_period_fails_what_is_left(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, tmp_path: Path
) -> None:
    env = environment(demo_model, fault_redis, "hurried", TOKENLINE_SHUTDOWN_GRACE="1")
    with worker_and_api(env, tmp_path) as (proc, url):
        stream = Stream(url, with_model(chat(), "hurried"))
        localstack.wait_for(lambda: stream.contents() >= 3, 30, "the stream to flow")
        proc.send_signal(signal.SIGTERM)
        assert stream.ended.wait(30)
        assert proc.wait(30) == 0
    assert stream.error()["message"] == "The worker shut down before this request finished."
    assert stream.done
    assert job(conn, stream.id).get_status() == JobStatus.FAILED


def test_a_model_without_a_live_worker_answers_503_at_once(
    demo_model: Path, fault_redis: FaultRedis, tmp_path: Path
) -> None:
    env = environment(demo_model, fault_redis, "orphan")
    with api(env, tmp_path) as url:
        started = time.monotonic()
        response = requests.post(f"{url}/v1/chat/completions", json=with_model(chat(stream=False), "orphan"))
        elapsed = time.monotonic() - started
        health = requests.get(f"{url}/health").json()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_worker"
    assert response.headers["Retry-After"] == "5"
    assert elapsed < 2, elapsed
    assert health["workers"] == {"orphan": 0}


# --- one steady worker (two slots) for the rest --------------------------------------------------


@pytest.fixture(scope="module")
def steady(demo_model: Path, fault_redis: FaultRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A worker serving model "steady"; its logs directory. The tests start the APIs they need."""
    logs = tmp_path_factory.mktemp("steady")
    with worker(environment(demo_model, fault_redis, "steady"), logs):
        yield logs


def idle(conn: redis.Redis) -> None:
    """Wait until the steady worker has nothing queued or running (an earlier test's cancels settle)."""
    registry = StartedJobRegistry(queue_name("steady"), connection=conn)
    queue = Queue(queue_name("steady"), connection=conn)
    localstack.wait_for(lambda: queue.count == 0 and len(registry) == 0, 60, "the steady worker to be idle")


def finished_ids(conn: redis.Redis) -> set[str]:
    return set(FinishedJobRegistry(queue_name("steady"), connection=conn).get_job_ids())


def test_a_flood_over_the_cap_gets_429s_and_no_job_is_lost_or_doubled(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, steady: Path, tmp_path: Path
) -> None:
    idle(conn)
    env = environment(demo_model, fault_redis, "steady", TOKENLINE_MAX_LINK_NUM="4")
    body = with_model(chat(max_tokens=32, stream=False), "steady")
    before = finished_ids(conn)
    results: list[tuple[int, float, dict, dict]] = []

    def post() -> None:
        started = time.monotonic()
        response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        results.append((response.status_code, time.monotonic() - started, dict(response.headers), response.json()))

    with api(env, tmp_path) as url:
        threads = [threading.Thread(target=post) for _ in range(24)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 24
    assert len(ok) >= 4 and refused
    for _, elapsed, headers, error in refused:
        assert error["error"]["code"] == "rate_limit_exceeded"
        assert headers["Retry-After"] == "1"
        assert elapsed < 1.0, elapsed  # refused before anything is queued
    # Every admitted request ran exactly once; no refused one left a job behind.
    answered = {r[3]["id"] for r in ok}
    assert len(answered) == len(ok)
    # RQ records a job as finished just after its last event is published: wait for the bookkeeping.
    localstack.wait_for(lambda: finished_ids(conn) - before == answered, 10, "every answered job finished")
    assert Queue(queue_name("steady"), connection=conn).count == 0


def test_prompts_of_one_completions_request_are_admitted_all_or_none(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, steady: Path, tmp_path: Path
) -> None:
    idle(conn)
    env = environment(demo_model, fault_redis, "steady", TOKENLINE_MAX_LINK_NUM="4")
    body = {"model": "steady", "max_tokens": 2, "temperature": 0}
    with api(env, tmp_path) as url:
        too_many = requests.post(f"{url}/v1/completions", json={**body, "prompt": ["a"] * 5}, timeout=30)
        streams = [Stream(url, with_model(chat(), "steady")) for _ in range(2)]  # two places held
        localstack.wait_for(lambda: all(s.contents() for s in streams), 30, "two streams to run")
        over = requests.post(f"{url}/v1/completions", json={**body, "prompt": ["a", "b", "c"]}, timeout=30)
        for stream in streams:  # their places come back (and the worker's batch of two frees)
            stream.response.close()
        places = admitted_key("steady")
        localstack.wait_for(lambda: conn.zcard(places) == 0, 10, "the streams' places to come back")
        fits = requests.post(f"{url}/v1/completions", json={**body, "prompt": ["a", "b"]}, timeout=30)
    # More prompts than the cap can never run: a 400, not a 429 to retry.
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt", too_many.text
    # Over what is free: a 429 before any prompt's job is queued (none started, then was cancelled).
    assert over.status_code == 429 and over.headers["Retry-After"] == "1"
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
    queued = [line for line in (tmp_path / "api.log").read_text().splitlines() if "queued request_id=cmpl-" in line]
    assert len(queued) == 2, queued  # the two prompts that fit, nothing of the refused three


def test_a_request_that_waits_past_the_queue_timeout_gets_503_and_never_runs(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, steady: Path, tmp_path: Path
) -> None:
    idle(conn)
    env = environment(demo_model, fault_redis, "steady", TOKENLINE_QUEUE_TIMEOUT="1")
    with api(env, tmp_path) as url:
        busy = [Stream(url, with_model(chat(), "steady")) for _ in range(2)]  # both slots
        localstack.wait_for(lambda: all(s.contents() > 0 for s in busy), 30, "both slots busy")
        started = time.monotonic()
        waiting = Stream(url, with_model(chat(max_tokens=8), "steady"))
        plain = requests.post(f"{url}/v1/chat/completions", json=with_model(chat(8, stream=False), "steady"))
        assert waiting.ended.wait(10)
        elapsed = time.monotonic() - started
        for stream in busy:
            stream.response.close()
    # Not streamed: a plain 503 in the error envelope, with Retry-After.
    assert plain.status_code == 503 and plain.headers["Retry-After"] == "1"
    assert plain.json()["error"]["code"] == "queue_timeout"
    assert waiting.error()["code"] == "queue_timeout"
    assert waiting.done
    assert 1 <= elapsed < 3, elapsed
    # Once the slots free up, the withdrawn job is never started: it expired with its queue TTL.
    idle(conn)
    assert not Job.exists(waiting.id, connection=conn)
    assert waiting.id not in finished_ids(conn)
    assert "cancel failed" not in (tmp_path / "api.log").read_text()  # an expired job is no failure


def test_the_end_to_end_timeout_cancels_on_the_worker(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, steady: Path, tmp_path: Path
) -> None:
    idle(conn)
    env = environment(demo_model, fault_redis, "steady", TOKENLINE_E2E_TIMEOUT="30")
    with api(env, tmp_path) as url:
        # The request's own limit, below the server's.
        stream = Stream(url, with_model(chat(timeout=0.5), "steady"))
        assert stream.ended.wait(10)
        blocking = requests.post(
            f"{url}/v1/chat/completions", json=with_model(chat(stream=False, timeout=0.5), "steady"), timeout=30
        )
    assert stream.error()["code"] == "timeout" and stream.done
    assert 0.5 <= stream.data[-2][0] - stream.data[0][0] + 0.05 < 3
    assert blocking.status_code == 504
    assert blocking.json()["error"]["code"] == "timeout"
    # Logged with its id, which the access log's line carries too.
    request_id = blocking.headers["X-Request-Id"]
    log = (tmp_path / "api.log").read_text()
    assert f"request ended with an error request_id={request_id}: 504 " in log
    assert re.search(rf'"POST /v1/chat/completions HTTP/1.1" 504 \d+ .* request_id={request_id}\n', log)
    # The worker dropped it: the job ends as cancelled, long before its 2000 tokens.
    localstack.wait_for(lambda: ended_with(conn, stream.id) is not None, 10, "the job to end")
    assert job(conn, stream.id).return_value() == {"finish_reason": "cancelled"}


def test_a_slow_reader_is_cancelled_past_its_buffer_and_others_do_not_wait(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, steady: Path, tmp_path: Path
) -> None:
    idle(conn)
    env = environment(demo_model, fault_redis, "steady", TOKENLINE_STREAM_BUFFER="32")
    with api(env, tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        solo_started = time.monotonic()
        requests.post(f"{url}/v1/chat/completions", json=with_model(chat(64, stream=False), "steady"), timeout=60)
        solo = time.monotonic() - solo_started
        idle(conn)  # RQ may still be recording the solo job as finished: the next started job is the slow one
        # A client that sends its request, then never reads: a tiny receive window, soon full.
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", port))
        body = json.dumps(with_model(chat(), "steady")).encode()
        slow.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            localstack.wait_for(lambda: len(StartedJobRegistry(queue_name("steady"), connection=conn)) == 1, 30, "slow")
            (slow_id,) = StartedJobRegistry(queue_name("steady"), connection=conn).get_job_ids()
            # Meanwhile another client is served at its usual pace.
            other_started = time.monotonic()
            other = requests.post(
                f"{url}/v1/chat/completions", json=with_model(chat(64, stream=False), "steady"), timeout=60
            )
            other_took = time.monotonic() - other_started
            # The slow one fell 32 events behind and was cancelled on the worker.
            localstack.wait_for(lambda: ended_with(conn, slow_id) is not None, 60, "the slow request to end")
        finally:
            slow.close()
    assert other.status_code == 200
    assert other_took < 3 * solo + 0.5, (other_took, solo)
    assert job(conn, slow_id).return_value() == {"finish_reason": "cancelled"}
    assert "client too slow" in (tmp_path / "api.log").read_text()


def test_a_hundred_clients_leaving_mid_stream_then_normal_service(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, steady: Path, tmp_path: Path
) -> None:
    idle(conn)
    env = environment(demo_model, fault_redis, "steady")
    with api(env, tmp_path) as url:

        def leave() -> None:
            response = requests.post(f"{url}/v1/chat/completions", json=with_model(chat(), "steady"), stream=True)
            next(response.iter_lines())  # the role chunk (queued ones) or a first token
            response.close()

        threads = [threading.Thread(target=leave) for _ in range(100)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        # Every one of them is dropped: running ones at the next step, queued ones before they start.
        registry = StartedJobRegistry(queue_name("steady"), connection=conn)
        localstack.wait_for(
            lambda: Queue(queue_name("steady"), connection=conn).count == 0 and len(registry) == 0, 60, "all dropped"
        )
        started = time.monotonic()
        answer = requests.post(f"{url}/v1/chat/completions", json=with_model(chat(16, stream=False), "steady"))
        took = time.monotonic() - started
        health = requests.get(f"{url}/health").json()
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 16
    assert took < 2, took
    assert health["workers"] == {"steady": 1}


def refusals(url: str, count: int) -> list[float]:
    """Seconds each of `count` requests took to be refused (503 with Retry-After: Redis is away)."""
    seconds = []
    for _ in range(count):
        began = time.monotonic()
        body = with_model(chat(8, stream=False), "steady")
        refused = requests.post(f"{url}/v1/chat/completions", json=body, timeout=15)
        seconds.append(time.monotonic() - began)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
    return seconds


def stored_refusals(url: str, count: int) -> list[float]:
    """Seconds each of `count` reads of stored responses (a retrieve, a follow-up, in turn) took to be
    refused (503 with Retry-After: Redis is away)."""
    seconds = []
    stored_id = f"resp_{uuid.uuid4().hex}"
    for i in range(count):
        began = time.monotonic()
        if i % 2:
            body = {"model": "steady", "input": "hi", "previous_response_id": stored_id}
            refused = requests.post(f"{url}/v1/responses", json=body, timeout=15)
        else:
            refused = requests.get(f"{url}/v1/responses/{stored_id}", timeout=15)
        seconds.append(time.monotonic() - began)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
    return seconds


def served(url: str) -> bool:
    body = with_model(chat(8, stream=False), "steady")
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_a_redis_restart_during_traffic_gives_errors_and_503s_then_service_resumes(
    demo_model: Path, fault_redis: FaultRedis, steady: Path, conn: redis.Redis, tmp_path: Path
) -> None:
    env = environment(demo_model, fault_redis, "steady")
    idle(conn)
    with api(env, tmp_path) as url:
        stream = Stream(url, with_model(chat(), "steady"))
        answers: list[requests.Response] = []
        waiting = threading.Thread(
            target=lambda: answers.append(
                requests.post(f"{url}/v1/chat/completions", json=with_model(chat(stream=False), "steady"), timeout=60)
            )
        )
        waiting.start()
        started = StartedJobRegistry(queue_name("steady"), connection=conn)
        localstack.wait_for(lambda: stream.contents() >= 3 and len(started) == 2, 30, "both requests to run")
        fault_redis.kill()
        try:
            assert stream.ended.wait(10)
            waiting.join(10)
            down = requests.post(f"{url}/v1/chat/completions", json=with_model(chat(8, stream=False), "steady"))
            health = requests.get(f"{url}/health")
            seconds = refusals(url, 9)  # while Redis stays away, each request is refused at once
        finally:
            fault_redis.restart()
        # Neither the API nor the worker is restarted.
        localstack.wait_for(lambda: served(url), 30, "service to resume", interval=0.5)
        streamed = Stream(url, with_model(chat(8), "steady"))
        assert streamed.ended.wait(30)
        # The worker fills its whole batch again (maxBatchSize 2): the slot its RQ loop held for the
        # next job when Redis went is not lost with that loop (it was: one job at a time after this).
        together = [Stream(url, with_model(chat(), "steady")) for _ in range(2)]
        localstack.wait_for(lambda: all(s.contents() >= 3 for s in together), 30, "both long streams to run")
        assert not any(s.ended.is_set() for s in together)
        for each in together:
            each.response.close()
    assert stream.error()["code"] == "generation_failed" and stream.done
    (answer,) = answers  # not streamed: a 503 to retry, as every request meets while Redis is away
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1", answer.text
    assert answer.json()["error"]["code"] == "generation_failed"
    # Their clients were told: the worker drops both generations (their events were lost) instead of
    # running them to their 2,000 tokens for no one.
    worker_log = steady / "worker.log"
    for request_id in (stream.id, answer.headers["X-Request-Id"]):
        ended = f"end request_id={request_id} "
        localstack.wait_for(lambda ended=ended: ended in worker_log.read_text(), 30, "the orphaned generation's end")
        assert f"{ended}cancelled" in worker_log.read_text()
    assert down.status_code == 503 and down.headers["Retry-After"] == "1"
    assert down.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 503 and health.json() == {"status": "unavailable", "redis": "unavailable"}
    assert streamed.error() is None and streamed.done
    assert sorted(seconds)[4] < 0.1 and max(seconds) < 0.5  # the median within 100 ms
    log = (tmp_path / "api.log").read_text()
    # Logged once per API process (there are WEB_CONCURRENCY of them), not per request; no traceback.
    assert 1 <= log.count("Redis is unavailable") <= int(env.get("WEB_CONCURRENCY", "2"))
    assert log.count("Redis is back") >= 1 and "Traceback" not in log


def test_a_hung_redis_ends_requests_in_seconds_and_service_resumes_when_it_answers_again(
    demo_model: Path, fault_redis: FaultRedis, steady: Path, conn: redis.Redis, tmp_path: Path
) -> None:
    """A Redis that stops answering but keeps its connections open (stopped, or cut off by the network)
    is found away by the relay's pings within seconds (app/relay.py STALL_SECONDS), and by a command
    within REDIS_COMMAND_TIMEOUT; it was waited on for minutes."""
    env = environment(demo_model, fault_redis, "steady")
    idle(conn)
    with api(env, tmp_path) as url:
        stream = Stream(url, with_model(chat(), "steady"))
        answers: list[tuple[requests.Response, float]] = []

        def wait_for_answer() -> None:
            body = with_model(chat(stream=False), "steady")
            answers.append((requests.post(f"{url}/v1/chat/completions", json=body, timeout=60), time.monotonic()))

        waiting = threading.Thread(target=wait_for_answer)
        waiting.start()
        started = StartedJobRegistry(queue_name("steady"), connection=conn)
        localstack.wait_for(lambda: stream.contents() >= 3 and len(started) == 2, 30, "both requests to run")
        # A stored response's stream (queued behind the two): it ends with response.failed, unstored.
        stored = requests.post(
            f"{url}/v1/responses", json={"model": "steady", "input": "hi", "stream": True}, stream=True, timeout=60
        )
        stored_lines = stored.iter_lines()
        assert next(stored_lines) == b"event: response.created"
        fault_redis.hang()
        hung = time.monotonic()
        try:
            assert stream.ended.wait(15)
            stream_ended = time.monotonic() - hung
            waiting.join(15)
            stored_events = [line for line in stored_lines if line.startswith(b"event: ")]  # a cut read raises
            health = requests.get(f"{url}/health", timeout=15)
            away = requests.get(f"{url}/metrics", timeout=15).text
            seconds = refusals(url, 7)  # once an API process knows Redis is away, it refuses at once
            # So do the routes that read stored responses (each waited for a command's timeout, 2 s).
            stored_seconds = stored_refusals(url, 6)
        finally:
            fault_redis.resume()
        localstack.wait_for(lambda: served(url), 30, "service to resume", interval=0.5)
        back = requests.get(f"{url}/metrics", timeout=15).text
        # Their places were released while Redis hung (a release that failed held the place for
        # queueTimeout + e2eTimeout, and enough of them made the model answer 429 to everything).
        localstack.wait_for(lambda: conn.zcard(admitted_key("steady")) == 0, 10, "the places given back")
    assert stream.error()["code"] == "generation_failed" and stream.done
    assert stored_events[-1] == b"event: response.failed"
    # A ping's interval and STALL_SECONDS after it; no round trip to the hung Redis after.
    assert stream_ended < 6, stream_ended
    ((answer, answered),) = answers
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1", answer.text
    assert answered - hung < 8
    assert health.status_code == 503 and health.json() == {"status": "unavailable", "redis": "unavailable"}
    # An alert can see the outage: the workers' metrics are absent then, not zero.
    assert "\ntokenline:redis_up 0.0\n" in away and "tokenline:live_workers{" not in away
    assert "\ntokenline:redis_up 1.0\n" in back and "tokenline:live_workers{" in back
    # A process that had not yet met the hung Redis waits for one command's REDIS_COMMAND_TIMEOUT (2 s).
    assert sorted(seconds)[3] < 0.1 and max(seconds) < 3, seconds
    assert sorted(stored_seconds)[3] < 0.1 and max(stored_seconds) < 3, stored_seconds
    log = (tmp_path / "api.log").read_text()
    assert "Redis is unavailable" in log and "Redis is back" in log and "Traceback" not in log


def test_a_stream_whose_api_process_was_killed_is_dropped_by_its_worker(
    demo_model: Path, fault_redis: FaultRedis, steady: Path, conn: redis.Redis, tmp_path: Path
) -> None:
    """A killed API process (gunicorn's worker, SIGKILL) leaves no one on its reply channel: its
    worker's next PUBLISH reaches no receiver, and the generation is dropped instead of running to its
    2,000 tokens for no one."""
    env = {**environment(demo_model, fault_redis, "steady"), "WEB_CONCURRENCY": "1"}
    idle(conn)
    port = localstack.free_port()
    master = localstack.start_api(env, port, log=tmp_path / "api.log")
    try:
        localstack.wait_for_api(port, master)
        stream = Stream(f"http://127.0.0.1:{port}", with_model(chat(), "steady"))
        localstack.wait_for(lambda: stream.contents() >= 3, 30, "the stream to run")
        (process,) = localstack.child_processes(master.pid)
        os.kill(process, signal.SIGKILL)
        assert stream.ended.wait(10)
        worker_log = steady / "worker.log"
        ended = f"end request_id={stream.id} "
        localstack.wait_for(lambda: ended in worker_log.read_text(), 60, "the generation's end")
    finally:
        localstack.stop(master)
    assert f"{ended}cancelled" in worker_log.read_text()
    assert f"request_id={stream.id}: no API process listens on" in worker_log.read_text()
    # The dead process could not give its place under maxLinkNum back; the worker did.
    assert conn.zscore(admitted_key("steady"), stream.id) is None


def test_an_api_process_that_did_not_run_for_seconds_finds_redis_as_it_left_it(
    demo_model: Path, fault_redis: FaultRedis, steady: Path, conn: redis.Redis, tmp_path: Path
) -> None:
    """A process that does not run for longer than the relay's stall bound (a request's long CPU work
    on gevent's loop; here SIGSTOP) woke to find its last reply from Redis seconds old and took Redis
    for lost: the requests on it got 503s, and one generating ended with "the connection to Redis was
    lost". Redis's silence now counts from a request it has not answered."""
    env = {**environment(demo_model, fault_redis, "steady"), "WEB_CONCURRENCY": "1"}
    idle(conn)
    port = localstack.free_port()
    url = f"http://127.0.0.1:{port}"
    master = localstack.start_api(env, port, log=tmp_path / "api.log")
    try:
        localstack.wait_for_api(port, master)
        assert served(url)  # the relay listens
        (process,) = localstack.child_processes(master.pid)
        os.kill(process, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # Longer than the relay's stall bound (STALL_SECONDS, 2 s).
        localstack.wait_for(lambda: time.monotonic() - stopped_at > 3, 10, "three seconds")
        os.kill(process, signal.SIGCONT)
        stream = Stream(url, with_model(chat(64), "steady"))
        assert stream.ended.wait(60)
    finally:
        localstack.stop(master)
    assert stream.error() is None and stream.done and stream.contents() > 0
    assert "Redis is unavailable" not in (tmp_path / "api.log").read_text()


def test_sigterm_while_redis_is_down_stops_the_worker_in_seconds(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, tmp_path: Path
) -> None:
    env = environment(demo_model, fault_redis, "stranded")
    queue = Queue(queue_name("stranded"), connection=conn)
    with worker(env, tmp_path) as proc:
        localstack.wait_for(lambda: len(Worker.all(queue=queue)) == 1, 30, "the worker in RQ")
        fault_redis.kill()
        try:
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
            elapsed = time.monotonic() - started
        finally:
            fault_redis.restart()
    # Nothing was running: RQ's loop, retrying its connection, stops on the signal; neither the grace
    # period nor a SIGKILL is needed.
    assert code == 0
    assert elapsed < 10, elapsed


def test_a_request_queued_when_a_worker_is_killed_is_served_by_the_other_worker(
    demo_model: Path, fault_redis: FaultRedis, conn: redis.Redis, tmp_path: Path
) -> None:
    """operations.md: a kill -9 loses only what the dead worker had started; a request still queued is
    served by the model's other workers."""
    env = environment(demo_model, fault_redis, "handover", TOKENLINE_MAX_BATCH_SIZE="1")
    queue = Queue(queue_name("handover"), connection=conn)
    with api(env, tmp_path) as url, worker(env, tmp_path, "first") as first:
        doomed = Stream(url, with_model(chat(), "handover"))  # the first worker's only slot
        localstack.wait_for(lambda: doomed.contents() > 0, 30, "the first worker's stream")
        with worker(env, tmp_path, "second"):
            short = Stream(url, with_model(chat(max_tokens=200), "handover"))  # the second worker's slot
            localstack.wait_for(lambda: short.contents() > 0, 30, "the second worker's stream")
            queued = Stream(url, with_model(chat(max_tokens=4), "handover"))
            localstack.wait_for(lambda: queue.count == 1, 10, "a queued job")
            os.kill(first.pid, signal.SIGKILL)
            assert doomed.ended.wait(WORKER_HEARTBEAT_TTL + 3)
            assert queued.ended.wait(60)
    assert doomed.error()["code"] == "worker_lost"
    assert short.error() is None and short.done
    assert queued.error() is None and queued.done and queued.contents() > 0
