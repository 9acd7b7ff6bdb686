"""Continuous batching in the engine: join and leave a running batch, per-request sampling, n > 1."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch

from schemas.job import Event, JobPayload
from schemas.sampling import SamplingParams
from workers.engine.core import CacheConfig, EngineCore
from workers.models.loader import LoadedModel, load_model
from workers.models.runner import default_threads
from workers.serving.main import GOMP_SPIN_COUNT, set_process_defaults

PROMPTS = ["hello world", "the model is a long prompt with many words in it to need padding", "你好 世界", "redis"]


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


def payload(loaded: LoadedModel, i: int, n: int = 1, **params) -> JobPayload:  # type: ignore[no-untyped-def]
    ids = tuple(loaded.tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids)
    sampling = SamplingParams(**{"max_tokens": 20, "ignore_eos": True, **params})
    return JobPayload(f"r{i}", "demo", ids, sampling, "ch", n)


def drain(engine: EngineCore, arrivals: dict[int, list[JobPayload]] | None = None) -> dict[str, list[Event]]:
    """Step until idle; `arrivals[k]` are added just before step k."""
    arrivals = arrivals or {}
    events: dict[str, list[Event]] = {}
    step = 0
    while engine.has_work or any(k >= step for k in arrivals):
        for p in arrivals.get(step, []):
            engine.add_request(p)
        for event in engine.step().events:
            events.setdefault(event.request_id, []).append(event)
        step += 1
    return events


def texts(events: dict[str, list[Event]]) -> dict[str, str]:
    return {rid: "".join(e.text for e in evs if e.kind == "token") for rid, evs in events.items()}


def solo(loaded: LoadedModel, p: JobPayload) -> str:
    return texts(drain(EngineCore.build(loaded, 2560, 1), {0: [p]}))[p.request_id]


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.0}, {"seed": 5, "top_p": 0.9}, {"seed": 9, "top_k": 50, "repetition_penalty": 1.3}],
)
def test_batched_text_equals_solo_text(loaded: LoadedModel, params: dict) -> None:
    payloads = [payload(loaded, i, **params) for i in range(4)]
    together = texts(drain(EngineCore.build(loaded, 2560, 8), {0: payloads}))
    assert together == {p.request_id: solo(loaded, p) for p in payloads}


def events_of(engine: EngineCore, request_id: str) -> list[Event]:
    return [e for e in engine.step().events if e.request_id == request_id]


def test_a_request_joins_the_running_batch_at_the_next_step_in_one_pass_with_its_decode(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 8, cache=CacheConfig(prefill_chunk=64))  # its 27 tokens in one chunk
    first, second = payload(loaded, 0, max_tokens=30), payload(loaded, 1, seed=3)
    engine.add_request(first)
    for _ in range(5):
        engine.step()
    running = engine.scheduler.running[0]
    assert len(running.output_ids) == 5  # the prefill's token, then one a step
    engine.add_request(second)
    passes = count_threads(engine)
    joined = events_of(engine, "r1")  # its prompt and the running row's decode, in one pass
    assert [s.request.request_id for s in engine.scheduler.running] == ["r0", "r1"]
    assert len(running.output_ids) == 6 and len(engine.scheduler.running[1].output_ids) == 1
    assert len(passes) == 1
    rest = drain(engine)
    assert texts({"r1": joined + rest["r1"]})["r1"] == solo(loaded, second)
    assert texts(rest)["r0"] and len(running.output_ids) == 30


def test_a_long_prompt_joins_in_chunks_while_the_running_row_decodes_every_step(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 8, cache=CacheConfig(max_prefill_tokens=32, prefill_chunk=32))
    first = payload(loaded, 0, max_tokens=30)
    long = dataclasses.replace(payload(loaded, 1, max_tokens=3, seed=4), prompt_token_ids=tuple(range(10, 80)))
    engine.add_request(first)
    engine.step()
    running = engine.scheduler.running[0]
    engine.add_request(long)
    joined = []
    for step in range(3):  # 70 prompt tokens in chunks of 32, 32 and 6, each beside the running decode
        joined += events_of(engine, "r1")
        assert len(running.output_ids) == 2 + step
    assert len(engine.scheduler.running[1].output_ids) == 1 and engine.scheduler.running[1].table.computed == 70
    rest = drain(engine)
    assert texts({"r1": joined + rest["r1"]})["r1"] == solo(loaded, long)
    assert len(running.output_ids) == 30


def test_a_finished_request_leaves_and_frees_its_kv_rows(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 8)
    engine.add_request(payload(loaded, 0, max_tokens=3))
    engine.add_request(payload(loaded, 1, max_tokens=10))
    for _ in range(3):
        engine.step()
    assert "r0" not in engine.requests
    engine.step()
    survivor = engine.scheduler.running[0]
    assert [s.request.request_id for s in engine.scheduler.running] == ["r1"]
    assert engine.kv.used == len(survivor.table.blocks) == engine.kv.blocks_for(survivor.context)


def test_waiting_requests_are_admitted_up_to_max_batch_size(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 2)
    for i in range(3):
        engine.add_request(payload(loaded, i, max_tokens=50))
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 1


def test_cancel_frees_the_slot_for_a_waiting_request(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 2)
    for i in range(3):
        engine.add_request(payload(loaded, i, max_tokens=50))
    engine.step()
    assert [e.kind for e in engine.cancel("r0")] == ["cancelled"]
    engine.step()
    assert sorted(s.request.request_id for s in engine.scheduler.running) == ["r1", "r2"]
    assert engine.kv.used == sum(len(s.table.blocks) for s in engine.scheduler.running)


def test_per_request_limits_hold_inside_a_batch(loaded: LoadedModel) -> None:
    full = solo(loaded, payload(loaded, 1, temperature=0.0, max_tokens=30))
    stop = full[6:9]
    batch = [
        payload(loaded, 0, temperature=0.0, max_tokens=4),
        payload(loaded, 1, temperature=0.0, max_tokens=30, stop=(stop,)),
        payload(loaded, 2, seed=1, max_tokens=12, presence_penalty=2.0, frequency_penalty=2.0),
    ]
    events = drain(EngineCore.build(loaded, 2560, 8), {0: batch})
    done = {rid: evs[-1] for rid, evs in events.items()}
    assert (done["r0"].finish_reason, done["r0"].usage.completion_tokens) == ("length", 4)
    assert done["r1"].finish_reason == "stop" and texts(events)["r1"] == full[: full.index(stop)]
    assert (done["r2"].finish_reason, done["r2"].usage.completion_tokens) == ("length", 12)
    assert texts(events)["r2"] == solo(loaded, batch[2])


def test_n_choices_are_sibling_sequences_with_their_own_index(loaded: LoadedModel) -> None:
    events = drain(EngineCore.build(loaded, 2560, 8), {0: [payload(loaded, 0, n=3, seed=11, max_tokens=8)]})["r0"]
    done = [e for e in events if e.kind == "done"]
    assert sorted(e.index for e in done) == [0, 1, 2]
    assert [e.seq for e in events] == list(range(len(events)))
    by_index = ["".join(e.text for e in events if e.kind == "token" and e.index == i) for i in range(3)]
    assert len(set(by_index)) == 3  # different seeds per choice: seed, seed + 1, seed + 2
    assert by_index[0] == solo(loaded, payload(loaded, 0, seed=11, max_tokens=8))


class Hooked:
    """The engine's real model, with `before(input_ids, positions)` called ahead of each pass (the
    step's packed tokens and their positions)."""

    def __init__(self, engine: EngineCore, before) -> None:  # type: ignore[no-untyped-def]
        self.model, self.runner, self.before = engine.runner.model, engine.runner, before
        engine.runner.model = self  # type: ignore[assignment]

    def __call__(self, input_ids: torch.Tensor, **kwargs):  # type: ignore[no-untyped-def]
        self.before(input_ids[0], kwargs["position_ids"][0])
        return self.model(input_ids=input_ids, **kwargs)


