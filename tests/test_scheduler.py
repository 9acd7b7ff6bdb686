"""The scheduler's plans (workers/engine/scheduler.py), on requests alone: no model, no device."""

from __future__ import annotations

from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from workers.engine.request import Request
from workers.engine.scheduler import MIXED_PREFILL_MAX_TOKENS, Scheduler


class NoTokenizer:
    """The scheduler never decodes: a stand-in for the detokenizer's tokenizer."""


def request(request_id: str, prompt_tokens: int = 8, n: int = 1) -> Request:
    payload = JobPayload(request_id, "m", tuple(range(prompt_tokens)), SamplingParams(max_tokens=4), "ch", n)
    return Request.create(payload, NoTokenizer(), max_model_len=4096)


def ids(sequences: list) -> list[str]:  # type: ignore[type-arg]
    return [s.request.request_id for s in sequences]


def test_newcomers_are_admitted_first_come_first_served_up_to_the_batch_size() -> None:
    scheduler = Scheduler(max_batch_size=3)
    for name in ("a", "b", "c", "d"):
        scheduler.add(request(name))
    plan = scheduler.schedule()
    assert ids(plan.prefill) == ["a", "b", "c"] and not plan.decode
    assert ids(scheduler.running) == ["a", "b", "c"] and ids(list(scheduler.waiting)) == ["d"]
    plan = scheduler.schedule()  # the batch is full: the running rows decode
    assert plan.prefill == [] and plan.decode


def test_a_finished_sequence_leaves_and_its_slot_goes_to_the_next_waiting_one() -> None:
    scheduler = Scheduler(max_batch_size=2)
    first, second, third = request("a"), request("b"), request("c")
    for r in (first, second, third):
        scheduler.add(r)
    scheduler.schedule()
    first.sequences[0].finish_reason = "stop"
    plan = scheduler.schedule()
    assert ids(plan.finished) == ["a"] and ids(plan.prefill) == ["c"]
    assert ids(scheduler.running) == ["b", "c"]


def test_short_prompts_ride_with_the_running_rows_decode_only_when_the_forward_can_mix() -> None:
    for mixable in (True, False):
        scheduler = Scheduler(max_batch_size=4, mixable=mixable)
        scheduler.add(request("running"))
        scheduler.schedule()
        scheduler.add(request("short", prompt_tokens=MIXED_PREFILL_MAX_TOKENS - 1))
        plan = scheduler.schedule()
        assert ids(plan.prefill) == ["short"] and plan.decode is mixable


def test_a_long_prompt_is_prefilled_apart_from_the_running_rows_decode() -> None:
    scheduler = Scheduler(max_batch_size=4, mixable=True)
    scheduler.add(request("running"))
    scheduler.schedule()
    scheduler.add(request("long", prompt_tokens=MIXED_PREFILL_MAX_TOKENS))
    plan = scheduler.schedule()
    assert ids(plan.prefill) == ["long"] and not plan.decode
    assert scheduler.schedule().decode  # then both decode


def test_n_choices_are_sequences_that_take_a_slot_each_and_a_removed_request_leaves_the_line() -> None:
    scheduler = Scheduler(max_batch_size=2)
    three = request("n3", n=3)
    scheduler.add(three)
    scheduler.add(request("other"))
    assert [s.index for s in scheduler.schedule().prefill] == [0, 1]
    scheduler.remove(three)  # cancelled: its third choice never runs
    assert [s.request.request_id for s in scheduler.waiting] == ["other"]
