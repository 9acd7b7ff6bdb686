"""The engine in-process on the demo model: stopping, lengths, seeds, cancellation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.job import Event, JobPayload
from schemas.sampling import SamplingParams
from workers.engine import Engine
from workers.model import LoadedModel, load_model

PROMPT = (1, 684, 201, 594, 616, 336, 2, 201, 1, 601, 201)


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


def run(engine: Engine, *payloads: JobPayload) -> dict[str, list[Event]]:
    for payload in payloads:
        engine.add_request(payload)
    events: dict[str, list[Event]] = {p.request_id: [] for p in payloads}
    while engine.has_work:
        for event in engine.step():
            events[event.request_id].append(event)
    return events


def payload(request_id: str = "r", **params) -> JobPayload:  # type: ignore[no-untyped-def]
    return JobPayload(request_id, "demo", PROMPT, SamplingParams(**{"max_tokens": 16, **params}), "ch")


def text(events: list[Event]) -> str:
    return "".join(e.text for e in events if e.kind == "token")


def test_max_tokens_gives_length_with_usage_and_contiguous_seq(loaded: LoadedModel) -> None:
    events = run(Engine(loaded, 2560), payload(max_tokens=9, temperature=0, ignore_eos=True))["r"]
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].kind == "done" and events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == 9 and events[-1].usage.prompt_tokens == len(PROMPT)


def test_eos_stops_unless_ignore_eos(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 2560)
    engine.eos_ids = frozenset(range(loaded.vocab_size))  # every token is EOS: stop at the first
    done = run(engine, payload(temperature=0))["r"][-1]
    assert (done.finish_reason, done.usage.completion_tokens) == ("stop", 1)
    done = run(engine, payload(temperature=0, ignore_eos=True, max_tokens=5))["r"][-1]
    assert (done.finish_reason, done.usage.completion_tokens) == ("length", 5)


def test_stop_string_finishes_with_stop(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 2560)
    full = text(run(engine, payload(temperature=0, ignore_eos=True, max_tokens=30))["r"])
    stop = full[8:11]
    events = run(engine, payload(temperature=0, ignore_eos=True, max_tokens=30, stop=(stop,)))["r"]
    assert text(events) == full[: full.index(stop)]
    assert events[-1].finish_reason == "stop"


def test_generation_is_cut_at_max_seq_len(loaded: LoadedModel) -> None:
    engine = Engine(loaded, max_seq_len=len(PROMPT) + 4)
    done = run(engine, payload(temperature=0, ignore_eos=True, max_tokens=100))["r"][-1]
    assert (done.finish_reason, done.usage.completion_tokens) == ("length", 4)


def test_seeded_request_is_reproducible_alone_and_beside_another(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 2560)
    alone = text(run(engine, payload("a", seed=5, top_p=0.9))["a"])
    together = run(engine, payload("a", seed=5, top_p=0.9), payload("b", seed=6, presence_penalty=1.5))
    assert text(together["a"]) == alone
    assert text(together["b"]) != alone


def test_cancel_ends_the_request_with_a_cancelled_event(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 2560)
    engine.add_request(payload(temperature=0, ignore_eos=True, max_tokens=100))
    engine.step()
    events = engine.cancel("r")
    assert [e.kind for e in events] == ["cancelled"] and not engine.has_work