def out_of_memory_on(engine: EngineCore, when) -> list[int]:  # type: ignore[no-untyped-def]
    """Make a pass whose tokens and layout meet `when` raise the device's out-of-memory error; the list
    returned counts the errors raised."""
    raised: list[int] = []

    def before(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        if when(input_ids, positions):
            raised.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    Hooked(engine, before)
    return raised


def count_threads(engine: EngineCore) -> list[int]:
    """The torch thread count at each of the engine's forward passes from now on."""
    threads: list[int] = []
    Hooked(engine, lambda *_: threads.append(torch.get_num_threads()))
    return threads


def test_out_of_memory_in_a_prefill_fails_only_the_arriving_requests(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 4, cache=CacheConfig(prefill_chunk=64))  # the big prompt in one pass
    big = payload(loaded, 1, temperature=0)
    ids = list(big.prompt_token_ids)

    def prefill_of_big(tokens: torch.Tensor, positions: torch.Tensor) -> bool:
        packed = tokens.tolist()
        return any(packed[i : i + len(ids)] == ids for i in range(len(packed) - len(ids) + 1))

    raised = out_of_memory_on(engine, prefill_of_big)
    running, after = payload(loaded, 0, temperature=0), payload(loaded, 2, temperature=0)
    events = drain(engine, {0: [running], 3: [big], 6: [after]})
    assert raised == [1, 1]  # the pass with the running request's decode, then the big prompt's alone
    failed = events[big.request_id]
    assert [e.kind for e in failed] == ["error"]
    assert failed[0].error["code"] == "out_of_memory"
    # The request already running went on untouched, and the next one was served.
    assert texts(events)[running.request_id] == solo(loaded, running)
    assert texts(events)[after.request_id] == solo(loaded, after)


def test_a_decode_that_fails_for_one_sequence_fails_only_it_and_the_batch_goes_on(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 2)
    first, second, waiting = (payload(loaded, i, temperature=0) for i in (1, 0, 2))
    doomed = len(first.prompt_token_ids) + 3  # a position only `first` decodes at: the others end before it
    assert all(len(p.prompt_token_ids) + p.sampling.max_tokens <= doomed for p in (second, waiting))

    def decode_at_doomed(tokens: torch.Tensor, positions: torch.Tensor) -> bool:
        return doomed in positions.tolist()  # only `first`'s decode reaches it

    Hooked(engine, lambda tokens, positions: _raise_index_error() if decode_at_doomed(tokens, positions) else None)
    events = drain(engine, {0: [first, second, waiting]})  # two slots: `waiting` waits
    assert events[first.request_id][-1].kind == "error"
    assert events[first.request_id][-1].error["message"] == "Generation failed: IndexError."
    # The pass of both failed, then each ran alone: only `first` failed again.
    for served in (second, waiting):
        assert events[served.request_id][-1].kind == "done"
        assert texts(events)[served.request_id] == solo(loaded, served)


def _raise_index_error() -> None:
    raise IndexError("index out of range in self")


def test_out_of_memory_in_a_pass_of_several_is_retried_one_sequence_at_a_time(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 2)
    passes = []

    def third_pass_of_two(tokens: torch.Tensor, positions: torch.Tensor) -> bool:
        if len(tokens) == 2:
            passes.append(1)
            return len(passes) == 3
        return False

    raised = out_of_memory_on(engine, third_pass_of_two)
    first, second = (payload(loaded, i, temperature=0) for i in range(2))
    events = drain(engine, {0: [first, second]})
    assert raised == [1]
    for served in (first, second):
        assert events[served.request_id][-1].kind == "done"
        assert texts(events)[served.request_id] == solo(loaded, served)


def test_prefill_threads_serve_an_idle_engine_and_large_prefills_the_steps_keep_their_own(
    loaded: LoadedModel,
) -> None:
    decode_threads = default_threads(torch.device("cpu"))[0]  # what the engine sets
    prefill_threads = decode_threads + 1
    # Every step here follows the last within the hour: the cores count as awake.
    # Chunks of up to 80 prompt tokens beside decodes: the two long prompts enter in one step.
    wide = CacheConfig(prefill_chunk=80)
    engine = EngineCore.build(loaded, 2560, 8, prefill_threads=prefill_threads, warm_cores_seconds=3600, cache=wide)
    engine.runner.stepped_at = time.monotonic()
    first, joining = (
        dataclasses.replace(payload(loaded, i, max_tokens=3, seed=5 + i), prompt_token_ids=tuple(range(10, 20)))
        for i in range(2)
    )
    long = [
        dataclasses.replace(payload(loaded, i, max_tokens=3, seed=i), prompt_token_ids=tuple(range(10, 10 + size)))
        for i, size in ((2, 40), (3, 30))  # 70 prompt tokens in one prefill
    ]
    threads = count_threads(engine)
    events = drain(engine, {0: [first], 1: [joining], 2: long})
    # step 0: `first` prefilled on an idle engine; step 1: the short `joining`, in one pass with the
    # running row's decode; step 2: the two long prompts' 70 tokens beside the decodes; then decodes
    assert threads[:3] == [prefill_threads, decode_threads, prefill_threads]
    assert set(threads[3:]) == {decode_threads}
    assert torch.get_num_threads() == decode_threads
    assert texts(events) == {p.request_id: solo(loaded, p) for p in [first, joining, *long]}


def test_after_a_pause_an_idle_engine_prefills_a_short_prompt_on_the_decode_threads(loaded: LoadedModel) -> None:
    decode_threads = default_threads(torch.device("cpu"))[0]  # what the engine sets
    prefill_threads = decode_threads + 1
    engine = EngineCore.build(loaded, 2560, 8, prefill_threads=prefill_threads, warm_cores_seconds=0)  # always a pause
    short = dataclasses.replace(payload(loaded, 0, max_tokens=2, seed=3), prompt_token_ids=tuple(range(10, 20)))
    large = dataclasses.replace(payload(loaded, 1, max_tokens=2, seed=4), prompt_token_ids=tuple(range(10, 80)))
    threads = count_threads(engine)
    events = {**drain(engine, {0: [short]}), **drain(engine, {0: [large]})}
    # each request: its prefill on an idle engine after a pause, then one decode
    assert threads == [decode_threads, decode_threads, prefill_threads, decode_threads]
    assert texts(events) == {p.request_id: solo(loaded, p) for p in [short, large]}


def test_after_a_cancellation_an_idle_engine_prefills_a_short_prompt_on_the_decode_threads(
    loaded: LoadedModel,
) -> None:
    decode_threads = default_threads(torch.device("cpu"))[0]  # what the engine sets
    prefill_threads = decode_threads + 1
    engine = EngineCore.build(loaded, 2560, 8, prefill_threads=prefill_threads, warm_cores_seconds=3600)  # always awake
    left, arriving, later = (
        dataclasses.replace(payload(loaded, i, max_tokens=2, seed=i), prompt_token_ids=tuple(range(10, 20)))
        for i in range(3)
    )
    engine.runner.stepped_at = time.monotonic()
    threads = count_threads(engine)
    engine.add_request(left)
    engine.step()
    engine.cancel(left.request_id)  # its client hung up after the first token
    events = drain(engine, {0: [arriving]})
    drain(engine, {0: [later]})
    # `left`'s prefill on an idle engine; after the cancellation, `arriving`'s prefill and decode on the
    # decode threads; `later`, after `arriving` finished, on an engine whose cores count as awake again
    assert threads == [prefill_threads, decode_threads, decode_threads, prefill_threads, decode_threads]
    assert texts(events)[arriving.request_id] == solo(loaded, arriving)


def test_the_worker_shortens_libgomps_spin_unless_the_environment_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GOMP_SPINCOUNT", "TORCH_DEVICE_BACKEND_AUTOLOAD", "HF_HUB_OFFLINE", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    set_process_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == GOMP_SPIN_COUNT == "10000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    set_process_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == "300000"


def drain_overlapped(engine: EngineCore, arrivals: dict[int, list[JobPayload]]) -> dict[str, list[Event]]:
    """As the engine thread runs an accelerator: launch step k + 1, then process step k's tokens."""
    events: dict[str, list[Event]] = {}
    pending, step = None, 0
    while engine.has_work or pending is not None or any(k >= step for k in arrivals):
        for p in arrivals.get(step, []):
            engine.add_request(p)
        launched, result = engine.launch() if engine.has_work else (None, None)
        if pending is not None:
            result = engine.finish(pending) if result is None else (result.merge(engine.finish(pending)) or result)
        for event in result.events if result else []:
            events.setdefault(event.request_id, []).append(event)
        pending, step = launched, step + 1
    return events


def test_overlapped_steps_give_the_same_events_as_steps_one_at_a_time(loaded: LoadedModel) -> None:
    full = solo(loaded, payload(loaded, 1, temperature=0.0, max_tokens=30))
    batch = {
        0: [payload(loaded, 0, seed=2, max_tokens=7, repetition_penalty=1.3, presence_penalty=0.5)],
        1: [payload(loaded, 1, temperature=0.0, max_tokens=30, stop=(full[6:9],))],
        3: [payload(loaded, 2, n=2, seed=9, top_k=20, top_p=0.9, max_tokens=12)],
        4: [dataclasses.replace(payload(loaded, 3, seed=1, max_tokens=5), prompt_token_ids=tuple(range(10, 80)))],
    }
    together = drain(EngineCore.build(loaded, 2560, 8), batch)
    overlapped = drain_overlapped(EngineCore.build(loaded, 2560, 8, overlap=True), batch)

    def choices(events: dict[str, list[Event]]) -> dict[tuple[str, int], tuple[str, object]]:
        """Each choice's text and its final event (the order of two choices' events within a step may
        differ: it follows the cache's rows)."""
        out = {}
        for rid, evs in events.items():
            assert [e.seq for e in evs] == list(range(len(evs)))
            for index in {e.index for e in evs}:
                mine = [e for e in evs if e.index == index]
                out[(rid, index)] = ("".join(e.text for e in mine), mine[-1].to_dict() | {"seq": None})
        return out

    assert choices(overlapped) == choices(together)
    assert len(choices(together)) == 5
    assert texts(overlapped)["r1"] == full[: full.index(full[6:9])]


def test_an_overlapped_engine_drops_the_token_a_finished_sequence_drew_in_the_step_after(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 2560, 4, overlap=True)
    engine.add_request(payload(loaded, 0, temperature=0.0, max_tokens=2))
    first, _ = engine.launch()  # the prefill: token 1
    second, _ = engine.launch()  # a decode: token 2, launched before token 1 was read
    engine.finish(first)
    third, _ = engine.launch()  # its end is not known yet: it runs once more
    done = engine.finish(second).events
    assert [e.kind for e in done][-1] == "done" and done[-1].usage.completion_tokens == 2
    assert engine.finish(third).events == []  # its third token is dropped
    assert not engine.has_work and engine.launch()[0] is None  # and its blocks are free at the next step
    assert engine.kv.used == 0
