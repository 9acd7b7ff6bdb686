"""GET /metrics after a load run: the counts agree with the requests sent, across the API's gunicorn
workers (multiprocess mode) and the engine worker (its snapshot pushed through Redis)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from schemas.clock import clock
from schemas.config import Settings
from scripts.localstack import wait_for
from tests.chat_runs import first_token
from workers.ops.metrics import REQUEST_BUCKETS, TTFT_BUCKETS, WorkerMetrics

CHAT = "/v1/chat/completions"


def scrape(stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:  # type: ignore[no-untyped-def]
    response = requests.get(f"{stack.base_url}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    """The sum of the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def test_a_scrape_after_a_load_run_counts_what_was_sent(stack) -> None:
    before = scrape(stack)
    bodies = [
        {"model": "demo", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 3, "ignore_eos": True}
        for i in range(8)
    ]
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda b: requests.post(f"{stack.base_url}{CHAT}", json=b, timeout=60), bodies))
    assert all(r.status_code == 200 for r in responses)
    bad = requests.post(f"{stack.base_url}{CHAT}", json={"model": "demo", "messages": []}, timeout=30)
    assert bad.status_code == 400
    assert requests.get(f"{stack.base_url}{CHAT}", timeout=30).status_code == 405
    prompt_tokens = sum(r.json()["usage"]["prompt_tokens"] for r in responses)

    def grown(name: str, amount: float, **labels: str) -> bool:
        return value(scrape(stack), name, **labels) - value(before, name, **labels) == amount

    # The worker pushes its snapshot every heartbeat: wait for the one that counts the run.
    wait_for(
        lambda: grown("tokenline:request_success_total", 8, finished_reason="length", model="demo"),
        10,
        "the worker's counts",
    )
    after = scrape(stack)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("tokenline:generation_tokens_total", model="demo") == 24
    assert delta("tokenline:prompt_tokens_total", model="demo") == prompt_tokens
    assert delta("tokenline:time_to_first_token_seconds_count", model="demo") == 8
    assert delta("tokenline:inter_token_latency_seconds_count", model="demo") == 16
    assert delta("tokenline:e2e_request_latency_seconds_count", model="demo") == 8
    assert delta("tokenline:request_queue_time_seconds_count", model="demo") == 8
    assert delta("tokenline:api_requests_total", route=CHAT, status="200") == 8  # summed over gunicorn workers
    assert delta("tokenline:api_requests_total", route=CHAT, status="400") == 1
    assert delta("tokenline:api_requests_total", api="chat", route=CHAT, status="405") == 1  # its route's
    assert value(after, "tokenline:worker_up", model="demo") >= 1
    assert value(after, "tokenline:live_workers", model="demo") >= 1
    for gauge in ("tokenline:num_requests_running", "tokenline:num_requests_waiting", "tokenline:kv_cache_usage_perc"):
        assert any(n == gauge and ("model", "demo") in ls for n, ls in after), gauge
    assert value(after, "tokenline:host_cache_usage_perc", model="demo") == 0  # no host tier here
    # What the model runs as: the demo model is float32, not quantized.
    described = {(n, ls) for n, ls in after if n == "tokenline:model_info" and ("model", "demo") in ls}
    assert described and all(
        {("quantization", "none"), ("kernel", "none"), ("dtype", "float32")} <= set(ls) for _, ls in described
    )
    assert value(after, "tokenline:model_weight_bytes", model="demo") > 0


def test_the_gauges_read_an_idle_worker_as_idle(stack) -> None:  # type: ignore[no-untyped-def]
    """The step that finishes the last request is followed by none: the worker still lets its batch
    go, so an autoscaler reading the gauges sees it idle within a heartbeat or two."""
    gauges = ("tokenline:num_requests_running", "tokenline:num_requests_waiting", "tokenline:kv_cache_usage_perc")
    done = value(scrape(stack), "tokenline:request_success_total", model="demo")
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    assert requests.post(f"{stack.base_url}{CHAT}", json=body, timeout=60).status_code == 200
    # A snapshot pushed after the request ended (it counts the request), with every gauge in it.
    wait_for(lambda: value(scrape(stack), "tokenline:request_success_total", model="demo") == done + 1, 10, "it")

    def idle() -> bool:
        samples = scrape(stack)
        present = all(any(n == g and ("model", "demo") in ls for n, ls in samples) for g in gauges)
        return present and all(value(samples, g, model="demo") == 0 for g in gauges)

    wait_for(idle, 3, "the gauges to read the worker idle")


def test_refused_and_withdrawn_requests_are_counted_once_by_reason(redis_conn) -> None:  # type: ignore[no-untyped-def]
    from app.metrics import ApiMetrics
    from app.relay import RelayBroken
    from schemas.errors import GenerationFailed, InvalidRequest, NoWorker, Overloaded, QueueTimeout, SlowClient

    metrics = ApiMetrics(redis_conn, ["demo"])
    queue_timeout = QueueTimeout("withdrawn")
    failed = GenerationFailed("the worker failed")
    errors = (Overloaded("full"), NoWorker("none"), queue_timeout, queue_timeout, InvalidRequest("bad"))
    lost = RelayBroken("Redis went away during generation")  # a 503 to retry, but failed once admitted
    for error in (*errors, failed, failed, SlowClient("behind"), lost):
        metrics.count_error(error)  # the same error met twice (stream, then handler) counts once
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    assert value(samples, "tokenline:request_rejected_total", reason="rate_limit_exceeded") == 1
    assert value(samples, "tokenline:request_rejected_total", reason="no_worker") == 1
    assert value(samples, "tokenline:request_rejected_total", reason="queue_timeout") == 1
    assert value(samples, "tokenline:request_rejected_total") == 3  # a 400 is not a rejection
    # Failed once admitted (the 500 of a stream is an error event after its 200), by reason.
    assert value(samples, "tokenline:request_failed_total", reason="generation_failed") == 2
    assert value(samples, "tokenline:request_failed_total", reason="client_too_slow") == 1


