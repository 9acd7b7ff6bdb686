"""The scheduler's plans and the KV cache manager's blocks (workers/engine/), on requests alone: no model."""

from __future__ import annotations

from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from schemas.vocabulary import Vocabulary
from workers.engine.kv_cache import BlockTable, KVCacheManager
from workers.engine.request import Request
from workers.engine.scheduler import Scheduler, SchedulerOutput

NO_VOCABULARY = Vocabulary((), frozenset())  # the scheduler never decodes


def request(request_id: str, prompt_tokens: int = 8, n: int = 1, first: int = 0, salt: str | None = None) -> Request:
    prompt = tuple(range(first, first + prompt_tokens))
    payload = JobPayload(request_id, "m", prompt, SamplingParams(max_tokens=64), "ch", n, cache_salt=salt)
    return Request.create(payload, NO_VOCABULARY, max_model_len=4096)


def ids(sequences: list) -> list[str]:  # type: ignore[type-arg]
    return [s.request.request_id for s in sequences]


def run(s: Scheduler, plan: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after a pass: the written blocks are committed, and each sampled sequence
    drew a token, which was processed."""
    for item in plan.scheduled:
        sequence = item.sequence
        s.kv.commit(sequence.table, item.start + item.count, sequence.length, sequence.tokens)
        if item.sample:
            item.sequence.sampled += 1
            item.sequence.output_ids.append(token)


def scheduler(blocks: int = 64, batch: int = 4, **limits: int) -> Scheduler:
    return Scheduler(KVCacheManager(blocks, 4), batch, **limits)


def test_newcomers_are_admitted_first_come_first_served_up_to_the_batch_size() -> None:
    s = scheduler(batch=3)
    for name in ("a", "b", "c", "d"):
        s.add(request(name))
    plan = s.schedule()
    assert ids(plan.sampled) == ["a", "b", "c"] and [i.count for i in plan.scheduled] == [8, 8, 8]
    assert ids(s.running) == ["a", "b", "c"] and ids(list(s.waiting)) == ["d"]
    run(s, plan)
    plan = s.schedule()  # the batch is full: the running sequences decode, one token each
    assert [(i.start, i.count, i.sample) for i in plan.scheduled] == [(8, 1, True)] * 3


def test_a_finished_sequence_frees_its_blocks_and_its_slot_goes_to_the_next_waiting_one() -> None:
    s = scheduler(batch=2)
    first, second, third = request("a"), request("b"), request("c")
    for r in (first, second, third):
        s.add(r)
    run(s, s.schedule())
    assert s.kv.used == 4  # 8 prompt tokens each in blocks of 4
    first.sequences[0].finish_reason = "stop"
    plan = s.schedule()
    assert ids(plan.finished) == ["a"] and ids(plan.sampled) == ["b", "c"]
    assert ids(s.running) == ["b", "c"] and first.sequences[0].table.blocks == []


def test_a_long_prompt_is_split_by_max_prefill_tokens_while_the_running_sequence_decodes() -> None:
    s = scheduler(max_prefill_tokens=10)
    s.add(request("a", prompt_tokens=3))
    run(s, s.schedule())
    s.add(request("long", prompt_tokens=25))
    chunks = []
    for _ in range(3):
        plan = s.schedule()
        first = plan.scheduled[0]
        assert (first.sequence.request.request_id, first.count) == ("a", 1)
        chunks.append([(i.start, i.count, i.sample) for i in plan.scheduled if i.sequence.request.request_id == "long"])
        run(s, plan)
    assert chunks == [[(0, 10, False)], [(10, 10, False)], [(20, 5, True)]]


def test_a_cached_prefix_is_not_computed_again_unless_the_salt_differs() -> None:
    s = scheduler()
    s.add(request("first", prompt_tokens=14))
    run(s, s.schedule())
    s.running[0].finish_reason = "stop"
    s.add(request("again", prompt_tokens=14))
    s.add(request("other tenant", prompt_tokens=14, salt="tenant-b"))
    plan = s.schedule()
    # 3 full blocks of 4 were written; the last token is always computed.
    assert [(i.sequence.request.request_id, i.start, i.count) for i in plan.scheduled] == [
        ("again", 12, 2),
        ("other tenant", 0, 14),
    ]
    assert s.kv.hits == 12 and s.kv.queries == 42


def test_when_the_pool_runs_out_the_newest_running_sequence_is_preempted_and_resumes_later() -> None:
    s = scheduler(blocks=6, batch=4)  # 24 slots
    for name, first in (("old", 0), ("new", 100)):
        s.add(request(name, prompt_tokens=8, first=first))
    run(s, s.schedule())  # 8 tokens each: 2 blocks each, 2 free
    for _ in range(4):  # both grow to 12 tokens: 3 blocks each, none free
        run(s, s.schedule())
    plan = s.schedule()  # `old` needs a fourth block: `new` gives its blocks back
    assert ids(plan.preempted) == ["new"] and ids(plan.sampled) == ["old"]
    assert ids(list(s.waiting)) == ["new"] and s.running[0].table.blocks and s.kv.used == 4
    new = s.waiting[0]
    assert new.table.blocks == [] and new.preemptions == 1 and len(new.output_ids) == 5
    run(s, plan)
    s.running[0].finish_reason = "length"
    plan = s.schedule()  # `old` left: `new` is computed again from its 13 tokens so far, after the two
    # blocks of its prompt still cached (its third block, freed first, went to `old`)
    assert [(i.sequence.request.request_id, i.start, i.count, i.sample) for i in plan.scheduled] == [
        ("new", 8, 5, True)
    ]


def test_blocks_no_sequence_holds_are_evicted_least_recently_used_first() -> None:
    kv = KVCacheManager(4, 2)
    tables = [BlockTable(None) for _ in range(2)]
    for i, table in enumerate(tables):
        assert kv.admit(table, [i, i, i, i, 9]) == 0
        assert kv.allocate(table, 4)
        kv.commit(table, 4, 5, lambda i=i: [i, i, i, i, 9])
    kv.release(tables[0])
    kv.release(tables[1])
    # A third sequence needs 2 blocks: it takes sequence 0's (released first), tail block first.
    third = BlockTable(None)
    assert kv.admit(third, [5, 5, 5]) == 0 and kv.allocate(third, 4)
    again = [BlockTable(None), BlockTable(None)]
    assert kv.admit(again[0], [0, 0, 0, 0, 9]) == 0  # evicted
    assert kv.admit(again[1], [1, 1, 1, 1, 9]) == 4  # still cached


def test_beside_running_decodes_a_prompt_enters_in_prefill_chunks_and_alone_in_max_prefill_tokens() -> None:
    s = scheduler(max_prefill_tokens=20, prefill_chunk=6)
    s.add(request("alone", prompt_tokens=30))
    plan = s.schedule()
    assert [(i.start, i.count) for i in plan.scheduled] == [(0, 20)]  # nothing decodes: the cap
    run(s, plan)
    plan = s.schedule()
    assert [(i.start, i.count) for i in plan.scheduled] == [(20, 10)]
    run(s, plan)
    s.add(request("joining", prompt_tokens=30, first=50))
    plan = s.schedule()  # `alone` decodes now: the newcomer gets a chunk
    assert [(i.sequence.request.request_id, i.count) for i in plan.scheduled] == [("alone", 1), ("joining", 6)]


def test_with_chunk_per_decode_many_decodes_let_more_prompt_tokens_in() -> None:
    s = scheduler(batch=8, max_prefill_tokens=20, prefill_chunk=2, chunk_per_decode=1)
    for i in range(5):
        s.add(request(f"d{i}", prompt_tokens=3, first=10 * i))
    run(s, s.schedule())  # five decoding from now on
    s.add(request("long", prompt_tokens=30, first=100))
    plan = s.schedule()
    assert [i.count for i in plan.scheduled if i.sequence.request.request_id == "long"] == [5]


def test_with_preemption_off_a_full_pool_still_makes_progress_by_preempting_once() -> None:
    s = scheduler(blocks=6, batch=4, max_preempt=0)  # MindIE's maxPreemptCount 0
    for name, first in (("old", 0), ("new", 100)):
        s.add(request(name, prompt_tokens=8, first=first))
    run(s, s.schedule())
    for _ in range(4):  # both fill their third block: the pool is full
        run(s, s.schedule())
    plan = s.schedule()  # neither can grow: without a preemption nothing would ever run again
    assert ids(plan.preempted) == ["new"] and ids(plan.sampled) == ["old"]
