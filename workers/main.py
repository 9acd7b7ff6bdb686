"""`python -m workers`: load settings, resolve the device, load the model once, serve its queue."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from schemas.config import ConfigError, ModelConfig, Settings, load_settings

if TYPE_CHECKING:
    from workers.worker import SlotWorker

SHUTDOWN_GRACE_SECONDS = 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--model", help="model name from the settings (default: the first model)")
    parser.add_argument(
        "--device",
        default=os.environ.get("TOKENLINE_DEVICE", "auto"),
        help="auto (NPU, then CUDA, then CPU), or cpu, cuda:N, npu:N (env TOKENLINE_DEVICE)",
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
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"tokenline worker: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model = settings.model(args.model) if args.model else settings.models[0]
    if model is None:
        print(f"tokenline worker: model {args.model!r} is not configured", file=sys.stderr)
        return 2
    # A torch-npu install without CANN breaks `import torch` unless backend autoload is off;
    # the NPU is loaded explicitly in workers.device instead. No hub access, ever.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return serve(settings, model, args)


def serve(settings: Settings, model: ModelConfig, args: argparse.Namespace) -> int:
    import redis
    import torch
    from rq import Queue
    from rq.serializers import JSONSerializer

    from schemas.keys import queue_name
    from workers import jobs
    from workers.device import resolve_device
    from workers.engine import Engine
    from workers.model import load_model
    from workers.runtime import Runtime
    from workers.worker import SlotWorker, slot_name

    logger = logging.getLogger("workers")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    loaded = load_model(model.path, device, args.dtype)
    runtime = Runtime(
        Engine(loaded, settings.max_seq_len, settings.max_batch_size), redis.Redis.from_url(settings.redis_url)
    )
    jobs.bind(runtime)
    runtime.start()
    slots = []
    for slot in range(settings.max_batch_size):
        connection = redis.Redis.from_url(settings.redis_url)
        queue = Queue(queue_name(model.name), connection=connection, serializer=JSONSerializer)
        worker = SlotWorker([queue], connection=connection, serializer=JSONSerializer, name=slot_name(slot))
        thread = threading.Thread(
            target=_work, args=(worker, settings.log_level, args.burst), name=f"slot-{slot}", daemon=True
        )
        slots.append((worker, thread))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    for _, thread in slots:
        thread.start()
    logger.info("serving model=%s queue=%s device=%s slots=%d", model.name, queue_name(model.name), device, len(slots))
    while not stop.wait(0.5) and any(t.is_alive() for _, t in slots):
        pass
    logger.info("stopping: %d requests in flight", len(runtime.tracked))
    for worker, _ in slots:
        worker._stop_requested = True  # RQ's warm-shutdown flag: finish the current job, then leave
    for worker, thread in slots:
        if worker.get_current_job_id() is not None:
            thread.join(timeout=SHUTDOWN_GRACE_SECONDS)
        worker.register_death()
    return 0


def _work(worker: SlotWorker, log_level: str, burst: bool) -> None:
    worker.work(burst=burst, logging_level=log_level, with_scheduler=False)
