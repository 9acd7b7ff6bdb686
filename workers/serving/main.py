"""`python -m workers`: load settings, lease and resolve the device, load the model once, serve its queue.

One process per device: the main thread runs RQ's worker loop (workers/serving/intake.py), which
hands each job to the engine thread (workers/serving/loop.py); the publisher thread sends the events
and records each job's end in RQ; the beacon thread keeps the worker's heartbeat. SIGTERM or Ctrl-C
is RQ's warm shutdown: no new jobs, the running ones get `shutdownGrace` seconds, then fail.

A model with worldSize N > 1 is served by a group: this process is rank 0 (all of the above, and the
engine over the group, workers/models/parallel.py); it starts ranks 1..N-1 as `python -m workers
--rank R ...` (`follow_group`), which only run the steps it sends, and the group ends as one.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

import redis

from schemas.config import DTYPES, ConfigError, ModelConfig, Settings, load_settings, log_config_notes
from schemas.keys import WORKER_HEARTBEAT_INTERVAL
from schemas.model_files import ModelFiles, ModelFilesError
from workers.ops.heartbeat import Heartbeat, process_name
from workers.ops.lease import DeviceBusy, DeviceLease, GroupLease, lease_any, lease_group, lease_one

if TYPE_CHECKING:
    from workers.engine.core import CacheConfig
    from workers.models.loader import LoadedModel
    from workers.models.parallel import Collective
    from workers.ops.group import Followers
    from workers.ops.metrics import WorkerMetrics
    from workers.serving.loop import EngineLoop
    from workers.serving.publisher import Publisher

logger = logging.getLogger("workers")

# libgomp (torch's OpenMP on Linux) lets a thread that finished its share of a parallel region spin
# for 300,000 rounds before it sleeps, holding a core that the API needs. This many rounds still spans
# the gaps between one forward pass's parallel regions. A GOMP_SPINCOUNT in the environment wins.
GOMP_SPIN_COUNT = "10000"
# A started job's RQ Execution is refreshed this often (schemas/ledger.py keeps it 60 s).
EXECUTION_BEAT_SECONDS = 10.0
# After the grace period, the requests still running are failed; their error events get this long.
ABORT_FLUSH_SECONDS = 5.0
# While Redis is unreachable, RQ's loop is started again after this long.
RQ_RESTART_SECONDS = 1.0
# A tensor-parallel group: how long the other ranks get to leave after rank 0's stop, and how long
# the engine gets to fail the requests after a rank died before rank 0 exits at once.
GROUP_LEAVE_SECONDS = 10.0
GROUP_ABORT_SECONDS = 2.0
# A started job's hash is kept this long (the request's own limit, e2eTimeout, ends it sooner).
JOB_KEEP_SECONDS = 24 * 3600


def set_process_defaults() -> None:
    """Environment defaults the libraries read once, as they load: set before torch is imported."""
    # A torch-npu install without CANN breaks `import torch` unless backend autoload is off;
    # the NPU is loaded explicitly in workers.models.device instead. No hub access, ever.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPIN_COUNT)


def parse_args(argv: list[str] | None, settings: Settings) -> argparse.Namespace:
    """Command-line flags override the settings (whose defaults come from the config file and env)."""
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--model", help="model name from the settings (default: the first model)")
    parser.add_argument(
        "--device",
        default=settings.device,
        help="auto: lease a free id of npuDeviceIds through Redis and use it (NPU, then CUDA, then CPU); "
        "or cpu, cuda:N, npu:N (setting `device`, env TOKENLINE_DEVICE)",
    )
    parser.add_argument(
        "--node",
        default=settings.node or socket.gethostname(),
        help="the host whose devices the leases name; workers on one host must agree (env TOKENLINE_NODE)",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=settings.device_lease_ttl,
        help="seconds a dead worker's device stays leased (env TOKENLINE_DEVICE_LEASE_TTL)",
    )
    parser.add_argument(
        "--dtype",
        default=settings.dtype,
        choices=DTYPES,
        help="weights dtype; auto = the checkpoint's on accelerators, float32 on CPU (env TOKENLINE_DTYPE)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=settings.torch_threads,
        help="torch threads for decode steps; 0: half the cores on a CPU, torch's default on an accelerator "
        "(env TOKENLINE_TORCH_THREADS)",
    )
    parser.add_argument(
        "--prefill-threads",
        type=int,
        default=settings.prefill_threads,
        help="torch threads for large prefills; 0: every core on a CPU (env TOKENLINE_PREFILL_THREADS)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=settings.shutdown_grace,
        help="seconds in-flight requests get to finish after SIGTERM (env TOKENLINE_SHUTDOWN_GRACE)",
    )
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    # A tensor-parallel group's other ranks, as rank 0 starts them (workers/ops/group.py).
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--group-address", default="", help=argparse.SUPPRESS)
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
    settings = start_up("tokenline worker")
    if settings is None:
        return 2
    args = parse_args(argv, settings)
    if not args.rank:  # once per worker, not per rank
        log_config_notes(settings)
    model = settings.model(args.model) if args.model else settings.models[0]
    if model is None:
        print(f"tokenline worker: model {args.model!r} is not configured", file=sys.stderr)
        return 2
    try:
        ModelFiles.of(model.path).check()  # readable (a GGUF file's derived now, before any device is leased)
    except ModelFilesError as exc:
        print(f"tokenline worker: model {model.name}: {exc}", file=sys.stderr)
        return 2
    set_process_defaults()
    if args.rank:
        return follow_group(settings, model, args)
    if model.world_size > 1 and args.device not in ("auto", "cpu"):
        print(
            f"tokenline worker: model {model.name} has worldSize {model.world_size}: its device group comes from "
            "npuDeviceIds with --device auto (or use --device cpu)",
            file=sys.stderr,
        )
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # until RQ's loop installs its own handlers
        signal.signal(signum, lambda *_: stop.set())
    try:
        lease = claim_device(settings, args, stop, model.world_size)
    except (DeviceBusy, ConfigError) as exc:
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


def claim_device(
    settings: Settings, args: argparse.Namespace, stop: threading.Event, world: int = 1
) -> DeviceLease | GroupLease | None:
    """Lease the device (a group of `world` devices for a tensor-parallel model) before torch starts;
    `auto` also narrows the visible devices to the leased ones."""
    connection = redis.Redis.from_url(settings.redis_url)
    owner = process_name()
    kind, _, index = args.device.partition(":")
    lease: DeviceLease | GroupLease | None
    if args.device == "auto" and world > 1:
        lease = lease_group(connection, args.node, settings.groups_of(world), owner, args.lease_ttl, stop)
        if lease is None:
            return None
        # Rank r of the group uses npu:r / cuda:r, the group's r-th device.
        visible = ",".join(map(str, lease.device_ids))
        os.environ["ASCEND_RT_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"] = visible
    elif args.device == "auto":
        lease = lease_any(connection, args.node, settings.npu_device_ids, owner, args.lease_ttl, stop)
        if lease is None:  # stopped while waiting
            return None
        # Set before torch_npu / CUDA initialise: the leased device becomes npu:0 / cuda:0 in this process.
        os.environ["ASCEND_RT_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"] = str(lease.device_id)
    elif kind in ("npu", "cuda") and index.isdigit():
        lease = lease_one(connection, args.node, int(index), owner, args.lease_ttl)
    else:
        return None
    lease.start_renewing(on_lost=lambda _: _stop_self(stop))
    logger.info("leased device %r", lease)
    return lease


def _stop_self(stop: threading.Event) -> None:
    """From any thread: stop as a SIGTERM would (RQ's loop, once running, owns that signal)."""
    stop.set()
    os.kill(os.getpid(), signal.SIGTERM)


def cache_config(settings: Settings, model: ModelConfig) -> CacheConfig:
    from workers.engine.core import CacheConfig

    return CacheConfig(
        block_size=settings.cache_block_size,
        mem_gib=settings.npu_mem_size if model.npu_mem_size is None else model.npu_mem_size,
        max_prefill_tokens=settings.max_prefill_tokens,
        max_prefill_batch_size=settings.max_prefill_batch_size,
        max_preempt=settings.max_preempt_count,
        prefix_caching=settings.prefix_caching,
        prefill_chunk=settings.prefill_chunk_tokens,
        attention=settings.attention_backend,
        compile=settings.compile,
    )


def serve(settings: Settings, model: ModelConfig, args: argparse.Namespace, stop: threading.Event) -> int:
    """Rank 0: with worldSize > 1 it starts the group's other ranks first and leads them."""
    from workers.models.device import resolve_device
    from workers.models.loader import load_model
    from workers.models.parallel import GroupSpec, NoTensorParallelPlan, check_plan, join_group
    from workers.models.runner import default_threads
    from workers.ops.group import Followers, free_address

    try:
        device = resolve_device(args.device, settings.accelerator)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 2
    world = model.world_size
    decode, prefill = default_threads(device, world)  # the followers are told rank 0's choice
    args.threads, args.prefill_threads = args.threads or decode, args.prefill_threads or prefill
    if world == 1:
        return serve_engine(settings, model, args, stop, load_model(model.path, device, args.dtype))
    try:
        check_plan(model.path, world)
    except NoTensorParallelPlan as exc:
        logger.error("model %s: %s", model.name, exc)
        return 2
    address = free_address()
    devices = ["cpu"] * world if device.type == "cpu" else [f"{device.type}:{r}" for r in range(world)]
    argv = ["--model", model.name, "--dtype", args.dtype, "--threads", str(args.threads)]
    argv += ["--prefill-threads", str(args.prefill_threads)]
    followers = Followers.start(world, argv, address, devices)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world))
    status = 1
    try:
        spec = GroupSpec(0, world, address, settings.group_timeout)
        collective, loaded = join_group(spec, device, model.path, args.dtype, followers.exited)
    except RuntimeError as exc:
        logger.error("the device group did not start: %s", exc)
        followers.stop(timeout=0)
        return 1
    try:
        status = serve_engine(settings, model, args, stop, loaded, collective, followers)
        return status
    finally:
        followers.stop(timeout=GROUP_LEAVE_SECONDS if status == 0 else 0)
        if status == 0:
            collective.close()


