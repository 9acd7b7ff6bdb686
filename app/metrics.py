"""GET /metrics: one Prometheus scrape for the whole deployment.

- The API's own metrics (requests by route and status, requests refused or withdrawn by reason,
  streams that lost worker events) are counted in every gunicorn worker and summed by
  prometheus-client's multiprocess mode (deploy/gunicorn.conf.py sets its directory).
- Each engine worker pushes a snapshot of its metrics to Redis every heartbeat
  (workers/ops/metrics.py); a scrape reads the fresh ones and labels their samples with `worker` and
  `model`, and adds `tokenline:worker_up` per worker, `tokenline:live_workers` per model and
  `tokenline:worker_load` (what app/routing.py balances) per live worker.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import redis
from flask import Blueprint, Response, current_app, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from rq import Queue
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from app.admission import live_worker_counts
from app.routing import Decision, worker_states
from schemas.clock import clock
from schemas.errors import TokenlineError
from schemas.keys import WORKER_HEARTBEAT_TTL, metrics_key, queue_name, worker_queue_name

bp = Blueprint("metrics", __name__)

STALE_SNAPSHOT_SECONDS = 300  # a dead worker's snapshot is removed from Redis after this long
# The API a route belongs to (the requests counter's `api` label), by the start of its path.
APIS = (
    ("/v1/chat/completions", "chat"),
    ("/v1/completions", "completions"),
    ("/generate", "generate"),
    ("/v1/responses", "responses"),
    ("/v1/messages", "messages"),
)


class ApiMetrics:
    def __init__(self, connection: redis.Redis, models: list[str]) -> None:
        self.connection = connection
        self.models = models
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # In multiprocess mode the values live in files, whatever registry the metric is in.
        self.local = None if self.multiprocess else CollectorRegistry()
        r = self.local
        self.requests = Counter(
            "tokenline:api_requests",
            "HTTP requests by API (chat, completions, generate, responses, messages, other), route and status.",
            ["api", "route", "status"],
            registry=r,
        )
        self.rejected = Counter(
            "tokenline:request_rejected",
            "Requests refused (429, 503) or withdrawn from the queue, by reason.",
            ["reason"],
            registry=r,
        )
        self.failed = Counter(
            "tokenline:request_failed",
            "Requests that failed after they were admitted, by reason: generation_failed, out_of_memory (500), "
            "client_too_slow (408).",
            ["reason"],
            registry=r,
        )
        self.relay_gaps = Counter("tokenline:relay_gaps", "Streams that lost events from their worker.", registry=r)
        self.routed = Counter(
            "tokenline:routed",
            "Requests by how app/routing.py chose their queue: prefix (the worker holding the longest "
            "prefix), load (the least loaded, loads unbalanced) or shared (the model's shared queue).",
            ["model", "by"],
            registry=r,
        )

        self.withdrawn = Counter(
            "tokenline:request_withdrawn",
            "Requests taken off their queue before a worker took them: their client left, a background "
            "response was cancelled, or queueTimeout passed. No worker counts them.",
            ["model"],
            registry=r,
        )

    def count_withdrawn(self, model: str) -> None:
        self.withdrawn.labels(model=model).inc()

    def count_route(self, model: str, decision: Decision) -> None:
        self.routed.labels(model=model, by=decision.by).inc()

    def count_error(self, error: TokenlineError) -> None:
        """A request refused or withdrawn (429, 502, 503, 504), or failed once admitted (408, 500):
        counted once, by its code. A client's own mistakes (400, 401, 404, 413, 415) are not counted here."""
        if getattr(error, "counted", False):
            return
        if error.status in (408, 500) or error.code == "generation_failed":  # also the 503 of a lost relay
            counter = self.failed
        elif error.status in (429, 502, 503, 504):
            counter = self.rejected
        else:
            return
        error.counted = True  # type: ignore[attr-defined]
        counter.labels(reason=error.code or str(error.status)).inc()

    def exposition(self) -> bytes:
        registry = CollectorRegistry()
        if self.multiprocess:
            multiprocess.MultiProcessCollector(registry)
        else:
            registry.register(self.local)  # type: ignore[arg-type]
        registry.register(WorkerCollector(self.connection, self.models))
        return generate_latest(registry)


