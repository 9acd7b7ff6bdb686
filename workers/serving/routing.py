"""What a worker does for the API's routing (app/routing.py), from its beacon thread.

- It publishes the keys of the blocks in its prefix cache to its set in Redis: the changes since the
  last beat (the cache's events), or, at start, after a failed write and where Redis lost the set
  (a restart, or its TTL run out while the worker stalled), the whole cache at once;
  and the size of its blocks, which the API keys a prompt by.
- It writes its batch size to its model's load hash (also written with each job in and out).
- It moves the jobs waiting on the own queue of a worker of its model that is no longer live (killed,
  or draining) to the shared queue, and removes a dead worker's emptied queue: with the API's own
  check on each waiting request, a routed job is never stranded.
When it stops, its own queue's jobs go to the shared queue and its set and load leave Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis
from redis.client import Pipeline
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from schemas import ledger
from schemas.keys import (
    WORKER_HEARTBEAT_TTL,
    live_workers_key,
    queue_name,
    queue_owner,
    worker_block_size_key,
    worker_blocks_key,
    worker_heartbeat_key,
    worker_load_key,
    worker_queue_name,
)

if TYPE_CHECKING:
    from workers.engine.kv_cache import KVCacheManager

logger = logging.getLogger(__name__)

# A dead worker's block set outlives its heartbeat by this long (routing reads live workers' sets only).
BLOCKS_TTL_SECONDS = 60
# How often the queues of workers that are gone are looked for.
SWEEP_SECONDS = 1.0
# Keys sent in one SADD when the whole cache is published.
CHUNK = 4096


class RoutingAgent:
    def __init__(self, connection: redis.Redis, model: str, process: str, kv: KVCacheManager | None) -> None:
        self.connection = connection
        self.model = model
        self.process = process
        self.kv = kv
        self.blocks_key = worker_blocks_key(process)
        self.block_size_key = worker_block_size_key(process)
        self.queue = Queue(worker_queue_name(model, process), connection=connection, serializer=JSONSerializer)
        self.shared = Queue(queue_name(model), connection=connection, serializer=JSONSerializer)
        self.resync = True  # publish the whole cache at the next beat
        # Held by the thread that publishes, from `publish` to `published` (the beacon's beat, and the
        # publisher's round trip that ends a request): the cache's changes reach Redis in their order.
        self.lock = threading.Lock()
        self._exists_at: int | None = None  # where this beat's EXISTS of the set is in its pipeline
        if kv is not None:
            kv.publish()
            if kv.prefix_caching:  # before the heartbeat makes the worker live: the API keys prompts by it
                try:
                    connection.set(self.block_size_key, kv.block_size, ex=BLOCKS_TTL_SECONDS)
                except redis.RedisError as exc:  # every beat writes it again
                    logger.warning("could not publish the block size: %s", exc)
        self.swept_at = -float("inf")

    def publish(self, pipe: Pipeline) -> None:
        """Queue the writes of what the prefix cache gained and lost since the last beat."""
        if self.kv is None or not self.kv.prefix_caching:
            return
        self._exists_at = None
        if self.resync:
            self.kv.changes()  # what the snapshot below holds
            held = self.kv.keys()
            pipe.delete(self.blocks_key)
            for start in range(0, len(held), CHUNK):
                pipe.sadd(self.blocks_key, *held[start : start + CHUNK])
            self.resync = False
        else:
            self._exists_at = len(pipe)  # a set Redis lost (restarted; expired during a long stall)
            pipe.exists(self.blocks_key)
            stored, removed = self.kv.changes()
            if stored:
                pipe.sadd(self.blocks_key, *stored)
            if removed:
                pipe.srem(self.blocks_key, *removed)
        pipe.expire(self.blocks_key, BLOCKS_TTL_SECONDS)
        pipe.set(self.block_size_key, self.kv.block_size, ex=BLOCKS_TTL_SECONDS)

    def published(self, replies: list[object]) -> None:
        """The replies of the pipeline that carried `publish`'s writes: where the set was gone before
        the changes were added to it, the whole cache is published at the next beat (the changes
        alone would leave the API routing by a few of its blocks)."""
        if self._exists_at is not None and replies[self._exists_at] == 0:
            self.resync = True

    def failed(self) -> None:
        """The beat's writes may not have landed: publish the whole cache next time."""
        self.resync = True

    def sweep(self) -> None:
        """At most every SWEEP_SECONDS: move the jobs off the queues of the model's workers that are no
        longer live to the shared queue; remove a dead worker's empty queue and its load."""
        if time.monotonic() - self.swept_at < SWEEP_SECONDS:
            return
        self.swept_at = time.monotonic()
        since = _now_ms(self.connection) - WORKER_HEARTBEAT_TTL * 1000
        live = {_text(n) for n in self.connection.zrangebyscore(live_workers_key(self.model), since, "+inf")}
        live.add(self.process)
        for queue in Queue.all(connection=self.connection, serializer=JSONSerializer):
            shared, worker = queue_owner(queue.name)
            if shared != self.shared.name or worker is None or worker in live:
                continue
            moved = sum(self._rescue(job_id, live) for job_id in reversed(queue.get_job_ids()))
            if moved:
                logger.warning("moved %d jobs from %s (its worker is gone) to the shared queue", moved, queue.name)
            if not self.connection.exists(worker_heartbeat_key(worker)) and queue.is_empty():
                ledger.retire(queue)
        self._forget_gone_loads(live)

    def _forget_gone_loads(self, live: set[str]) -> None:
        """Take out of the model's load table the workers without a heartbeat (killed: they never wrote
        their leave), so that it does not grow with every worker that ever died."""
        load_key = worker_load_key(self.model)
        listed = [_text(name) for name in self.connection.hkeys(load_key)]
        others = [name for name in listed if name not in live]
        if not others:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for name in others:
                pipe.exists(worker_heartbeat_key(name))
            beating = pipe.execute()
        gone = [name for name, beats in zip(others, beating, strict=True) if not beats]
        if gone:
            self.connection.hdel(load_key, *gone)

    def _rescue(self, job_id: str, live: set[str]) -> bool:
        try:
            job = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return False
        return job.get_status(refresh=False) == JobStatus.QUEUED and ledger.rescue(self.connection, job, live)

    def end(self) -> None:
        """Leave routing: the own queue's jobs go to the front of the shared queue, the queue is removed,
        and the block set and load with it."""
        try:
            for job_id in reversed(self.queue.get_job_ids()):
                if self.queue.remove(job_id):
                    try:
                        job = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
                    except NoSuchJobError:
                        continue
                    self.shared.enqueue_job(job, at_front=True)
            ledger.retire(self.queue)
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.delete(self.blocks_key, self.block_size_key)
                pipe.hdel(worker_load_key(self.model), self.process)
                pipe.execute()
        except redis.RedisError as exc:  # the live workers' sweep moves what is left
            logger.warning("could not hand back the worker's queue: %s", exc)


def _now_ms(connection: redis.Redis) -> int:
    seconds, micros = connection.time()
    return seconds * 1000 + micros // 1000


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