def serve_engine(
    settings: Settings,
    model: ModelConfig,
    args: argparse.Namespace,
    stop: threading.Event,
    loaded: LoadedModel,
    collective: Collective | None = None,
    followers: Followers | None = None,
) -> int:
    from rq import Queue
    from rq.serializers import JSONSerializer

    from schemas.keys import queue_name
    from workers.engine.core import EngineCore
    from workers.ops.metrics import WorkerMetrics
    from workers.serving.loop import EngineLoop
    from workers.serving.publisher import Publisher

    world, device = model.world_size, loaded.device
    core = EngineCore.build(
        loaded,
        settings.max_seq_len,
        settings.max_batch_size,
        args.threads,
        args.prefill_threads,
        cache=cache_config(settings, model),
        collective=collective,
    )
    runner = core.runner
    # The model, tokenizer and libraries are loaded for good: move them out of the garbage collector's
    # reach, so that its full collections, which otherwise walk them all, stay short pauses between steps.
    gc.collect()
    gc.freeze()
    loop = EngineLoop(core, settings.max_batch_size, JOB_KEEP_SECONDS)
    loop.metrics = WorkerMetrics(model.name, process_name())
    loop.on_fatal = lambda: _stop_self(stop)
    publisher = Publisher(redis.Redis.from_url(settings.redis_url), loop)
    publisher.start()
    loop.start(publisher)
    connection = redis.Redis.from_url(settings.redis_url)
    where = str(device) if world == 1 else f"{device}+{world - 1}"
    beacon = Beacon(Heartbeat(connection, model.name, where), loop, connection, loop.metrics)
    beacon.start()
    if followers is not None:
        followers.watch(lambda rank, status: group_lost(loop, beacon, stop, rank, status))
    logger.info(
        "serving model=%s queue=%s device=%s%s max batch=%d threads=%d/%d (decode/prefill)",
        model.name,
        queue_name(model.name),
        device,
        f" (rank 0 of {world}, tensor parallel)" if world > 1 else "",
        settings.max_batch_size,
        runner.threads,
        runner.prefill_threads,
    )
    queue = Queue(queue_name(model.name), connection=connection, serializer=JSONSerializer)
    try:
        if not stop.is_set():
            work(queue, loop, settings.log_level, args.burst, stop)
        # A burst worker has served its queue: its requests end by themselves (a second signal stops it).
        drain(loop, publisher, beacon, float("inf") if args.burst else args.grace)
    except SystemExit:  # a second Ctrl-C or SIGTERM: RQ's cold shutdown
        logger.warning("cold shutdown: failing %d requests", len(loop.inflight))
        loop.abort_all("The worker was stopped before this request finished.")
        settle(loop, publisher, beacon, ABORT_FLUSH_SECONDS)
        return 1
    finally:
        if followers is not None:
            followers.leaving()
        if runner.group is not None and loop.fatal is None:
            runner.group.stop()  # type: ignore[attr-defined]
    if loop.fatal is not None:
        logger.error("stopped: %s", loop.fatal)
        return 1
    return 0