def test_a_client_that_leaves_is_counted_as_an_abort_with_its_prompt(stack) -> None:  # type: ignore[no-untyped-def]
    """Its prompt was computed (a token came): counted, as vLLM counts prompt tokens at prefill."""
    before = scrape(stack)
    aborted = value(before, "tokenline:request_success_total", model="demo", finished_reason="abort")
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 256,  # the stack's maxIterTimes: seconds of generation, left after one chunk
        "ignore_eos": True,
        "stream": True,
    }
    prompt = requests.post(f"{stack.base_url}{CHAT}", json={**body, "max_tokens": 1, "stream": False}, timeout=60)
    prompt_tokens = prompt.json()["usage"]["prompt_tokens"]
    with requests.post(f"{stack.base_url}{CHAT}", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        assert response.status_code == 200, response.text
        first_token(lines)  # the prompt is computed
    wait_for(
        lambda: (
            value(scrape(stack), "tokenline:request_success_total", model="demo", finished_reason="abort")
            == aborted + 1
        ),
        10,
        "the worker to count the abort",
    )
    counted = value(scrape(stack), "tokenline:prompt_tokens_total", model="demo")
    assert counted - value(before, "tokenline:prompt_tokens_total", model="demo") == 2 * prompt_tokens


def test_requests_no_worker_has_taken_yet_are_counted_as_queued(redis_conn) -> None:  # type: ignore[no-untyped-def]
    """A worker takes a job only when its batch has room: what waits beyond it is in Redis, on the
    model's queue or on a worker's own, and `tokenline:num_requests_queued` counts it (the engine's
    `num_requests_waiting` cannot)."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from app.metrics import ApiMetrics
    from schemas.job import JOB_FUNCTION
    from schemas.keys import live_workers_key, queue_name, worker_queue_name

    model, worker = "queued-model", "host.1234"
    seconds, micros = redis_conn.time()
    redis_conn.zadd(live_workers_key(model), {worker: seconds * 1000 + micros // 1000})  # a fresh heartbeat
    shared = Queue(queue_name(model), connection=redis_conn, serializer=JSONSerializer)
    own = Queue(worker_queue_name(model, worker), connection=redis_conn, serializer=JSONSerializer)
    metrics = ApiMetrics(redis_conn, [model])

    def queued() -> float:
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.exposition().decode())
            for s in family.samples
        }
        return value(samples, "tokenline:num_requests_queued", model=model)

    try:
        assert queued() == 0
        for queue, count in ((shared, 2), (own, 1)):
            for _ in range(count):
                queue.enqueue(JOB_FUNCTION, {"request": "x"})
        assert queued() == 3
    finally:
        shared.empty()
        own.empty()
        redis_conn.delete(live_workers_key(model))
    assert queued() == 0


def test_latency_histograms_reach_past_the_longest_a_request_may_wait_and_run() -> None:
    """A p99 of requests past the last finite bucket reads as that bucket's bound (it was 40 s for
    time to first token, under queueTimeout's 600 s)."""
    defaults = Settings(models=())
    assert TTFT_BUCKETS[-1] > defaults.queue_timeout and REQUEST_BUCKETS[-1] > defaults.queue_timeout
    assert REQUEST_BUCKETS[-1] > defaults.e2e_timeout


def test_worker_snapshots_and_latencies_are_timed_by_redis_clock_whatever_each_hosts_says(
    redis_conn, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """An API and a worker on hosts whose clocks disagree: a worker's snapshot stamped 10 s 'late' by
    the API's clock was dropped from the scrape, and its latencies were off by the difference. Each
    process reads Redis' clock instead, measured by the worker's heartbeat and the API's scrape."""
    from app.metrics import ApiMetrics
    from workers.ops.heartbeat import Heartbeat

    def redis_now() -> float:
        seconds, micros = redis_conn.time()
        return seconds + micros / 1e6

    monkeypatch.setattr(clock, "wall", lambda: time.time() - 10)  # a worker whose clock is 10 s behind
    heartbeat = Heartbeat(redis_conn, "skewed", "cpu")
    heartbeat.beat()
    assert abs(clock.now() - redis_now()) < 0.05
    metrics = WorkerMetrics("skewed", "skewed-host.1")
    metrics.push(redis_conn)
    monkeypatch.setattr(clock, "wall", lambda: time.time() + 10)  # an API whose clock is 10 s ahead
    try:
        scraped = ApiMetrics(redis_conn, ["skewed"]).exposition().decode()
    finally:
        metrics.withdraw(redis_conn)
        heartbeat.end()
    assert 'tokenline:worker_up{model="skewed",worker="skewed-host.1"} 1.0' in scraped
    assert abs(clock.now() - redis_now()) < 0.05
