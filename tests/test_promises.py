"""Promises the docs make about HTTP, each checked end to end through gunicorn: keep-alive comments
on a waiting stream, U+FFFD for invalid bytes, max_completion_tokens over max_tokens, the request's
timeout capped by e2eTimeout, sandboxed templates, and the API's own SIGTERM drain."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests
from rq.suspension import resume, suspend
from tokenizers import Tokenizer

from schemas.keys import admitted_key
from scripts import localstack

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
# A byte-level token that is a lone UTF-8 continuation byte (0x80) in the demo tokenizer.
CONTINUATION_BYTE = "\u0122"


def test_a_waiting_stream_gets_keep_alive_comments(stack, redis_conn: redis.Redis) -> None:  # type: ignore[no-untyped-def]
    suspend(redis_conn)  # the worker takes nothing: the request waits in the queue
    try:
        response = requests.post(
            f"{stack.base_url}/v1/chat/completions",
            json={**CHAT, "max_tokens": 2, "stream": True},
            stream=True,
            timeout=60,
        )
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(4)]  # the role chunk, its blank line, then a quiet second
        assert seen[0].startswith(b"data: ") and b": keep-alive" in seen[2:]
    finally:
        resume(redis_conn)
    rest = list(lines)
    assert rest[-2:] == [b"data: [DONE]", b""] or rest[-1] == b"data: [DONE]"


def test_bytes_that_are_not_utf_8_arrive_as_u_fffd(stack, demo_model: Path) -> None:  # type: ignore[no-untyped-def]
    token = Tokenizer.from_file(str(demo_model / "tokenizer.json")).token_to_id(CONTINUATION_BYTE)
    body = {**CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {str(token): 100}}
    response = requests.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30)
    # Four lone continuation bytes: four U+FFFD. None of them can begin a character, so none is held
    # back, nor dropped at the end as a character cut short by max_tokens would be.
    assert response.json()["choices"][0]["message"]["content"] == "\ufffd" * 4


def test_max_completion_tokens_wins_over_max_tokens(stack) -> None:  # type: ignore[no-untyped-def]
    body = {**CHAT, "max_tokens": 6, "max_completion_tokens": 3, "ignore_eos": True}
    response = requests.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.fixture(scope="module")
def strict_api(
    stack, stack_env: dict[str, str], demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A second API on the shared worker: e2eTimeout 2 s, and a chat template that tries to escape its
    sandbox (the template is the API's: the worker is the same)."""
    logs = tmp_path_factory.mktemp("strict")
    model = logs / "demo"
    shutil.copytree(demo_model, model)
    (model / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    # No maxIterTimes: a request may ask for more tokens than 2 s can produce.
    env = {**stack_env, "MODEL_PATH": str(model), "TOKENLINE_E2E_TIMEOUT": "2", "TOKENLINE_MAX_ITER_TIMES": ""}
    with localstack.running_api(env, logs / "api.log") as url:
        yield url


def test_a_requests_own_timeout_is_capped_by_e2e_timeout(strict_api: str) -> None:
    body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "timeout": 100}  # asks for 100 s
    started = time.monotonic()
    response = requests.post(f"{strict_api}/generate", json=body, timeout=60)
    elapsed = time.monotonic() - started
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    assert 2 <= elapsed < 5, elapsed


def test_a_template_cannot_reach_python_internals(strict_api: str) -> None:
    response = requests.post(f"{strict_api}/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "is unsafe" in error["message"]


def stream_through_a_sigterm(env: dict[str, str], max_tokens: int, log: Path) -> tuple[int, str, list[bytes], int]:
    """Another API process in front of the session stack's worker: a stream of `max_tokens`, SIGTERM
    to the API once its first chunk is in. The API's port, the request's id, the stream's other data
    lines, and the API's exit code."""
    port = localstack.free_port()
    api = localstack.start_api(env, port, log=log)
    try:
        localstack.wait_for_api(port, api)
        body = {**CHAT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with requests.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json=body, stream=True, timeout=60
        ) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith(b"data: "))
            request_id = json.loads(next(lines)[6:])["id"]
            api.send_signal(signal.SIGTERM)
            rest = list(lines)
        return port, request_id, rest, api.wait(30)
    finally:
        localstack.stop(api)


def test_sigterm_to_the_api_finishes_its_streams_before_it_exits(
    stack, stack_env: dict[str, str], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    port, _, rest, code = stream_through_a_sigterm(stack_env, 200, tmp_path / "api.log")
    assert rest[-1] == b"data: [DONE]"
    finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest[:-1] if b'"finish_reason":"' in line]
    assert finish == ["length"]
    assert code == 0
    with pytest.raises(requests.ConnectionError):  # nothing listens any more
        requests.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_sigterm_while_an_api_process_boots_stops_the_api_in_seconds(stack_env: dict[str, str], tmp_path: Path) -> None:
    """A SIGTERM that came while gunicorn replaced a dead worker process was lost on the new one (it
    booted and served on), and the API took its whole graceful timeout (30 s) to stop."""
    port = localstack.free_port()
    log = tmp_path / "api.log"
    api = localstack.start_api({**stack_env, "WEB_CONCURRENCY": "1"}, port, log=log)
    try:
        localstack.wait_for_api(port, api)
        (first,) = localstack.child_processes(api.pid)
        os.kill(first, signal.SIGKILL)
        localstack.wait_for(lambda: booting(api.pid, first), 10, "a new worker booting", interval=0.01)
        api.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = api.wait(30)
        elapsed = time.monotonic() - started
    finally:
        localstack.stop(api)
    assert code == 0 and elapsed < 10, elapsed


def booting(master: int, gone: int) -> bool:
    """A new worker process of `master` is loading the app: past gunicorn's post_fork, before its own
    signal handlers (it catches no SIGTERM: /proc's SigCgt mask lacks it)."""
    for pid in localstack.child_processes(master):
        if pid == gone:
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if not caught & (1 << (signal.SIGTERM - 1)):
            return True
    return False


def test_a_stream_longer_than_the_apis_graceful_timeout_ends_with_an_error_and_frees_its_place(
    stack, stack_env: dict[str, str], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM (a stop, a reload) gives open requests GUNICORN_GRACEFUL_TIMEOUT; one that would run
    longer ends before it with an error event and [DONE], and its place is given back (gunicorn's kill
    cut it off mid-chunk, and its place stayed taken for queueTimeout + e2eTimeout)."""
    env = {**stack_env, "WEB_CONCURRENCY": "1", "GUNICORN_GRACEFUL_TIMEOUT": "4", "TOKENLINE_MAX_ITER_TIMES": "2000"}
    _, request_id, rest, code = stream_through_a_sigterm(env, 2000, tmp_path / "api.log")
    assert code == 0 and rest[-1] == b"data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert "restarting" in error["message"] and (error["type"], error["code"]) == ("service_unavailable",) * 2
    places = redis.Redis.from_url(stack.redis_url)
    assert places.zscore(admitted_key("demo"), request_id) is None
    places.close()
