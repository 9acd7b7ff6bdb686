"""`python -m workers`: load settings, lease and resolve the device, load the model once, serve its queue.

One process per device: the main thread runs RQ's worker loop (workers/serving/intake.py), which
hands each job to the engine thread (workers/serving/loop.py); the publisher thread sends the events
and records each job's end in RQ; the beacon thread keeps the worker's heartbeat. SIGTERM or Ctrl-C
is RQ's warm shutdown: no new jobs, the running ones get `shutdownGrace` seconds, then fail.

A model with worldSize N > 1 is served by a group: this process is rank 0 (all of the above, and the
engine over the group, workers/models/parallel.py); it starts ranks 1..N-1 as `python -m workers
--rank R ...` (workers/serving/group.py), which only run the steps it sends, and the group ends as
one. The beacon thread is workers/serving/beacon.py; how the worker stops, workers/serving/lifecycle.py.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from schemas.config import DTYPES, ConfigError, ModelConfig, Settings, load_settings, log_config_notes
from schemas.errors import ConstraintFailed
from schemas.model_files import ModelFiles, ModelFilesError
from schemas.quantization import detect as detect_quantization
from workers.ops.heartbeat import Heartbeat, process_name
from workers.ops.lease import DeviceBusy, DeviceLease, GroupLease, lease_any, lease_group, lease_one
from workers.serving.beacon import Beacon
from workers.serving.group import follow_group, group_lost
from workers.serving.lifecycle import ABORT_FLUSH_SECONDS, drain, settle, stop_self

if TYPE_CHECKING:
    from workers.models.loader import LoadedModel
    from workers.models.parallel import Collective
    from workers.ops.group import Followers
    from workers.serving.inflight import JobTable
    from workers.serving.loop import EngineLoop

logger = logging.getLogger("workers")

# libgomp (torch's OpenMP on Linux) lets a thread that finished its share of a parallel region spin
# for 300,000 rounds before it sleeps, holding a core that the API needs. This many rounds still spans
# the gaps between one forward pass's parallel regions. A GOMP_SPINCOUNT in the environment wins.
GOMP_SPIN_COUNT = "10000"
# Where the compiled decode steps are cached on disk (TORCHINDUCTOR_CACHE_DIR wins).
COMPILE_CACHE_DIR = Path.home() / ".cache" / "tokenline" / "inductor"
# While Redis is unreachable, RQ's loop is started again after this long.
RQ_RESTART_SECONDS = 1.0
# A started job's hash is kept this long (the request's own limit, e2eTimeout, ends it sooner).
JOB_KEEP_SECONDS = 24 * 3600


def set_process_defaults() -> None:
    """Environment defaults the libraries read once, as they load: set before torch is imported."""
    # A torch-npu install without CANN breaks `import torch` unless backend autoload is off;
    # the NPU is loaded explicitly in workers.models.device instead. No hub access, ever.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPIN_COUNT)
    # Inductor's compiled code, kept where a restart finds it (models/compile.py). torch fixes the
    # directory when Dynamo is imported (torch 2.13: `torch._dynamo.package` asks for it as it loads,
    # and its default is under /tmp, which a container or a reboot loses), so it is set here.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE_DIR))


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
    set_process_defaults()  # before anything imports torch (a GGUF file's metadata is read with transformers)
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
        files = ModelFiles.of(model.path)
        files.check()  # readable (a GGUF file's derived now, before any device is leased)
        # An unsupported scheme stops the worker here, before a group's ranks start.
        detect_quantization(files, settings.quantization)
    except ModelFilesError as exc:
        print(f"tokenline worker: model {model.name}: {exc}", file=sys.stderr)
        return 2
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
        if args.device == "cpu" and world > 1:
            # A CPU group on a host with GPUs: transformers' tensor-parallel loading binds each rank to
            # torch's accelerator (cuda:rank) unless it sees none. (torch_npu is not loaded for `cpu`.)
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return None
    lease.start_renewing(on_lost=lambda _: stop_self(stop))
    logger.info("leased device %r", lease)
    return lease


def serve(settings: Settings, model: ModelConfig, args: argparse.Namespace, stop: threading.Event) -> int:
    """Rank 0: with worldSize > 1 it starts the group's other ranks first and leads them."""
    from workers.models.device import resolve_device
    from workers.models.loader import load_model
    from workers.models.runner import default_threads
    from workers.serving.group import start_group

    try:
        device = resolve_device(args.device, settings.accelerator)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 2
    world = model.world_size
    decode, prefill = default_threads(device, world)  # the followers are told rank 0's choice
    args.threads, args.prefill_threads = args.threads or decode, args.prefill_threads or prefill
    if world == 1:
        # A SIGTERM while torch was loading (or the model): the worker ends there, its lease given back.
        if stop.is_set():
            return 0
        try:
            loaded = load_model(model.path, device, args.dtype, quantization=settings.quantization)
        except ModelFilesError as exc:
            print(f"tokenline worker: model {model.name}: {exc}", file=sys.stderr)
            return 2
        if stop.is_set():
            return 0
        return serve_engine(settings, model, args, stop, loaded)
    started = start_group(settings, model, args, device)
    if isinstance(started, int):
        return started
    status = 1
    try:
        status = serve_engine(settings, model, args, stop, started.loaded, started.collective, started.followers)
        return status
    finally:
        started.end(status)


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

    from schemas.keys import queue_name, worker_load_key
    from workers.engine.core import CacheConfig, EngineCore
    from workers.models.attention import UnsupportedAttention
    from workers.models.kv_pool import PoolSizeError
    from workers.ops.metrics import WorkerMetrics
    from workers.serving.inflight import JobTable
    from workers.serving.loop import EngineLoop
    from workers.serving.publisher import Publisher
    from workers.serving.routing import RoutingAgent

    world, device = model.world_size, loaded.device
    try:
        core = EngineCore.build(
            loaded,
            settings.max_seq_len,
            settings.max_batch_size,
            args.threads,
            args.prefill_threads,
            cache=CacheConfig.from_settings(settings, model),
            collective=collective,
        )
    except (PoolSizeError, UnsupportedAttention) as exc:  # the latter from the runner's probe forward
        print(f"tokenline worker: model {model.name}: {exc}", file=sys.stderr)
        return 2
    runner = core.runner
    # The grammar engine's vocabulary is read now: read at the first constrained request, it would hold
    # the GIL for seconds (workers/engine/grammar.py), the beacon would miss the heartbeat's TTL and the
    # API would fail every request this worker holds. A vocabulary llguidance cannot read fails the
    # constrained requests alone, as it did when read at the first of them.
    try:
        _ = core.grammars
    except ConstraintFailed as exc:
        logger.warning("constrained requests will be refused: %s", exc)
    # The model, tokenizer and libraries are loaded for good: move them out of the garbage collector's
    # reach, so that its full collections, which otherwise walk them all, stay short pauses between steps.
    gc.collect()
    gc.freeze()
    if stop.is_set():  # stopped while the engine was built and warmed
        return 0
    process = process_name()
    jobs = JobTable(settings.max_batch_size, JOB_KEEP_SECONDS, load=(worker_load_key(model.name), process))
    loop = EngineLoop(core, jobs)
    loop.metrics = WorkerMetrics(model.name, process_name())
    loop.metrics.describe(loaded)
    loop.on_fatal = lambda: stop_self(stop)
    publisher = Publisher(redis.Redis.from_url(settings.redis_url), loop, jobs, model.name)
    publisher.start()
    loop.start(publisher)
    connection = redis.Redis.from_url(settings.redis_url)
    where = str(device) if world == 1 else f"{device}+{world - 1}"
    routing = RoutingAgent(connection, model.name, process, core.kv)
    publisher.routing = routing
    beacon = Beacon(Heartbeat(connection, model.name, where), jobs, connection, loop.metrics, routing)
    beacon.start()
    if followers is not None:
        followers.watch(lambda rank, status: group_lost(loop, beacon, stop, rank, status))
    logger.info(
        "serving model=%s queue=%s device=%s%s max batch=%d threads=%d/%d (decode/prefill); routed requests "
        "first, on %s",
        model.name,
        queue_name(model.name),
        device,
        f" (rank 0 of {world}, tensor parallel)" if world > 1 else "",
        settings.max_batch_size,
        runner.threads,
        runner.prefill_threads,
        routing.queue.name,
    )
    # Its own queue first (the requests routed to it), then the model's shared queue: RQ's order.
    queues = [routing.queue, Queue(queue_name(model.name), connection=connection, serializer=JSONSerializer)]
    try:
        if not stop.is_set():
            work(queues, loop, jobs, settings.log_level, args.burst, stop)
        # A burst worker has served its queue: its requests end by themselves (a second signal stops it).
        drain(loop, publisher, beacon, float("inf") if args.burst else args.grace)
    except SystemExit:  # a second Ctrl-C or SIGTERM: RQ's cold shutdown
        logger.warning("cold shutdown: failing %d requests", len(jobs))
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


def work(
    queues: list[Any], loop: EngineLoop, jobs: JobTable, log_level: str, burst: bool, stop: threading.Event
) -> None:
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
                queues,
                connection=queues[0].connection,
                serializer=JSONSerializer,
                name=process_name() + (f".r{restarts}" if restarts else ""),
                engine=loop,
                jobs=jobs,
                stopping=stop,
            )
            try:
                worker.work(burst=burst, logging_level=log_level, with_scheduler=False)
            finally:
                worker.release_room()
        except redis.RedisError as exc:
            logger.warning("RQ's loop stopped (Redis: %s)", exc)
        except StopRequested:
            stop.set()
        if burst or loop.draining or stop.is_set():
            return
        restarts += 1
