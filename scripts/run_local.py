"""`make run`: Redis, one worker and the API on 127.0.0.1:$PORT, supervised.

- A process that dies is started again: the worker and the API with a backoff (1 s, doubling to 30 s,
  back to 1 s once it has run for a minute), Redis at once on the same port. While the worker is away
  the API answers 503 (`no_worker`) and its requests end with an error; while Redis is away it answers
  503 at once.
- Ctrl-C or SIGTERM (to this process, or to `make`, which it watches) stops everything in order: the
  API stops accepting, the worker drains its requests (`shutdownGrace`), then Redis stops. The children
  run in sessions of their own, so the terminal's Ctrl-C reaches only this supervisor, and they get
  SIGTERM when it dies however it dies (a SIGKILL of the `make` group too): nothing outlives it.
- While the stack starts, a child that exits ends `make run` at once with its name and exit code (its
  own output above says why), and Ctrl-C stops the start.
- Redis writes its log to $TOKENLINE_RUN_DIR/redis.log; the supervisor keeps the children's process
  ids in $TOKENLINE_RUN_DIR/processes.json (default directory: .run/).

`make run-https` (--https) puts nginx from deploy/nginx in front, on https://127.0.0.1:$HTTPS_PORT
(default 8443; plain HTTP on $HTTP_PORT, default 8080, redirects there), with a self-signed
certificate made under .run/https/certs; it prints the CA file that clients must trust.

Honours MODEL_PATH and MODEL_NAME, TOKENLINE_CONFIG (MindIE's config.json or the flat form: one worker
per model its ModelConfig names, unless MODEL_PATH names one), REDIS_URL (an existing Redis, not
supervised; otherwise one is started on a free port) and PORT (default: the config file's port, else
8000; the API listens on 127.0.0.1 whatever HOST says: this is the development stack). With neither MODEL_PATH
nor a ModelConfig it serves the demo model.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import localstack

if TYPE_CHECKING:
    from schemas.config import Settings

DEMO_MODEL = localstack.ROOT / "models" / "demo"
FIRST_BACKOFF, MAX_BACKOFF, STEADY_SECONDS = 1.0, 30.0, 60.0
START_SECONDS = 300.0  # a worker loads its model (and may compile its decode step) before it serves
POLL_SECONDS = 0.2
STOP_MARGIN_SECONDS = 10.0  # past its own bound, a stopping child is killed
PR_SET_PDEATHSIG = 1


def say(message: str) -> None:
    print(f"tokenline: {message}", flush=True)


@dataclass
class Child:
    """One supervised process and when it may be started again."""

    name: str
    launch: Callable[[], subprocess.Popen[bytes]]
    backoff: float = 0.0  # seconds before a restart; 0 for Redis (at once)
    on_exit: Callable[[int], None] | None = None  # called with the pid of a process that died
    stop_seconds: float | None = None  # how long it may take to stop; None: the shutdown's grace
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float | None = None
    delay: float = 0.0

    def start(self) -> None:
        self.proc = self.launch()
        self.started = time.monotonic()
        self.restart_at = None

    def check(self) -> None:
        """Notice an exit and schedule the restart; start it when its time has come."""
        now = time.monotonic()
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.start()
                say(f"{self.name} restarted (pid {self.proc.pid})")  # type: ignore[union-attr]
            return
        if self.proc is None or self.proc.poll() is None:
            return
        if now - self.started > STEADY_SECONDS or not self.delay:
            self.delay = self.backoff
        else:
            self.delay = min(self.delay * 2, MAX_BACKOFF)
        say(f"{self.name} exited with code {self.proc.returncode}; restarting in {self.delay:g} s")
        self.restart_at = now + self.delay
        if self.on_exit is not None:
            self.on_exit(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop within {timeout:g} s; killing it")
            self.proc.kill()
            self.proc.wait()


class Supervisor:
    def __init__(self, children: list[Child], redis: Child | None, run_dir: Path) -> None:
        self.children = children  # stopped first, in this order
        self.redis = redis  # stopped last
        self.run_dir = run_dir
        self.stopping = False

    def all(self) -> list[Child]:
        return [*self.children, *([self.redis] if self.redis else [])]

    def record(self) -> None:
        pids = {c.name: c.proc.pid for c in self.all() if c.proc is not None and c.proc.poll() is None}
        # Written aside and renamed over the old record: a reader never sees it half written.
        state = self.run_dir / "processes.json"
        partial = state.with_name(f".{state.name}.{os.getpid()}")
        partial.write_text(json.dumps({"supervisor": os.getpid(), **pids}))
        os.replace(partial, state)

    def run(self) -> None:
        while not self.stopping:
            for child in self.all():
                child.check()
            self.record()
            time.sleep(POLL_SECONDS)

    def wait_started(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        """Until `ready()`: RuntimeError naming a child that exits meanwhile (its own output says why),
        TimeoutError past `timeout`; returns at once when a stop is asked for."""
        deadline = time.monotonic() + timeout
        while not self.stopping:
            for child in self.all():
                if child.proc is not None and child.proc.poll() is not None:
                    raise RuntimeError(f"the {child.name} exited with code {child.proc.returncode} while starting")
            if ready():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(POLL_SECONDS)

    def shutdown(self, grace: float) -> None:
        """The API and the worker get SIGTERM (the API stops accepting and finishes its streams, the
        worker drains); Redis outlives them, so that nothing they do on the way out fails."""
        for child in self.children:
            child.stop()
        for child in self.children:
            child.wait((grace if child.stop_seconds is None else child.stop_seconds) + STOP_MARGIN_SECONDS)
        if self.redis is not None:
            self.redis.stop()
            self.redis.wait(10)
        (self.run_dir / "processes.json").unlink(missing_ok=True)


def release_leases(env: dict[str, str], pid: int) -> None:
    """A dead worker's device lease is given back at once (it would block its successor for the
    lease's TTL)."""
    import redis

    from schemas.config import load_settings
    from schemas.keys import process_name
    from workers.ops.lease import release_dead_owner

    settings = load_settings(env)
    node = settings.node or socket.gethostname()
    connection = redis.Redis.from_url(settings.redis_url)
    try:
        owner = process_name(socket.gethostname(), pid)
        released = release_dead_owner(connection, node, settings.npu_device_ids, owner)
        if released:
            say(f"released the dead worker's lease on device {', '.join(map(str, released))}")
    except redis.RedisError:
        pass  # the lease expires by itself
    finally:
        connection.close()


