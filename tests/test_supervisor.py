"""`make run`'s supervisor with real processes: a killed worker or Redis comes back, and SIGTERM
(to the supervisor, or to `make`) stops everything in order, without tracebacks or leftovers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests

from scripts import localstack
from scripts.run_local import STOP_MARGIN_SECONDS, Supervisor
from tests.chat_runs import first_token

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# The API's graceful timeout in the stop tests: past it, gunicorn's master kills its processes.
API_GRACE = 5


@dataclass
class Supervised:
    proc: subprocess.Popen[bytes]
    url: str
    run_dir: Path
    output: Path

    def pids(self) -> dict[str, int]:
        try:
            return json.loads((self.run_dir / "processes.json").read_text())
        except FileNotFoundError:
            return {}

    def served(self) -> bool:
        try:
            return requests.post(f"{self.url}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        except requests.RequestException:
            return False


def start(
    command: list[str], demo_model: Path | None, tmp_path: Path, config_port: int | None = None, **extra_env: str
) -> Supervised:
    """`make run`'s supervisor serving `demo_model` as "demo" (None: what the environment configures),
    on $PORT, or on `config_port` where the config file sets it (PORT unset)."""
    port = config_port or localstack.free_port()
    env = localstack.environment(TOKENLINE_RUN_DIR=str(tmp_path), **extra_env)
    if config_port is None:
        env["PORT"] = str(port)
    for name in ("REDIS_URL", "MODEL_PATH", "MODEL_NAME", *(("PORT",) if config_port else ())):
        env.pop(name, None)  # the supervisor starts (and restarts) its own Redis
    if demo_model is not None:
        env.update(MODEL_PATH=str(demo_model), MODEL_NAME="demo")
    output = tmp_path / "output.log"
    with open(output, "ab") as log:  # the child keeps its own copy of the file
        proc = subprocess.Popen(
            command, cwd=localstack.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    supervised = Supervised(proc, f"http://127.0.0.1:{port}", tmp_path, output)
    localstack.wait_for(
        lambda: "tokenline is serving" in output.read_text() or proc.poll() is not None, 120, "make run"
    )
    assert proc.poll() is None, output.read_text()[-3000:]
    return supervised


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited: only its parent (init, once the supervisor is gone) has yet to reap it
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:  # reaped since the signal above
        return False


@pytest.fixture
def supervised(demo_model: Path, tmp_path: Path) -> Iterator[Supervised]:
    stack = start([sys.executable, "scripts/run_local.py"], demo_model, tmp_path)
    children = stack.pids()
    try:
        yield stack
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()
            stack.proc.wait()
        for pid in {**children, **stack.pids()}.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_worker_and_a_killed_redis_come_back_and_sigterm_drains_in_order(supervised: Supervised) -> None:
    before = supervised.pids()
    os.kill(before["worker"], signal.SIGKILL)
    localstack.wait_for(
        lambda: supervised.pids().get("worker", before["worker"]) != before["worker"], 10, "a new worker"
    )
    localstack.wait_for(supervised.served, 60, "service after the worker's restart", interval=0.5)

    redis_url = next(
        line.split("Redis: ")[1].rstrip(")") for line in supervised.output.read_text().splitlines() if "Redis: " in line
    )
    os.kill(before["redis"], signal.SIGKILL)
    localstack.wait_for(lambda: supervised.pids().get("redis", before["redis"]) != before["redis"], 10, "a new Redis")
    assert redis.Redis.from_url(redis_url).ping()  # on the same port
    localstack.wait_for(supervised.served, 60, "service after Redis' restart", interval=0.5)

    body = {**CHAT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with requests.post(f"{supervised.url}/v1/chat/completions", json=body, stream=True, timeout=60) as stream:
        lines = stream.iter_lines()
        first_token(lines)  # a worker generates it
        children = supervised.pids()
        supervised.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith(b"data: ")]
    assert rest[-1] == b"data: [DONE]"
    finish = [json.loads(line[6:]) for line in rest[:-1] if b'"finish_reason":"' in line]
    assert finish and finish[-1]["choices"][0]["finish_reason"] == "length"  # drained, not cut
    assert supervised.proc.wait(60) == 0
    output = supervised.output.read_text()
    assert "Traceback" not in output and "Error 111" not in output.split("stopping:")[1]
    assert not any(alive(pid) for name, pid in children.items() if name != "supervisor")
    assert "worker exited with code -9; restarting in 1 s" in output and "redis restarted" in output
    assert (supervised.run_dir / "redis.log").stat().st_size > 0


def test_sigterm_to_make_stops_the_whole_stack(demo_model: Path, tmp_path: Path) -> None:
    """Within the API's graceful timeout and the supervisor's margin for a child (its bound on the
    API's stop): the API's processes have that long to end their connections, whatever else is
    running on the machine."""
    stack = start(
        ["make", "--no-print-directory", "run"], demo_model, tmp_path, GUNICORN_GRACEFUL_TIMEOUT=str(API_GRACE)
    )
    children = stack.pids()
    try:
        assert {"redis", "worker", "api"} <= set(children)
        api_processes = _children(children["api"])
        stack.proc.send_signal(signal.SIGTERM)  # make passes it to its recipe's process, the supervisor
        try:
            stack.proc.wait(API_GRACE + STOP_MARGIN_SECONDS)
        except subprocess.TimeoutExpired:
            left = {pid: _state(pid) for pid in [*children.values(), *api_processes] if alive(pid)}
            pytest.fail(f"make run did not stop: {left}\n{stack.output.read_text()[-3000:]}")
        localstack.wait_for(lambda: not any(alive(pid) for pid in children.values()), 60, "every process to stop")
    finally:
        for pid in children.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_worker_that_fails_at_start_up_ends_make_run_at_once_with_its_reason(tmp_path: Path) -> None:
    """A model the worker cannot serve (a GGUF file of an architecture transformers cannot read): the
    worker exits while starting (and the API, which checks the model's files too: whichever is first),
    and make run says so and stops everything, without waiting for it."""
    from tests.test_gguf import unsupported_gguf

    model = unsupported_gguf(tmp_path / "rwkv.gguf")
    env = localstack.environment(
        MODEL_PATH=str(model), PORT=str(localstack.free_port()), TOKENLINE_RUN_DIR=str(tmp_path)
    )
    env.pop("REDIS_URL", None)
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "scripts/run_local.py"],
        cwd=localstack.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert re.search(r"the (worker exited with code 2|api exited with code 1) while starting", run.stderr)
    assert "architecture rwkv6 is not supported" in run.stderr + run.stdout
    assert time.monotonic() - started < 60
    assert not (tmp_path / "processes.json").exists()  # everything it started has stopped


@pytest.mark.parametrize("broken", ["pickled", "unknown", "template"])
def test_a_model_directory_that_cannot_load_stops_make_run_with_one_line(
    demo_model: Path, tmp_path: Path, broken: str
) -> None:
    """Weights only as a pickle (never loaded), a model_type transformers does not know, or a chat
    template file the settings name that does not compile: one line that says so, no traceback,
    whichever process checks first (the API's gunicorn master, for the template)."""
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    if broken == "pickled":
        for weights in model.glob("*.safetensors"):
            weights.rename(model / "pytorch_model.bin")
        reason = "holds no *.safetensors weights (pytorch_model.bin are pickled weights, which are never loaded)"
    elif broken == "unknown":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "model_type": "foobar"}))
        reason = "model_type 'foobar' is not one that transformers"
    else:
        (tmp_path / "tools.jinja").write_text("{% for m in messages %}")
        reason = f"the chat template in {tmp_path / 'tools.jinja'} does not compile"
    env = localstack.environment(
        MODEL_PATH=str(model), PORT=str(localstack.free_port()), TOKENLINE_RUN_DIR=str(tmp_path / "run")
    )
    if broken == "template":
        env["TOKENLINE_CHAT_TEMPLATE"] = str(tmp_path / "tools.jinja")
    env.pop("REDIS_URL", None)
    run = subprocess.run(
        [sys.executable, "scripts/run_local.py"], cwd=localstack.ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    output = run.stderr + run.stdout
    assert run.returncode == 1 and reason in output, output[-3000:]
    assert "Traceback" not in output


def test_no_process_outlives_a_killed_supervisor(demo_model: Path, tmp_path: Path) -> None:
    """Each child gets SIGTERM when the supervisor dies: the API stops within its graceful timeout
    (API_GRACE; then gunicorn's master kills its processes), the idle worker and Redis at once."""
    stack = start(
        [sys.executable, "scripts/run_local.py"], demo_model, tmp_path, GUNICORN_GRACEFUL_TIMEOUT=str(API_GRACE)
    )
    children = stack.pids()
    try:
        assert {"redis", "worker", "api"} <= set(children)
        api_processes = _children(children["api"])
        stack.proc.kill()  # SIGKILL: no chance to stop anything itself
        stack.proc.wait(10)
        bound = API_GRACE + STOP_MARGIN_SECONDS
        try:
            localstack.wait_for(lambda: not any(alive(pid) for pid in children.values()), bound, "every process to die")
        except TimeoutError:
            left = {name: _state(pid) for name, pid in children.items() if alive(pid)}
            left |= {f"api {pid}": _state(pid) for pid in api_processes if alive(pid)}
            raise AssertionError(f"alive {bound:g} s after: {left}\n{stack.output.read_text()[-3000:]}") from None
    finally:
        for pid in children.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str:
    """A process's command line, the kernel's word for what it waits on and its signal masks (pending,
    blocked, ignored, caught: whether a SIGTERM reached it and what it does with one), for a failure's
    message."""
    with contextlib.suppress(OSError):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        masks = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Sig")]
        return f"{command} (wchan {Path(f'/proc/{pid}/wchan').read_text()}; {', '.join(masks)})"
    return "gone"


def _children(pid: int) -> list[int]:
    """A process's children (gunicorn's master: its worker processes)."""
    with contextlib.suppress(OSError):
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def test_the_process_record_is_never_seen_half_written(tmp_path: Path) -> None:
    # The supervisor rewrites processes.json every poll; tests and scripts read it at any moment.
    supervisor = Supervisor([], None, tmp_path)
    supervisor.record()
    done = threading.Event()

    def rewrite() -> None:
        while not done.is_set():
            supervisor.record()

    writer = threading.Thread(target=rewrite)
    writer.start()
    reads = 0
    try:
        while reads < 5000:
            assert json.loads((tmp_path / "processes.json").read_text()) == {"supervisor": os.getpid()}
            reads += 1
    finally:
        done.set()
        writer.join()
    assert [p.name for p in tmp_path.iterdir()] == ["processes.json"]  # nothing left aside