def group_lost(loop: EngineLoop, beacon: Beacon, stop: threading.Event, rank: int, status: int) -> None:
    """A rank of the group exited: fail the group's requests and stop, so that the group restarts whole.
    If the engine thread is stuck in a collective past GROUP_ABORT_SECONDS, leave the live set and exit
    at once: the API fails a dead worker's requests by its heartbeat."""
    logger.error("rank %d of the device group exited (status %s): failing its requests and stopping", rank, status)
    loop.fatal = f"rank {rank} of the device group exited"
    loop.abort_all("A device of the worker's group failed; the worker restarts.")
    _stop_self(stop)
    if not wait_idle(loop, time.monotonic() + GROUP_ABORT_SECONDS):
        logger.error("the engine did not fail its requests within %gs; exiting at once", GROUP_ABORT_SECONDS)
        beacon.heartbeat.end()
        os._exit(1)


def follow_group(settings: Settings, model: ModelConfig, args: argparse.Namespace) -> int:
    """Ranks 1..N-1 of a tensor-parallel group: load this rank's shards, then run the steps rank 0
    sends until it says stop; exit non-zero when the group breaks (rank 0 then restarts it)."""
    from workers.models.device import resolve_device
    from workers.models.parallel import GroupSpec, follow, join_group
    from workers.models.runner import make_runner
    from workers.ops.group import die_with_leader, ignore_stop_signals

    die_with_leader()
    ignore_stop_signals()
    os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(args.world))
    try:
        device = resolve_device(args.device, settings.accelerator)
    except RuntimeError as exc:
        logger.error("rank %d: %s", args.rank, exc)
        return 2
    try:
        spec = GroupSpec(args.rank, args.world, args.group_address, settings.group_timeout)
        collective, loaded = join_group(spec, device, model.path, args.dtype)
        runner = make_runner(
            loaded,
            settings.max_seq_len,
            settings.max_batch_size,
            cache_config(settings, model).pool,
            args.threads,
            args.prefill_threads,
            collective,
        )
        gc.collect()
        gc.freeze()
        follow(runner, collective)
    except Exception as exc:  # the group broke: rank 0 died, hung past the timeout, or this rank failed
        logger.error("rank %d: the device group broke (%s: %s); leaving", args.rank, type(exc).__name__, exc)
        return 1
    collective.close()
    logger.info("rank %d: left the device group", args.rank)
    return 0


