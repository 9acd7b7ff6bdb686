"""`python -m workers`: load settings, lease and resolve the device, load the model once, serve its queue.

This is a worker's engine process: it holds the device lease, the model, the engine thread
(workers/runtime.py), which takes the model's jobs off its RQ queue (workers/taker.py), and the
heartbeat. It starts the worker's queue process (workers/slots.py), whose RQ slot threads perform the
jobs taken, handed over a socket pair (workers/link.py), so that RQ's bookkeeping never takes turns
with the decode steps for this interpreter.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import redis

from schemas.config import ConfigError, ModelConfig, Settings, load_settings
from schemas.keys import WORKER_HEARTBEAT_INTERVAL
from workers.heartbeat import Heartbeat, process_name
from workers.lease import DeviceBusy, DeviceLease, lease_any, lease_one

if TYPE_CHECKING:
    from workers.runtime import Runtime

# After a drain's grace period, the queue process gets this long to record its failed jobs.
QUEUE_EXIT_SECONDS = 5.0
# If the queue process dies, the engine fails its requests and waits this long for them to be published.
LOST_QUEUE_FAIL_SECONDS = 2.0
# libgomp (torch's OpenMP on Linux) lets a thread that finished its share of a parallel region spin
# for 300,000 rounds (milliseconds) before it sleeps. After a prefill on two threads, that spinning
# held the core that the API needed to relay the first token. This many rounds still spans the gaps
# between one forward pass's parallel regions. A GOMP_SPINCOUNT in the environment wins.
GOMP_SPIN_COUNT = "10000"


def set_process_defaults() -> None:
    """Environment defaults the libraries read once, as they load: set before torch is imported."""
    # A torch-npu install without CANN breaks `import torch` unless backend autoload is off;
    # the NPU is loaded explicitly in workers.device instead. No hub access, ever.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPIN_COUNT)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--model", help="model name from the settings (default: the first model)")
    parser.add_argument(
        "--device",
        default=os.environ.get("TOKENLINE_DEVICE", "auto"),
        help="auto: lease a free id of npuDeviceIds through Redis and use it (NPU, then CUDA, then CPU); "
        "or cpu, cuda:N, npu:N (env TOKENLINE_DEVICE)",
    )
    parser.add_argument(
        "--node",
        default=os.environ.get("TOKENLINE_NODE") or socket.gethostname(),
        help="the host whose devices the leases name; workers on one host must agree (env TOKENLINE_NODE)",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=float(os.environ.get("TOKENLINE_DEVICE_LEASE_TTL", "15")),
        help="seconds a dead worker's device stays leased (env TOKENLINE_DEVICE_LEASE_TTL)",
    )
    parser.add_argument(
        "--dtype",
        default=os.environ.get("TOKENLINE_DTYPE", "auto"),
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights dtype; auto = the checkpoint's on accelerators, float32 on CPU (env TOKENLINE_DTYPE)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("TOKENLINE_TORCH_THREADS", "0")),
        help="torch intra-op threads; 0 keeps torch's default (env TOKENLINE_TORCH_THREADS)",
    )
    parser.add_argument(
        "--prefill-threads",
        type=int,
        default=int(os.environ.get("TOKENLINE_PREFILL_THREADS", "0")),
        help="torch threads for a prefill of >= 64 prompt tokens, or on an idle engine whose last step ended "
        "under 10 ms ago; 0 uses --threads (env TOKENLINE_PREFILL_THREADS)",
    )
    parser.add_argument(
        "--forward",
        default=os.environ.get("TOKENLINE_FORWARD", "auto"),
        choices=("auto", "transformers"),  # workers.forward.FORWARDS, which would import torch too early
        help="the forward pass: auto = tokenline's own for Llama-shaped models, else transformers'; "
        "transformers = always transformers' (env TOKENLINE_FORWARD)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=float(os.environ.get("TOKENLINE_SHUTDOWN_GRACE", "30")),
        help="seconds in-flight requests get to finish after SIGTERM (env TOKENLINE_SHUTDOWN_GRACE)",
    )
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    return parser.parse_args(argv)


def start_up(who: str) -> Settings | None:
    """The settings, and logging configured from them; None (after saying why) when they are invalid."""
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"{who}: {exc}", file=sys.stderr)
        return None
    logging.basicConfig(
        level=settings.log_level, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = start_up("tokenline worker")
    if settings is None:
        return 2
    model = settings.model(args.model) if args.model else settings.models[0]
    if model is None:
        print(f"tokenline worker: model {args.model!r} is not configured", file=sys.stderr)
        return 2
    set_process_defaults()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        lease = claim_device(settings, args, stop)
    except DeviceBusy as exc:
        print(f"tokenline worker: {exc}", file=sys.stderr)
        return 2
    except redis.RedisError as exc:
        print(f"tokenline worker: cannot lease a device, Redis at {settings.redis_url} failed: {exc}", file=sys.stderr)
        return 1
    try:
        return 0 if stop.is_set() else serve(settings, model, args, stop)
    finally:
        if lease is not None:
            lease.release()


def claim_device(settings: Settings, args: argparse.Namespace, stop: threading.Event) -> DeviceLease | None:
    """Lease the device before torch starts; `auto` also narrows the visible devices to the leased one."""
    connection = redis.Redis.from_url(settings.redis_url)
    owner = process_name()
    kind, _, index = args.device.partition(":")
    if args.device == "auto":
        lease = lease_any(connection, args.node, settings.npu_device_ids, owner, args.lease_ttl, stop)
        if lease is None:  # stopped while waiting
            return None
        # Set before torch_npu / CUDA initialise: the leased device becomes npu:0 / cuda:0 in this process.
        os.environ["ASCEND_RT_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"] = str(lease.device_id)
    elif kind in ("npu", "cuda") and index.isdigit():
        lease = lease_one(connection, args.node, int(index), owner, args.lease_ttl)
    else:
        return None
    lease.start_renewing(on_lost=lambda _: stop.set())
    logging.getLogger("workers").info("leased device %r", lease)
    return lease


def serve(settings: Settings, model: ModelConfig, args: argparse.Namespace, stop: threading.Event) -> int:
    import torch

    from schemas.keys import queue_name
    from workers import link
    from workers.device import resolve_device
    from workers.engine import Engine
    from workers.model import load_model
    from workers.runtime import Runtime
    from workers.taker import Taker

    logger = logging.getLogger("workers")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 2
    loaded = load_model(model.path, device, args.dtype)
    ours, theirs = link.socket_pair()
    connection = redis.Redis.from_url(settings.redis_url)
    runtime = Runtime(
        Engine(loaded, settings.max_seq_len, settings.max_batch_size, args.prefill_threads, forward=args.forward),
        connection,
        ours,
        Taker(connection, queue_name(model.name), name=f"{process_name()}.taker"),
        burst=args.burst,
    )
    runtime.start()
    heartbeat = Heartbeat(runtime.connection, model.name, str(device))
    heartbeat.beat()  # before the slots register with RQ: a worker that RQ lists is also healthy
    queue_process = start_queue_process(model.name, heartbeat.process, theirs, args.burst)
    logger.info(
        "serving model=%s queue=%s device=%s slots=%d queue process pid=%d",
        model.name,
        queue_name(model.name),
        device,
        settings.max_batch_size,
        queue_process.pid,
    )
    while not stop.wait(WORKER_HEARTBEAT_INTERVAL) and queue_process.poll() is None:
        heartbeat.beat()
    if queue_process.poll() is not None and not stop.is_set() and not (args.burst and queue_process.returncode == 0):
        logger.error("the queue process exited with %s; the worker stops", queue_process.returncode)
        runtime.abort_all("The worker's queue process stopped before this request finished.")
        runtime.aborted.wait(LOST_QUEUE_FAIL_SECONDS)
        heartbeat.end()
        return 1
    drain(queue_process, runtime, heartbeat, args.grace)
    return 0


def start_queue_process(model: str, process: str, end: socket.socket, burst: bool) -> subprocess.Popen[bytes]:
    """`python -m workers.slots` with its end of the link; it shares this process's stdout and stderr."""
    command = [sys.executable, "-m", "workers.slots", "--model", model, "--process", process]
    command += ["--fd", str(end.fileno())] + (["--burst"] if burst else [])
    try:
        return subprocess.Popen(command, pass_fds=(end.fileno(),), stdin=subprocess.DEVNULL)
    finally:
        end.close()


def drain(queue_process: subprocess.Popen[bytes], runtime: Runtime, heartbeat: Heartbeat, grace: float) -> None:
    """Take no new jobs; let the running ones finish within `grace` seconds; fail what is left; leave."""
    logger = logging.getLogger("workers")
    logger.info("draining: %d requests in flight, %gs grace", len(runtime.tracked), grace)
    if queue_process.poll() is None:
        runtime.drain()  # the queue process stops taking jobs, and exits once its jobs have ended
    deadline = time.monotonic() + grace
    while queue_process.poll() is None and time.monotonic() < deadline:
        heartbeat.beat(serving=False)  # alive, so the API keeps waiting, but no longer admitting for us
        wait_process(queue_process, WORKER_HEARTBEAT_INTERVAL)
    if queue_process.poll() is None:
        logger.warning("grace period over: failing %d requests still running", len(runtime.tracked))
        runtime.abort_all("The worker shut down before this request finished.")
        if not wait_process(queue_process, QUEUE_EXIT_SECONDS):
            queue_process.kill()
            queue_process.wait()
    heartbeat.end()
    logger.info("stopped")


def wait_process(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True
