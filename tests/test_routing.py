"""Routing by cache (app/routing.py), what workers publish for it (workers/serving/routing.py) and the
moves that keep a routed job from being stranded (schemas/ledger.py `rescue`): the policy as a pure
function, the rest on a real Redis and RQ with the engine's own prefix cache."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from app.admission import Admission
from app.dispatch import Dispatcher
from app.routing import BlockSizes, Decision, Policy, PromptBlocks, Router, WorkerState, worker_states
from schemas.blocks import block_keys
from schemas.config import Settings
from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import (
    live_workers_key,
    queue_name,
    worker_blocks_key,
    worker_heartbeat_key,
    worker_load_key,
    worker_queue_name,
)
from schemas.ledger import FAILURE_TTL_SECONDS
from schemas.sampling import SamplingParams
from workers.engine.kv_cache import BlockTable, KVCacheManager
from workers.serving.inflight import JobTable
from workers.serving.routing import RoutingAgent

BLOCK = 4
POLICY = Policy(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)


def w(name: str, load: int = 0, matched: int = 0) -> WorkerState:
    """A worker whose cache holds the prompt's first `matched` blocks."""
    return WorkerState(name, load, matched * BLOCK)


def decided(worker: str | None, by: str, matched: int = 0) -> Decision:
    """The decision for a 41-token prompt, 10 of whose blocks are reusable; `matched` blocks held."""
    return Decision(worker, by, matched * BLOCK, 10 * BLOCK)


# The policy.


def test_no_live_worker_means_the_shared_queue() -> None:
    assert POLICY.choose([], 10 * BLOCK, 41) == decided(None, "shared", 0)


def test_the_worker_with_the_longest_prefix_gets_the_request() -> None:
    decision = POLICY.choose([w("a", matched=3), w("b", matched=9), w("c")], 10 * BLOCK, 41)
    assert decision == decided("b", "prefix", 9)


def test_among_equal_prefixes_the_least_loaded_wins() -> None:
    decision = POLICY.choose([w("a", 3, 9), w("b", 1, 9), w("c", 0, 2)], 10 * BLOCK, 41)
    assert decision == decided("b", "prefix", 9)


def test_a_match_below_the_threshold_goes_to_the_shared_queue() -> None:
    # 5 blocks of 4 tokens are 20 of 41 tokens: under half.
    assert POLICY.choose([w("a", matched=5), w("b")], 10 * BLOCK, 41) == decided(None, "shared", 5)
    # 6 blocks (24 tokens) are over half.
    assert POLICY.choose([w("a", matched=6), w("b")], 10 * BLOCK, 41) == decided("a", "prefix", 6)


def test_unbalanced_loads_send_the_request_to_the_least_loaded_whatever_it_holds() -> None:
    decision = POLICY.choose([w("a", 7, 10), w("b", 2, 0), w("c", 3, 0)], 10 * BLOCK, 41)
    assert decision == decided("b", "load", 0)


def test_imbalance_needs_both_the_absolute_and_the_relative_gap() -> None:
    assert not POLICY.unbalanced([6, 2])  # a gap of 4 is not above 4
    assert POLICY.unbalanced([7, 2])
    assert not POLICY.unbalanced([40, 35])  # a gap of 5, but 40 is under 1.5 × 35
    assert POLICY.unbalanced([60, 35])
    assert POLICY.choose([w("a", 40, 10), w("b", 35, 0)], 10 * BLOCK, 41).by == "prefix"


def test_one_worker_is_never_unbalanced() -> None:
    assert POLICY.choose([w("a", 50, 10)], 10 * BLOCK, 41) == decided("a", "prefix", 10)


# Block keys: the API's and the engine's agree.


def test_the_engine_registers_the_keys_the_api_computes() -> None:
    tokens = list(range(100, 123))
    kv = KVCacheManager(16, BLOCK)
    table = BlockTable("tenant")
    kv.admit(table, tokens)
    assert kv.allocate(table, len(tokens))
    kv.commit(table, len(tokens), len(tokens), lambda: tokens)
    keys = block_keys(tokens, BLOCK, "tenant")
    assert len(keys) == 5 and kv.keys() == keys
    assert block_keys(tokens[:13], BLOCK, "tenant") == keys[:3]  # a key names its whole prefix
    assert set(block_keys(tokens, BLOCK, None)).isdisjoint(keys)  # and its salt
    assert set(block_keys(tokens, BLOCK, "other")).isdisjoint(keys)


