"""The engine in-process on the demo model: stopping, lengths, seeds, cancellation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.job import Event, JobPayload
from schemas.sampling import SamplingParams
from tests.engine_runs import run
from workers.engine.core import EngineCore
from workers.models.loader import LoadedModel, load_model

PROMPT = (1, 684, 201, 594, 616, 336, 2, 201, 1, 601, 201)


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


def payload(request_id: str = "r", prompt: tuple[int, ...] = PROMPT, **params) -> JobPayload:  # type: ignore[no-untyped-def]
    return JobPayload(request_id, "demo", prompt, SamplingParams(**{"max_tokens": 16, **params}), "ch")


def text(events: list[Event]) -> str:
    return "".join(e.text for e in events if e.kind == "token")


def test_max_tokens_gives_length_with_usage_and_contiguous_seq(loaded: LoadedModel) -> None:
    events = run(EngineCore.build(loaded, 2560), payload(max_tokens=9, temperature=0, ignore_eos=True))["r"]
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].kind == "done" and events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == 9 and events[-1].usage.prompt_tokens == len(PROMPT)


def test_eos_stops_unless_ignore_eos(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560)
    engine.output.eos_ids = frozenset(range(loaded.vocab_size))  # every token is EOS: stop at the first
    done = run(engine, payload(temperature=0))["r"][-1]
    assert (done.finish_reason, done.usage.completion_tokens) == ("stop", 1)
    done = run(engine, payload(temperature=0, ignore_eos=True, max_tokens=5))["r"][-1]
    assert (done.finish_reason, done.usage.completion_tokens) == ("length", 5)


def test_stop_string_finishes_with_stop(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560)
    full = text(run(engine, payload(temperature=0, ignore_eos=True, max_tokens=30))["r"])
    stop = full[8:11]
    events = run(engine, payload(temperature=0, ignore_eos=True, max_tokens=30, stop=(stop,)))["r"]
    assert text(events) == full[: full.index(stop)]
    assert events[-1].finish_reason == "stop"


def test_generation_is_cut_at_max_seq_len(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, len(PROMPT) + 4)
    done = run(engine, payload(temperature=0, ignore_eos=True, max_tokens=100))["r"][-1]
    assert (done.finish_reason, done.usage.completion_tokens) == ("length", 4)


def test_seeded_request_is_reproducible_alone_and_beside_another(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560)
    alone = text(run(engine, payload("a", seed=5, top_p=0.9))["a"])
    together = run(engine, payload("a", seed=5, top_p=0.9), payload("b", seed=6, presence_penalty=1.5))
    assert text(together["a"]) == alone
    assert text(together["b"]) != alone


def test_cancel_ends_the_request_with_a_cancelled_event(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560)
    engine.add_request(payload(temperature=0, ignore_eos=True, max_tokens=100))
    engine.step()
    events = engine.cancel("r")
    assert [e.kind for e in events] == ["cancelled"] and not engine.has_work


def test_a_request_whose_output_processing_fails_gets_its_own_error_and_the_batch_goes_on(
    loaded: LoadedModel,
) -> None:
    engine = EngineCore.build(loaded, 2560, 4)
    healthy = payload("ok", temperature=0, ignore_eos=True, max_tokens=12)
    alone = text(run(EngineCore.build(loaded, 2560, 4), healthy)["ok"])
    engine.add_request(payload("bad", temperature=0, ignore_eos=True, max_tokens=12))
    engine.add_request(healthy)
    prefilled = engine.step().events  # both prefilled

    def broken(token_id: int) -> str:  # a pure seam: this request's detokenizer breaks
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    engine.requests["bad"].sequences[0].detokenizer.push = broken  # type: ignore[method-assign]
    events: dict[str, list[Event]] = {"bad": [], "ok": []}
    for event in prefilled:
        events[event.request_id].append(event)
    while engine.has_work:
        for event in engine.step().events:
            events[event.request_id].append(event)
    assert events["bad"][-1].kind == "error" and "done" not in [e.kind for e in events["bad"]]
    assert "UnicodeDecodeError" in events["bad"][-1].error["message"]
    assert events["ok"][-1].kind == "done" and events["ok"][-1].usage.completion_tokens == 12
    assert text(events["ok"]) == alone


def test_a_failing_prefill_fails_only_the_newcomer_and_the_running_request_goes_on(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 4)
    running = payload("running", temperature=0, ignore_eos=True, max_tokens=10)
    alone = text(run(EngineCore.build(loaded, 2560, 4), running)["running"])
    model = engine.runner.model

    def failing(input_ids: torch.Tensor, **kwargs):  # type: ignore[no-untyped-def]
        """The real model, whose pass over the prompt (7, PROMPT[1:]) raises (a pure seam)."""
        packed = input_ids[0].tolist()
        if any(packed[i : i + 2] == [7, PROMPT[1]] for i in range(len(packed) - 1)):
            raise IndexError("index out of range in self")
        return model(input_ids=input_ids, **kwargs)

    engine.runner.model = failing  # type: ignore[assignment]
    events = run_with_arrival(engine, running, payload("doomed", prompt=(7, *PROMPT[1:]), temperature=0))
    assert [e.kind for e in events["doomed"]] == ["error"]
    assert events["doomed"][0].error["message"] == "Generation failed: IndexError."
    assert text(events["running"]) == alone and events["running"][-1].kind == "done"


def run_with_arrival(engine: EngineCore, first: JobPayload, second: JobPayload) -> dict[str, list[Event]]:
    """`first` runs; `second` arrives at its third step."""
    engine.add_request(first)
    events: dict[str, list[Event]] = {first.request_id: [], second.request_id: []}
    step = 0
    while engine.has_work:
        if step == 2:
            engine.add_request(second)
        for event in engine.step().events:
            events[event.request_id].append(event)
        step += 1
    return events