def work(queue: object, loop: EngineLoop, log_level: str, burst: bool, stop: threading.Event) -> None:
    """RQ's worker loop, started again (under a new name) if Redis drops it, until a shutdown."""
    from rq.exceptions import StopRequested
    from rq.serializers import JSONSerializer

    from workers.serving.intake import IntakeWorker

    restarts = 0
    while True:
        # RQ's signal handlers stay installed after its loop ends: a signal while the loop is down
        # raises StopRequested here too.
        try:
            if restarts:
                logger.warning("RQ's loop ended; starting it again in %gs", RQ_RESTART_SECONDS)
                if stop.wait(RQ_RESTART_SECONDS):
                    return
            worker = IntakeWorker(
                [queue],
                connection=queue.connection,  # type: ignore[attr-defined]
                serializer=JSONSerializer,
                name=process_name() + (f".r{restarts}" if restarts else ""),
                engine=loop,
                stopping=stop,
            )
            worker.work(burst=burst, logging_level=log_level, with_scheduler=False)
        except redis.RedisError as exc:
            logger.warning("RQ's loop stopped (Redis: %s)", exc)
        except StopRequested:
            stop.set()
        if burst or loop.draining or stop.is_set():
            return
        restarts += 1


def drain(loop: EngineLoop, publisher: Publisher, beacon: Beacon, grace: float) -> None:
    """Take no new jobs; let the running ones finish within `grace` seconds; fail what is left."""
    loop.drain()
    beacon.serving = False  # alive, so the API keeps waiting, but no longer admitting for this worker
    logger.info("draining: %d requests in flight, %gs grace", len(loop.inflight), grace)
    if not wait_idle(loop, time.monotonic() + grace):
        logger.warning("grace period over: failing %d requests still running", len(loop.inflight))
        loop.abort_all("The worker shut down before this request finished.")
    settle(loop, publisher, beacon, ABORT_FLUSH_SECONDS)