def test_the_cache_tells_what_it_registered_and_evicted() -> None:
    kv = KVCacheManager(4, BLOCK)
    assert kv.changes() == (set(), set())  # nothing is recorded until asked for
    kv.publish()
    first, second = list(range(9)), list(range(50, 59))
    for tokens in (first, second):
        table = BlockTable(None)
        kv.admit(table, tokens)
        assert kv.allocate(table, len(tokens))
        kv.commit(table, len(tokens), len(tokens), lambda tokens=tokens: tokens)
        kv.release(table)
        if tokens is first:
            assert kv.changes() == (set(block_keys(first, BLOCK, None)), set())
    # The second sequence's 3 blocks evicted 2 of the first's (LRU, tails first).
    stored, removed = kv.changes()
    assert stored == set(block_keys(second, BLOCK, None))
    assert removed == set(block_keys(first, BLOCK, None)) - set(kv.keys())
    assert len(removed) == 1 and kv.changes() == (set(), set())


# On Redis: what workers publish, and the router that reads it.


@pytest.fixture()
def model() -> str:
    return f"route-{uuid.uuid4().hex[:8]}"


@pytest.fixture()
def routing_settings(settings: Settings) -> Settings:
    return dataclasses.replace(settings, cache_block_size=BLOCK, routing="cache")