def exit_with_parent() -> None:
    """SIGTERM this process when its parent (`make`) dies, so `kill <make>` stops the stack too."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: Ctrl-C and SIGTERM here still work
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def served_models(environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The names of the models to serve and the environment for their processes: MODEL_PATH's model,
    else those of TOKENLINE_CONFIG's ModelConfig, else the demo model (built if missing)."""
    from schemas.config import load_settings
    from schemas.model_files import default_model_name

    if not environ.get("MODEL_PATH"):
        configured = load_settings(environ, require_model=False).models
        if configured:
            return [m.name for m in configured], environ
        if not (DEMO_MODEL / "config.json").is_file():
            from scripts.build_demo_model import main as build

            build([str(DEMO_MODEL)])
        environ = {**environ, "MODEL_PATH": str(DEMO_MODEL), "MODEL_NAME": environ.get("MODEL_NAME") or "demo"}
    name = environ.get("MODEL_NAME") or default_model_name(Path(environ["MODEL_PATH"]))
    return [name], {**environ, "MODEL_NAME": name}


def accelerator_present() -> bool:
    """Whether this host has an Ascend NPU or an NVIDIA GPU (their device files), without importing torch."""
    dev = Path("/dev")
    return any(dev.glob("davinci[0-9]*")) or any(dev.glob("nvidia[0-9]*"))


def devices_for(settings: Settings) -> tuple[dict[str, str], str | None]:
    """What the workers' environment needs so that each can have its devices: nothing when
    npuDeviceIds has enough for every model's worldSize (each worker leases its own, `auto`) or a
    device is named; on a host without an accelerator, the CPU for all (`TOKENLINE_DEVICE=cpu`: the
    leases would leave all but the first worker waiting for a device no one frees); with an
    accelerator, the reason the start stops."""
    needed = sum(model.world_size for model in settings.models)
    have = len(settings.npu_device_ids)
    if settings.device != "auto" or needed <= have:
        return {}, None
    if settings.accelerator not in ("", "cpu") or (not settings.accelerator and accelerator_present()):
        return {}, (
            f"the models need {needed} devices and npuDeviceIds names {have}: give each model its own "
            "(MindIE: one group per model), or set TOKENLINE_DEVICE"
        )
    return {"TOKENLINE_DEVICE": "cpu"}, None


