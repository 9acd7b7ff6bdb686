"""The worker's Prometheus metrics, pushed through Redis for the API's /metrics to serve.

Names follow vLLM's (with the `tokenline:` prefix): requests running and waiting, KV cache usage,
prefix-cache queries and hits, prompt and generation tokens, preemptions, time to first token,
inter-token latency, end-to-end latency, queue time, and successful requests by finish reason; and
what the model runs as (its quantization, int8 kernel and dtype; its weights' bytes).

The engine thread updates the metrics after each step (`update`); the beacon thread pushes a
snapshot of them to one Redis hash every heartbeat (`push`), keyed by this worker process. The API
reads every fresh snapshot at a scrape and labels it with `worker` and `model` (app/metrics.py), so
one scrape of the API shows the whole deployment; a worker that dies drops out after its
heartbeat's TTL.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from schemas.clock import clock
from schemas.keys import metrics_key

if TYPE_CHECKING:
    from workers.engine.core import EngineCore
    from workers.models.loader import LoadedModel

logger = logging.getLogger(__name__)

# Buckets as vLLM's (seconds): they reach past the longest a request may wait and run (queueTimeout
# 600 s, e2eTimeout 1800 s by default), or a p99 over them reads as the last bucket's bound.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0),
    *(480.0, 960.0, 1920.0, 7680.0),
)


class WorkerMetrics:
    def __init__(self, model: str, process: str) -> None:
        self.model = model
        self.process = process
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tokenline:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("tokenline:num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("tokenline:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1).", registry=r)
        self.host_usage = Gauge(
            "tokenline:host_cache_usage_perc",
            "Share of the host tier's KV blocks (cpuMemSize) holding preempted or cached blocks (0-1).",
            registry=r,
        )
        self.prefix_queries = Counter("tokenline:prefix_cache_queries", "Prompt tokens looked up.", registry=r)
        self.prefix_hits = Counter("tokenline:prefix_cache_hits", "Prompt tokens found cached.", registry=r)
        self.prompt_tokens = Counter("tokenline:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("tokenline:generation_tokens", "Generated tokens.", registry=r)
        self.preemptions = Counter("tokenline:num_preemptions", "Sequences preempted.", registry=r)
        self.recomputed = Counter(
            "tokenline:recomputed_tokens",
            "Tokens computed again after a preemption (no room in the host tier).",
            registry=r,
        )
        self.swapped_out = Counter(
            "tokenline:kv_swapped_out_blocks", "KV blocks copied to the host tier (cpuMemSize).", registry=r
        )
        self.swapped_in = Counter(
            "tokenline:kv_swapped_in_blocks", "KV blocks copied back from the host tier.", registry=r
        )
        self.host_hits = Counter("tokenline:host_cache_hits", "Prompt tokens found in the host tier.", registry=r)
        self.success = Counter(
            "tokenline:request_success", "Finished sequences by finish reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "tokenline:time_to_first_token_seconds", "Queued to first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "tokenline:inter_token_latency_seconds", "Between a sequence's tokens.", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "tokenline:e2e_request_latency_seconds", "Queued to finished.", buckets=REQUEST_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "tokenline:request_queue_time_seconds", "Queued to first scheduled.", buckets=REQUEST_BUCKETS, registry=r
        )
        self.weights = Gauge(
            "tokenline:model_weight_bytes", "Bytes the model's weights take on the device.", registry=r
        )
        self.info = Gauge(
            "tokenline:model_info",
            "1, labelled with how the model runs: its quantization (none, or the scheme and where it "
            "comes from, as /v1/models names it), the kernel of its int8 products, and its dtype.",
            ["quantization", "kernel", "dtype"],
            registry=r,
        )
        self._seen = dict.fromkeys(
            ("prompt", "generation", "preemptions", "queries", "hits", "recomputed", "out", "in", "host_hits"), 0
        )

    def describe(self, loaded: LoadedModel) -> None:
        """What the model runs as, set once at start-up."""
        self.weights.set(loaded.weight_bytes)
        dtype = str(loaded.dtype).removeprefix("torch.")
        self.info.labels(quantization=loaded.quantization or "none", kernel=loaded.kernel or "none", dtype=dtype).set(1)

    def update(self, core: EngineCore) -> None:
        """From the engine thread, between steps: the gauges, the counters' growth, the observations."""
        scheduler, kv = core.scheduler, core.kv
        self.running.set(len({s.request.request_id for s in scheduler.running}))
        self.waiting.set(len({s.request.request_id for s in scheduler.waiting}))
        self.kv_usage.set(kv.used / kv.num_blocks if kv.num_blocks else 0.0)
        self.host_usage.set(kv.host_usage)
        stats = core.stats.drain()
        for key, counter, total in (
            ("prompt", self.prompt_tokens, stats.prompt_tokens),
            ("generation", self.generation_tokens, stats.generation_tokens),
            ("preemptions", self.preemptions, scheduler.preemptions),
            ("queries", self.prefix_queries, kv.queries),
            ("hits", self.prefix_hits, kv.hits),
            ("recomputed", self.recomputed, scheduler.recomputed),
            ("out", self.swapped_out, kv.swapped_out),
            ("in", self.swapped_in, kv.swapped_in),
            ("host_hits", self.host_hits, kv.host_hits),
        ):
            if total > self._seen[key]:
                counter.inc(total - self._seen[key])
                self._seen[key] = total
        for histogram, values in (
            (self.queue_time, stats.queue_times),
            (self.ttft, stats.first_token_times),
            (self.itl, stats.inter_token_times),
            (self.e2e, stats.e2e_times),
        ):
            for value in values:
                histogram.observe(max(value, 0.0))
        for reason in stats.finished:
            self.success.labels(finished_reason=reason).inc()

    def snapshot(self) -> str:
        """The registry's samples as JSON: [[name, type, help, [[sample, labels, value], …]], …]."""
        families = [
            [m.name, m.type, m.documentation, [[s.name, s.labels, s.value] for s in m.samples]]
            for m in self.registry.collect()
        ]
        return json.dumps({"model": self.model, "worker": self.process, "at": clock.now(), "families": families})

    def push(self, connection: redis.Redis) -> None:
        """From the beacon thread: this worker's snapshot, for the API's next scrape."""
        try:
            connection.hset(metrics_key(), self.process, self.snapshot())
        except redis.RedisError as exc:
            logger.debug("metrics push failed: %s", exc)

    def withdraw(self, connection: redis.Redis) -> None:
        try:
            connection.hdel(metrics_key(), self.process)
        except redis.RedisError as exc:
            logger.debug("metrics withdrawal failed: %s", exc)


def decode(snapshot: bytes | str) -> dict[str, Any]:
    return json.loads(snapshot)