def alive(conn: redis.Redis, model: str, *processes: str) -> None:
    seconds, micros = conn.time()
    for process in processes:
        conn.zadd(live_workers_key(model), {process: seconds * 1000 + micros // 1000})
        conn.set(worker_heartbeat_key(process), "{}", ex=3)


def cached(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> None:
    table = BlockTable(salt)
    kv.admit(table, tokens)
    assert kv.allocate(table, len(tokens))
    kv.commit(table, len(tokens), len(tokens), lambda: tokens)
    kv.release(table)


def publish(agent: RoutingAgent, conn: redis.Redis) -> None:
    """One beat of the worker's beacon."""
    with conn.pipeline(transaction=False) as pipe:
        agent.publish(pipe)
        agent.published(pipe.execute())


def test_a_block_set_redis_lost_is_published_whole_at_the_next_beat(redis_conn: redis.Redis, model: str) -> None:
    """Redis restarted, or the set's TTL ran out while the worker stalled: the changes since alone would
    leave the API routing by the few blocks stored after; the whole cache is published again."""
    kv = KVCacheManager(64, BLOCK)
    process = f"h.{uuid.uuid4().hex[:8]}"
    agent = RoutingAgent(redis_conn, model, process, kv)
    cached(kv, list(range(200, 233)))
    publish(agent, redis_conn)  # at start: the whole cache

    def members() -> set[bytes]:
        return set(redis_conn.smembers(worker_blocks_key(process)))

    assert members() == set(kv.keys()) and len(members()) == 8
    redis_conn.delete(worker_blocks_key(process))  # what a restart of Redis leaves of it
    cached(kv, list(range(300, 309)))  # two blocks more
    publish(agent, redis_conn)  # the changes: the set is found gone
    assert len(members()) == 2
    publish(agent, redis_conn)
    assert members() == set(kv.keys()) and len(members()) == 10


def test_the_router_sends_a_prompt_to_the_worker_whose_cache_holds_it(
    redis_conn: redis.Redis, routing_settings: Settings, model: str
) -> None:
    kvs = {name: KVCacheManager(64, BLOCK) for name in ("h.1", "h.2", "h.3")}
    agents = {name: RoutingAgent(redis_conn, model, name, kv) for name, kv in kvs.items()}
    alive(redis_conn, model, *kvs)
    conversation = list(range(200, 241))
    cached(kvs["h.2"], conversation[:33], salt="tenant")
    cached(kvs["h.3"], conversation[:9], salt="tenant")
    for agent in agents.values():
        publish(agent, redis_conn)
    router = Router(redis_conn, routing_settings)

    queue, decision = router.route(model, conversation, "tenant")
    assert (queue, decision) == (worker_queue_name(model, "h.2"), decided("h.2", "prefix", 8))
    # Another tenant's identical prompt matches nothing: routing never crosses salts.
    assert router.route(model, conversation, "other") == (queue_name(model), decided(None, "shared", 0))
    off = Router(redis_conn, dataclasses.replace(routing_settings, routing="round-robin"))
    assert off.route(model, conversation, "tenant") == (queue_name(model), Decision(None, "shared"))


def test_each_workers_blocks_are_keyed_in_its_own_size_whatever_cache_block_size_says(
    redis_conn: redis.Redis, routing_settings: Settings, model: str
) -> None:
    # flex's and the NPU's kernels take 128-token blocks whatever cacheBlockSize says; workers of one
    # model may differ (a CPU one beside an NPU one).
    small, large = KVCacheManager(64, BLOCK), KVCacheManager(64, 2 * BLOCK)
    agents = [RoutingAgent(redis_conn, model, "h.1", small), RoutingAgent(redis_conn, model, "h.2", large)]
    alive(redis_conn, model, "h.1", "h.2")
    conversation = list(range(200, 241))
    cached(small, conversation[:29], salt="tenant")  # 7 blocks of 4: 28 tokens
    cached(large, conversation[:33], salt="tenant")  # 4 blocks of 8: 32 tokens
    for agent in agents:
        publish(agent, redis_conn)
    router = Router(redis_conn, dataclasses.replace(routing_settings, cache_block_size=128))
    assert router.route(model, conversation, "tenant") == (
        worker_queue_name(model, "h.2"),
        Decision("h.2", "prefix", 32, 40),
    )
    assert [
        s.matched for s in worker_states(redis_conn, model, PromptBlocks(conversation, "tenant"), BlockSizes())
    ] == [
        28,
        32,
    ]


def test_a_workers_load_is_its_batch_and_its_own_queue(
    redis_conn: redis.Redis, routing_settings: Settings, model: str
) -> None:
    alive(redis_conn, model, "h.1", "h.2")
    table = JobTable(8, 60, load=(worker_load_key(model), "h.1"))
    with redis_conn.pipeline(transaction=False) as pipe:
        table.write_load(pipe)
        pipe.execute()
    redis_conn.hset(worker_load_key(model), "h.2", 3)
    redis_conn.rpush(Queue(worker_queue_name(model, "h.1"), connection=redis_conn).key, "a", "b")
    assert worker_states(redis_conn, model) == [w("h.1", 2, 0), w("h.2", 3, 0)]
    # A worker that left the live set is not routed to, whatever it published.
    redis_conn.zrem(live_workers_key(model), "h.2")
    assert worker_states(redis_conn, model) == [w("h.1", 2, 0)]


def test_evictions_leave_the_published_set_and_a_failed_write_is_made_good(redis_conn: redis.Redis, model: str) -> None:
    kv = KVCacheManager(4, BLOCK)
    agent = RoutingAgent(redis_conn, model, "h.1", kv)
    first, second = list(range(9)), list(range(50, 59))
    cached(kv, first)
    publish(agent, redis_conn)
    key = worker_blocks_key("h.1")
    assert redis_conn.smembers(key) == set(block_keys(first, BLOCK, None))
    cached(kv, second)
    publish(agent, redis_conn)
    assert redis_conn.smembers(key) == set(kv.keys())
    assert 0 < redis_conn.ttl(key) <= 60
    # A beat whose writes were lost: the next one publishes the whole cache.
    cached(kv, list(range(70, 75)))
    kv.changes()
    redis_conn.sadd(key, b"stale")
    agent.failed()
    publish(agent, redis_conn)
    assert redis_conn.smembers(key) == set(kv.keys())


# No routed job is stranded.


def job_payload(model: str) -> JobPayload:
    return JobPayload(f"chatcmpl-{uuid.uuid4().hex}", model, (1, 2, 3), SamplingParams(max_tokens=4), "ch")


def enqueue(conn: redis.Redis, name: str, payload: JobPayload) -> Job:
    queue = Queue(name, connection=conn, serializer=JSONSerializer)
    return queue.enqueue_call(JOB_FUNCTION, args=(payload.to_dict(),), job_id=payload.request_id)


def ended_job(conn: redis.Redis, model: str) -> Job:
    """A job as a registry lists one that ended (on no queue)."""
    payload = job_payload(model)
    return Job.create(JOB_FUNCTION, args=(payload.to_dict(),), id=payload.request_id, connection=conn)


def test_a_live_worker_moves_the_jobs_of_a_gone_workers_queue_to_the_shared_queue(
    redis_conn: redis.Redis, model: str
) -> None:
    alive(redis_conn, model, "h.1", "h.2")
    dead, live = worker_queue_name(model, "h.9"), worker_queue_name(model, "h.2")
    stranded = [enqueue(redis_conn, dead, job_payload(model)) for _ in range(3)]
    kept = enqueue(redis_conn, live, job_payload(model))
    waiting = enqueue(redis_conn, queue_name(model), job_payload(model))
    dead_queue = Queue(dead, connection=redis_conn, serializer=JSONSerializer)
    dead_queue.finished_job_registry.add(ended_job(redis_conn, model), 600)
    RoutingAgent(redis_conn, model, "h.1", None).sweep()

    shared = Queue(queue_name(model), connection=redis_conn, serializer=JSONSerializer)
    # In their order, ahead of the jobs that were waiting on the shared queue.
    assert shared.get_job_ids() == [job.id for job in stranded] + [waiting.id]
    assert Job.fetch(stranded[0].id, connection=redis_conn, serializer=JSONSerializer).origin == shared.name
    assert Queue(live, connection=redis_conn).get_job_ids() == [kept.id]
    # The dead worker's queue is gone from RQ's list (and `rq info`), so RQ no longer maintains its
    # registries: they expire once their jobs' records have.
    assert dead not in {q.name for q in Queue.all(connection=redis_conn)}
    assert 0 < redis_conn.ttl(dead_queue.finished_job_registry.key) <= FAILURE_TTL_SECONDS


def test_the_load_of_a_worker_without_a_heartbeat_is_forgotten(redis_conn: redis.Redis, model: str) -> None:
    alive(redis_conn, model, "h.1")
    redis_conn.set(worker_heartbeat_key("h.2"), "{}", ex=3)  # draining: alive, not in the live set
    redis_conn.hset(worker_load_key(model), mapping={"h.1": 2, "h.2": 1, "h.8": 1, "h.9": 0})  # h.8, h.9: killed
    RoutingAgent(redis_conn, model, "h.1", None).sweep()
    assert redis_conn.hgetall(worker_load_key(model)) == {b"h.1": b"2", b"h.2": b"1"}


def test_a_draining_workers_queue_is_emptied_but_kept_while_it_lives(redis_conn: redis.Redis, model: str) -> None:
    alive(redis_conn, model, "h.1")
    redis_conn.set(worker_heartbeat_key("h.2"), "{}", ex=3)  # alive, not taking jobs: not in the live set
    draining = worker_queue_name(model, "h.2")
    job = enqueue(redis_conn, draining, job_payload(model))
    RoutingAgent(redis_conn, model, "h.1", None).sweep()
    assert Queue(queue_name(model), connection=redis_conn).get_job_ids() == [job.id]
    assert draining in {q.name for q in Queue.all(connection=redis_conn)}


def test_a_stopping_worker_hands_its_queue_back(redis_conn: redis.Redis, model: str) -> None:
    kv = KVCacheManager(8, BLOCK)
    cached(kv, list(range(9)))
    agent = RoutingAgent(redis_conn, model, "h.1", kv)
    publish(agent, redis_conn)
    redis_conn.hset(worker_load_key(model), "h.1", 0)
    jobs = [enqueue(redis_conn, agent.queue.name, job_payload(model)) for _ in range(2)]
    agent.queue.canceled_job_registry.add(ended_job(redis_conn, model), 600)
    agent.end()
    assert 0 < redis_conn.ttl(agent.queue.canceled_job_registry.key) <= FAILURE_TTL_SECONDS
    assert agent.shared.get_job_ids() == [job.id for job in jobs]
    assert not redis_conn.exists(worker_blocks_key("h.1"))
    assert not redis_conn.hexists(worker_load_key(model), "h.1")
    assert agent.queue.name not in {q.name for q in Queue.all(connection=redis_conn)}


def test_the_api_moves_its_waiting_request_off_a_gone_workers_queue_once(
    redis_conn: redis.Redis, routing_settings: Settings, model: str
) -> None:
    dispatcher = Dispatcher(redis_conn, routing_settings, Admission(redis_conn, routing_settings))
    alive(redis_conn, model, "h.1")
    payload = job_payload(model)
    enqueue(redis_conn, worker_queue_name(model, "h.1"), payload)
    assert not dispatcher.rescue(payload.request_id, model)  # its worker is live
    redis_conn.zrem(live_workers_key(model), "h.1")
    assert dispatcher.rescue(payload.request_id, model)
    assert not dispatcher.rescue(payload.request_id, model)  # moved once
    job = Job.fetch(payload.request_id, connection=redis_conn, serializer=JSONSerializer)
    assert (job.origin, job.get_status()) == (queue_name(model), JobStatus.QUEUED)


def test_cancelling_takes_a_routed_job_off_its_workers_queue(
    redis_conn: redis.Redis, routing_settings: Settings, model: str
) -> None:
    dispatcher = Dispatcher(redis_conn, routing_settings, Admission(redis_conn, routing_settings))
    payload = job_payload(model)
    routed = worker_queue_name(model, "h.1")
    enqueue(redis_conn, routed, payload)
    dispatcher.cancel(payload.request_id, model, routed)
    assert Queue(routed, connection=redis_conn).get_job_ids() == []
    job = Job.fetch(payload.request_id, connection=redis_conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.CANCELED


@pytest.fixture(autouse=True)
def _clean(redis_conn: redis.Redis) -> Iterator[None]:
    yield
    for queue in Queue.all(connection=redis_conn):
        if queue.name.startswith("tokenline.route-"):
            queue.delete()
