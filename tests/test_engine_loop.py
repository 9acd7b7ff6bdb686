"""The engine thread (workers/serving/loop.py) on a real engine, its publisher replaced at its seam."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from schemas.job import Event, JobPayload
from schemas.sampling import SamplingParams
from workers.engine.core import EngineCore
from workers.models.loader import LoadedModel, load_model
from workers.serving.inflight import JobTable
from workers.serving.loop import Admit, EngineLoop, Poster


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


class Collected(Poster):
    """What the engine thread posts, until every request named has ended."""

    def __init__(self, expected: set[str]) -> None:
        self.events: dict[str, list[Event]] = {}
        self.ended: list[str] = []
        self.expected = expected
        self.done = threading.Event()

    def post(self, events: list[Event], ended: list[str], live: list[str]) -> None:
        for event in events:
            self.events.setdefault(event.request_id, []).append(event)
        self.ended += ended
        if self.expected <= set(self.ended):
            self.done.set()


def payload(request_id: str, **params: object) -> JobPayload:
    sampling = SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **params})  # type: ignore[arg-type]
    return JobPayload(request_id, "demo", (1, 684, 201, 594, 616), sampling, "ch")


def serve(engine: EngineCore, *payloads: JobPayload) -> Collected:
    loop = EngineLoop(engine, JobTable(8, 60))
    collected = Collected({p.request_id for p in payloads})
    loop.start(collected)
    try:
        for p in payloads:
            loop.inbox.put(Admit(p))
        assert collected.done.wait(60)
    finally:
        loop.stop()
    return collected


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_thread_serves_requests_the_same_with_or_without_overlapped_steps(
    loaded: LoadedModel, overlap: bool
) -> None:
    requests = [payload("greedy", temperature=0.0), payload("seeded", seed=3, top_k=40, repetition_penalty=1.2)]
    expected = serve(EngineCore.build(loaded, 2560, 8), *requests).events
    got = serve(EngineCore.build(loaded, 2560, 8, overlap=overlap), *requests)
    assert sorted(got.ended) == ["greedy", "seeded"]
    for rid in ("greedy", "seeded"):
        assert [e.to_dict() for e in got.events[rid]] == [e.to_dict() for e in expected[rid]]
        assert got.events[rid][-1].usage.completion_tokens == 24


def test_a_cancel_in_the_inbox_ends_the_request_at_the_next_step(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 8, overlap=True)
    loop = EngineLoop(engine, JobTable(8, 60))
    collected = Collected({"left"})
    loop.start(collected)
    try:
        loop.inbox.put(Admit(payload("left", temperature=0.0, max_tokens=2000)))
        loop.cancel("left")
        assert collected.done.wait(30)
    finally:
        loop.stop()
    assert collected.events["left"][-1].kind == "cancelled"
    assert len(collected.events["left"]) < 2000


def test_a_stop_ends_rqs_dequeue_while_it_retries_an_unreachable_redis(loaded: LoadedModel) -> None:
    """RQ's dequeue retries a lost Redis for ever; the stop flag (set by the warm-shutdown handler, which
    redis-py's reconnect may otherwise swallow) ends it at its next try."""
    import redis
    from rq import Queue
    from rq.exceptions import StopRequested
    from rq.worker import WorkerStatus

    from scripts import localstack
    from workers.serving.intake import IntakeWorker

    port = localstack.free_port()
    server = localstack.start_redis(port)
    connection = redis.Redis(port=port)
    jobs = JobTable(2, 60)
    engine = EngineLoop(EngineCore.build(loaded, 128, 2), jobs)
    stop = threading.Event()
    queues = [Queue("q", connection=connection)]
    worker = IntakeWorker(queues, connection=connection, engine=engine, jobs=jobs, stopping=stop)
    worker.set_state(WorkerStatus.IDLE)  # as in RQ's loop, which is waiting on the queue when Redis goes
    server.kill()
    server.wait()
    outcome: list[BaseException] = []

    def dequeue() -> None:
        try:
            worker.dequeue_job_and_maintain_ttl(1)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=dequeue, daemon=True)
    thread.start()
    thread.join(2.5)
    assert thread.is_alive() and not outcome  # retrying, as RQ does
    stop.set()
    thread.join(30)  # RQ waits 1 s, 2 s, 4 s... between tries, and redis-py retries each connect itself
    assert not thread.is_alive() and isinstance(outcome[0], StopRequested)


def test_a_step_that_raises_fails_every_request_and_stops_the_worker(loaded: LoadedModel) -> None:
    """A step that raises for no request's fault may leave the scheduler and the KV cache half-changed
    (a host-tier bug once left blocks taken and sequences waiting, the engine spinning): every request
    fails, and the worker stops to restart whole, not to serve from that state."""
    engine = EngineCore.build(loaded, 2560, 8)
    loop = EngineLoop(engine, JobTable(8, 60))
    stopped = threading.Event()
    loop.on_fatal = stopped.set

    def broken_schedule() -> None:
        raise KeyError("a corrupted cache")

    engine.scheduler.schedule = broken_schedule  # type: ignore[method-assign]
    collected = Collected({"a", "b"})
    loop.start(collected)
    try:
        loop.inbox.put(Admit(payload("a")))
        loop.inbox.put(Admit(payload("b")))
        assert collected.done.wait(30) and stopped.wait(30)
    finally:
        loop.stop()
    for rid in ("a", "b"):
        (last,) = collected.events[rid][-1:]
        assert last.kind == "error" and "KeyError" in last.error["message"], last
    assert loop.fatal is not None and "KeyError" in loop.fatal