def settle(loop: EngineLoop, publisher: Publisher, beacon: Beacon, timeout: float) -> None:
    """Wait for the last events to go out, then leave the live set."""
    deadline = time.monotonic() + timeout
    wait_idle(loop, deadline)
    loop.stop()
    publisher.flush(max(0.0, deadline - time.monotonic()))
    publisher.stop()
    beacon.stop()
    logger.info("stopped")


def wait_idle(loop: EngineLoop, deadline: float) -> bool:
    """Until no request is in flight (True) or the deadline (time.monotonic()) passes (False)."""
    while loop.inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    return not loop.inflight


class Beacon:
    """The worker's heartbeat (its live-set entry, which the API admits by) every
    WORKER_HEARTBEAT_INTERVAL, and its started jobs' RQ Executions every EXECUTION_BEAT_SECONDS."""

    def __init__(
        self, heartbeat: Heartbeat, loop: EngineLoop, connection: redis.Redis, metrics: WorkerMetrics | None = None
    ) -> None:
        self.heartbeat = heartbeat
        self.loop = loop
        self.connection = connection
        self.metrics = metrics
        self.serving = True
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="beacon", daemon=True)

    def start(self) -> None:
        self.heartbeat.beat()
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.heartbeat.end()
        if self.metrics is not None:
            self.metrics.withdraw(self.connection)

    def _run(self) -> None:
        from schemas import ledger

        beat_at = time.monotonic()
        while not self._stop.wait(WORKER_HEARTBEAT_INTERVAL):
            self.heartbeat.beat(serving=self.serving)
            if self.metrics is not None:
                self.metrics.push(self.connection)
            if time.monotonic() - beat_at < EXECUTION_BEAT_SECONDS:
                continue
            beat_at = time.monotonic()
            running = [(f.job, f.execution) for f in list(self.loop.inflight.values())]
            try:
                with self.connection.pipeline(transaction=False) as pipe:
                    ledger.heartbeat(running, pipe)  # type: ignore[arg-type]
                    pipe.execute()
            except redis.RedisError as exc:
                logger.warning("could not refresh %d started jobs in RQ: %s", len(running), exc)
