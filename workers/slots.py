"""`python -m workers.slots`: a worker's queue process, started by its engine process (`python -m workers`).

It runs one RQ `SlotWorker` thread per batch slot on the model's queue; each performs, in RQ, a job
that the engine process took off the queue and handed over the link (workers/link.py) given as
`--fd`, and the job ends when the engine reports the request's end. Its RQ workers are named after
the engine process (`<host>.<pid>.<slot>`), whose heartbeat the API checks. It imports no torch.

It is not started by hand: signals go to the engine process, which tells it to drain. It exits when
its slots have left RQ's loop (after a drain; in burst mode the engine drains once the queue is
empty), and at once if the engine process dies: the API then fails that process's requests as lost.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from schemas.keys import queue_name, worker_name
from workers import jobs, link
from workers.link import EngineClient
from workers.main import start_up
from workers.worker import SlotWorker

logger = logging.getLogger("workers")

SLOT_RESTART_MAX_DELAY = 5.0
# Once a stopping queue process has no job left, its idle slots get this long to leave RQ's loop.
IDLE_EXIT_SECONDS = 3.0
LEAVE_POLL_SECONDS = 0.1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.slots", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the model whose queue the slots serve")
    parser.add_argument("--process", required=True, help="the engine process's name, <host>.<pid>")
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the link")
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = start_up("tokenline worker (queue process)")
    if settings is None:
        return 2
    # A Ctrl-C reaches the whole process group; the engine process handles it and tells us to drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    client = EngineClient(link.connect(args.fd), redis.Redis.from_url(settings.redis_url), on_closed=engine_gone)
    jobs.bind(client)

    def make_worker(slot: int, restarts: int) -> SlotWorker:
        connection = redis.Redis.from_url(settings.redis_url)
        queue = Queue(queue_name(args.model), connection=connection, serializer=JSONSerializer)
        name = worker_name(args.process, slot) + (f"r{restarts}" if restarts else "")
        return SlotWorker([queue], connection=connection, serializer=JSONSerializer, name=name, stopping=stop)

    slots = [Slot(i, make_worker, stop, settings.log_level, args.burst) for i in range(settings.max_batch_size)]
    client.start()
    for slot in slots:
        slot.thread.start()
    # The link's reader sets `draining` when the engine process is told to stop; a SIGTERM sets `stop`.
    while not (client.draining.wait(0.5) or stop.is_set()) and any(s.thread.is_alive() for s in slots):
        pass
    # Each slot finishes its job and leaves at its next dequeue, once no job the engine took waits for a
    # slot (RQ's own warm-shutdown flag would make a slot leave before it dequeues them).
    stop.set()
    leave(slots, client)
    logger.info("queue process stopped")
    return 0


def leave(slots: list[Slot], client: EngineClient) -> None:
    """Wait for the slots to leave RQ's loop. A slot running a job leaves once the job has ended (the
    engine process bounds that by its grace period); an idle one within a poll, unless Redis is
    unreachable, where RQ retries its connection for ever: once no job is left, the idle slots get
    IDLE_EXIT_SECONDS, and the process exits without them."""
    deadline: float | None = None
    while alive := [s for s in slots if s.thread.is_alive()]:
        if client.pending:
            deadline = None
        elif deadline is None:
            deadline = time.monotonic() + IDLE_EXIT_SECONDS
        elif time.monotonic() >= deadline:
            logger.warning("%d idle slots could not leave RQ's loop (is Redis reachable?); exiting", len(alive))
            return
        alive[0].thread.join(LEAVE_POLL_SECONDS)


def engine_gone() -> None:
    """The engine process died (it never closes the link while we run): its requests are lost."""
    logger.error("the engine process has gone; the queue process exits")
    logging.shutdown()
    os._exit(1)


class Slot:
    """One RQ slot worker in a thread; if RQ's loop dies (Redis gone), a new worker takes its place."""

    def __init__(
        self,
        index: int,
        make_worker: Callable[[int, int], SlotWorker],
        stop: threading.Event,
        log_level: str,
        burst: bool,
    ) -> None:
        self.index = index
        self.make_worker = make_worker
        self.stop = stop
        self.log_level = log_level
        self.burst = burst
        self.thread = threading.Thread(target=self.run, name=f"slot-{index}", daemon=True)

    def run(self) -> None:
        restarts = 0
        while True:
            try:
                # A new worker names its connection in Redis: while Redis is away, that fails too.
                worker = self.make_worker(self.index, restarts)
                worker.work(burst=self.burst, logging_level=self.log_level, with_scheduler=False)
            except Exception as exc:  # e.g. Redis unreachable while registering
                logger.warning("slot %d: %s", self.index, exc)
            if self.stop.is_set() or self.burst:
                return
            restarts += 1
            delay = min(float(restarts), SLOT_RESTART_MAX_DELAY)
            logger.warning("slot %d left RQ's loop; rejoining in %gs", self.index, delay)
            if self.stop.wait(delay):
                return


if __name__ == "__main__":
    sys.exit(main())
