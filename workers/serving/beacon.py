"""The worker's beacon thread: its heartbeat in the live set, its metrics, what routing reads (its
prefix cache's blocks and its load; workers/serving/routing.py), and its started jobs' RQ Executions."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from schemas.keys import WORKER_HEARTBEAT_INTERVAL
from workers.ops.heartbeat import Heartbeat

if TYPE_CHECKING:
    from workers.ops.metrics import WorkerMetrics
    from workers.serving.inflight import JobTable
    from workers.serving.routing import RoutingAgent

logger = logging.getLogger(__name__)

# A started job's RQ Execution is refreshed this often (schemas/ledger.py keeps it 60 s).
EXECUTION_BEAT_SECONDS = 10.0


class Beacon:
    """The worker's heartbeat (its live-set entry, which the API admits by), its metrics and what
    routing reads every WORKER_HEARTBEAT_INTERVAL, and its started jobs' RQ Executions every
    EXECUTION_BEAT_SECONDS."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        jobs: JobTable,
        connection: redis.Redis,
        metrics: WorkerMetrics | None = None,
        routing: RoutingAgent | None = None,
    ) -> None:
        self.heartbeat = heartbeat
        self.jobs = jobs
        self.connection = connection
        self.metrics = metrics
        self.routing = routing
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
        if self.routing is not None:
            self.routing.end()
        if self.metrics is not None:
            self.metrics.withdraw(self.connection)

    def _run(self) -> None:
        beat_at = time.monotonic()
        while not self._stop.wait(WORKER_HEARTBEAT_INTERVAL):
            self.heartbeat.beat(serving=self.serving)
            if self.metrics is not None:
                self.metrics.push(self.connection)
            if self.routing is not None:
                self._routing(self.routing)
            if time.monotonic() - beat_at < EXECUTION_BEAT_SECONDS:
                continue
            beat_at = time.monotonic()
            try:
                with self.connection.pipeline(transaction=False) as pipe:
                    self.jobs.beat(pipe)
                    pipe.execute()
            except redis.RedisError as exc:
                logger.warning("could not refresh the started jobs in RQ: %s", exc)

    def _routing(self, routing: RoutingAgent) -> None:
        with routing.lock:
            try:
                with self.connection.pipeline(transaction=False) as pipe:
                    self.jobs.write_load(pipe)
                    routing.publish(pipe)
                    replies = pipe.execute()
            except redis.RedisError:
                routing.failed()  # the heartbeat has logged the outage
                return
            routing.published(replies)
        try:
            routing.sweep()
        except redis.RedisError as exc:
            logger.debug("could not look for the queues of workers that are gone: %s", exc)