class WorkerCollector:
    """The engine workers' snapshots from Redis, labelled by worker and model."""

    def __init__(self, connection: redis.Redis, models: list[str]) -> None:
        self.connection = connection
        self.models = models

    def collect(self) -> Iterator[Metric]:
        reachable = GaugeMetricFamily(
            "tokenline:redis_up", "Whether this API process reached Redis for this scrape (1) or not (0)."
        )
        try:
            clock.sync(self.connection)  # the snapshots are stamped by Redis' clock
            snapshots = self.connection.hgetall(metrics_key())
            live = live_worker_counts(self.connection, self.models)
        except redis.RedisError:
            reachable.add_metric([], 0)
            yield reachable  # and the API's own metrics: no worker's can be read
            return
        reachable.add_metric([], 1)
        yield reachable
        families: dict[str, Metric] = {}
        up = GaugeMetricFamily(
            "tokenline:worker_up", "Engine workers with a fresh snapshot.", labels=["worker", "model"]
        )
        now = clock.now()
        for worker, raw in snapshots.items():
            snapshot = json.loads(raw)
            age = now - snapshot["at"]
            if age > STALE_SNAPSHOT_SECONDS:
                self.connection.hdel(metrics_key(), worker)
            if age > WORKER_HEARTBEAT_TTL:
                continue
            labels = {"worker": snapshot["worker"], "model": snapshot["model"]}
            up.add_metric([labels["worker"], labels["model"]], 1)
            for name, kind, documentation, samples in snapshot["families"]:
                family = families.setdefault(name, Metric(name, documentation, kind))
                for sample, sample_labels, value in samples:
                    family.add_sample(sample, {**sample_labels, **labels}, value)
        yield from families.values()
        yield up
        per_model = GaugeMetricFamily(
            "tokenline:live_workers", "Worker processes with a fresh heartbeat.", labels=["model"]
        )
        for model, count in live.items():
            per_model.add_metric([model], count)
        yield per_model
        load = GaugeMetricFamily(
            "tokenline:worker_load",
            "Requests a live worker serves or has waiting on its own queue: what routing balances.",
            labels=["worker", "model"],
        )
        queued = GaugeMetricFamily(
            "tokenline:num_requests_queued",
            "Requests in Redis that no worker has taken yet: on the model's queue and on its workers' own.",
            labels=["model"],
        )
        try:
            for model in self.models:
                states = worker_states(self.connection, model)
                for state in states:
                    load.add_metric([state.name, model], state.load)
                queued.add_metric([model], self._queued(model, [state.name for state in states]))
        except redis.RedisError:
            return
        yield load
        yield queued

    def _queued(self, model: str, workers: list[str]) -> int:
        """A worker takes a job only when its batch has room: what waits beyond its batch waits here, on
        the model's queue and on its live `workers`' own."""
        names = [queue_name(model), *(worker_queue_name(model, worker) for worker in workers)]
        with self.connection.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.llen(Queue(name, connection=self.connection).key)
            return sum(int(n) for n in pipe.execute())


def api_metrics() -> ApiMetrics:
    return current_app.extensions["tokenline.metrics"]


@bp.after_app_request
def _count(response: Response) -> Response:
    rule = _route()
    api = next((name for prefix, name in APIS if rule.startswith(prefix)), "other")
    api_metrics().requests.labels(api=api, route=rule, status=str(response.status_code)).inc()
    return response


def _route() -> str:
    """The request's route; for a method the route does not take (a 405), the route all the same."""
    if request.url_rule is not None:
        return request.url_rule.rule
    refused = request.routing_exception
    if isinstance(refused, MethodNotAllowed) and refused.valid_methods:
        adapter = current_app.url_map.bind_to_environ(request.environ)
        with contextlib.suppress(HTTPException):
            rule, _ = adapter.match(method=refused.valid_methods[0], return_rule=True)
            return rule.rule
    return "unmatched"


@bp.get("/metrics")
def metrics() -> Response:
    return Response(api_metrics().exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})