def main(argv: list[str] | None = None) -> int:
    from schemas.config import ConfigError, load_settings

    https = "--https" in (sys.argv[1:] if argv is None else argv)
    run_dir = Path(os.environ.get("TOKENLINE_RUN_DIR") or localstack.ROOT / ".run")
    run_dir.mkdir(parents=True, exist_ok=True)
    exit_with_parent()
    stop_requested = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        supervisor.stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)

    redis_url = os.environ.get("REDIS_URL")
    redis = None
    if not redis_url:
        redis_port = localstack.free_port()
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        redis = Child("redis", lambda: localstack.start_redis(redis_port, run_dir / "redis.log", session=True))
    try:
        models, env = served_models(localstack.environment(REDIS_URL=redis_url))
        settings = load_settings(env)
        grace = settings.shutdown_grace
        port = settings.port  # $PORT, else the config file's (MindIE's ServerConfig.port), else 8000
    except ConfigError as exc:
        print(f"tokenline: {exc}", file=sys.stderr)
        return 2
    device_env, short = devices_for(settings)
    if short:
        print(f"tokenline: {short}", file=sys.stderr)
        return 2
    if device_env:
        say("no accelerator here and fewer device ids than the models need: the workers run on the CPU")
        env = {**env, **device_env}
    demo = env.get("MODEL_PATH") == str(DEMO_MODEL)
    workers = [
        Child(
            "worker" if len(models) == 1 else f"worker-{name}",
            lambda name=name: localstack.start_worker(env, name, session=True),  # type: ignore[misc]
            FIRST_BACKOFF,
            on_exit=lambda pid: release_leases(env, pid),
        )
        for name in models
    ]
    api = Child("api", lambda: localstack.start_api(env, port, session=True), FIRST_BACKOFF)
    # A stopping API finishes its streams for up to gunicornGracefulTimeout and waits for idle client
    # connections for up to gunicornKeepalive (docs/operations.md): it is not killed sooner.
    api.stop_seconds = max(grace, settings.gunicorn_graceful_timeout, settings.gunicorn_keepalive)
    supervisor = Supervisor([api, *workers], redis, run_dir)
    nginx = None
    try:
        for child in supervisor.all()[::-1]:  # Redis first
            child.start()
        supervisor.record()
        supervisor.wait_started(lambda: localstack.api_up(port), f"the API on port {port}", START_SECONDS)
        for name in models:
            up = lambda n=name: localstack.worker_count(redis_url, n) > 0  # noqa: E731
            supervisor.wait_started(up, f"the worker of {name}", START_SECONDS)
        if supervisor.stopping:
            return 0
        names = ", ".join(f"'{name}'" for name in models)
        print(f"\ntokenline is serving {names} at http://127.0.0.1:{port}  (Redis: {redis_url})")
        if https:
            https_port = int(os.environ.get("HTTPS_PORT", "8443"))
            http_port = int(os.environ.get("HTTP_PORT", "8080"))
            nginx, ca_file = localstack.start_nginx(run_dir / "https", port, https_port, http_port, session=True)
            print(
                f"nginx serves it at https://127.0.0.1:{https_port} (http://127.0.0.1:{http_port} redirects there)\n"
                f"CA file to trust: {ca_file}\n"
                f"  curl --cacert {ca_file} https://127.0.0.1:{https_port}/v1/models"
            )
        if demo:
            print(
                "This is the demo model: random weights, its output is noise. To serve real weights:\n"
                "  MODEL_PATH=/path/to/hf-model-dir MODEL_NAME=my-model make run"
            )
        print("Ctrl-C stops everything.\n", flush=True)
        supervisor.run()
        return 0
    except (TimeoutError, RuntimeError) as exc:
        if not stop_requested:
            print(f"tokenline: {exc}", file=sys.stderr)
            return 1
        return 0
    finally:
        say("stopping: the API and the worker first, then Redis")
        # nginx last: its SIGTERM closes every connection, and the API's streams finish through it.
        supervisor.shutdown(grace)
        localstack.stop(nginx)
        say("stopped")


if __name__ == "__main__":
    sys.exit(main())
