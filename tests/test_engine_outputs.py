"""The engine's per-request output features in-process on the demo model: logprobs of sampled and
prompt tokens against transformers (prompt scored across chunks and beside other requests), grammar
constraints in a mixed batch, min_tokens, stop token ids, include_stop_str_in_output, max_tokens 0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas import guided
from schemas.errors import ConstraintFailed
from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from tests.engine_runs import run
from workers.engine.core import CacheConfig, EngineCore, Launched, StepResult
from workers.models.loader import LoadedModel, load_model

PROMPT = tuple(range(40, 77))  # 37 tokens: several chunks of 8
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


@pytest.fixture(scope="module")
def plain(demo_model: Path) -> torch.nn.Module:
    """The same checkpoint in transformers, with its own attention: the reference."""
    return AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()


def payload(request_id: str, prompt: tuple[int, ...] = PROMPT, **params) -> JobPayload:  # type: ignore[no-untyped-def]
    return JobPayload(request_id, "demo", prompt, SamplingParams(**{"max_tokens": 8, **params}), "ch")


def reference(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def test_sampled_and_prompt_logprobs_match_transformers_across_chunks_and_beside_others(
    loaded: LoadedModel, plain: torch.nn.Module
) -> None:
    engine = EngineCore.build(loaded, 512, 4, cache=CacheConfig(prefill_chunk=8, max_prefill_tokens=8))
    events = run(
        engine,
        payload("other", tuple(range(100, 130)), temperature=0.9, seed=3, max_tokens=12),
        payload("scored", temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True),
    )["scored"]
    prompt_entries = [e for ev in events if ev.kind == "prompt" for e in ev.logprobs]
    token_entries = [e for ev in events if ev.kind == "token" for e in ev.logprobs or []]
    assert prompt_entries[0] is None and len(prompt_entries) == len(PROMPT)
    assert len(token_entries) == 8
    generated = [entry[0] for entry in token_entries]
    expected = reference(plain, [*PROMPT, *generated])
    for position, (token, logprob, top, rank) in enumerate(prompt_entries[1:], start=1):
        assert token == PROMPT[position]
        assert logprob == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
        assert [t for t, _ in top] == expected[position - 1].topk(2).indices.tolist()
        assert rank == int((expected[position - 1] > expected[position - 1, token]).sum()) + 1
    for i, (token, logprob, top) in enumerate(token_entries):
        row = expected[len(PROMPT) - 1 + i]
        assert token == row.argmax().item()  # greedy
        assert logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert [v for _, v in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_a_preempted_scoring_request_scores_each_prompt_token_once(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 512, 2, cache=CacheConfig(prefill_chunk=8, max_prefill_tokens=8))
    engine.add_request(payload("scored", temperature=0, prompt_logprobs=0, max_tokens=2))
    prompt_events = [e for e in engine.step().events if e.kind == "prompt"]  # the first chunk is scored
    sequence = engine.requests["scored"].sequences[0]
    engine.scheduler._preempt(sequence, engine.scheduler.schedule())  # as when the pool runs out
    while engine.has_work:
        prompt_events += [e for e in engine.step().events if e.kind == "prompt"]
    scored = [e for event in prompt_events for e in event.logprobs]
    assert sequence.preemptions == 1 and scored[0] is None
    assert [entry[0] for entry in scored[1:]] == list(PROMPT[1:])  # computed twice, scored once


def test_constrained_requests_follow_their_schema_in_a_mixed_batch(loaded: LoadedModel) -> None:
    grammar = guided.json_schema(SCHEMA)
    engine = EngineCore.build(loaded, 512, 8)
    payloads = [payload(f"json{i}", grammar=grammar, seed=i + 1, max_tokens=40) for i in range(4)]
    payloads += [payload(f"free{i}", seed=i + 1, max_tokens=10, ignore_eos=True) for i in range(4)]
    events = run(engine, *payloads)
    for i in range(4):
        done = events[f"json{i}"][-1]
        assert done.finish_reason == "stop"
        value = json.loads("".join(e.text for e in events[f"json{i}"] if e.kind == "token"))
        assert set(value) == {"ok", "n"} and type(value["ok"]) is bool and 0 <= value["n"] <= 99
        assert events[f"free{i}"][-1].usage.completion_tokens == 10
    alone = run(EngineCore.build(loaded, 512, 8), payload("free0", seed=1, max_tokens=10, ignore_eos=True))
    assert [e.text for e in alone["free0"]] == [e.text for e in events["free0"]]


# "<think>" and "</think>" as the demo tokenizer writes them: several tokens each.
OPEN, CLOSE = (30, 285, 324, 77, 32), (30, 17, 285, 324, 77, 32)


def test_a_grammar_constrains_only_the_answer_after_a_reasoning(loaded: LoadedModel) -> None:
    """A reasoning model's grammar starts once its reasoning is over: inside it from the prompt, the
    reasoning runs free (here until its thinking budget forces the end); where the model may open one,
    the opening is allowed beside the grammar's first tokens and, once begun, written whole; where it
    answers at once, the grammar holds from its first token."""
    grammar = guided.json_schema(SCHEMA)
    thinking = {"grammar": grammar, "max_tokens": 60, "return_token_ids": True, "thinking_end": CLOSE}
    events = run(
        EngineCore.build(loaded, 512, 4),
        payload("inside", seed=1, thinking_budget=4, **thinking),
        payload("opens", seed=2, thinking_budget=3, thinking_start=OPEN, logit_bias=((OPEN[0], 60.0),), **thinking),
        payload("answers", seed=3, thinking_start=OPEN, logit_bias=((OPEN[0], -60.0),), **thinking),
    )
    ids = {name: [t for e in events[name] for t in e.token_ids or ()] for name in events}
    text = {name: "".join(e.text for e in events[name] if e.kind == "token") for name in events}
    assert all(events[name][-1].finish_reason == "stop" for name in events), events
    assert ids["inside"][4:10] == list(CLOSE)  # four tokens of reasoning, then its end
    assert ids["opens"][:5] == list(OPEN) and ids["opens"][8:14] == list(CLOSE)
    for name in ("inside", "opens"):
        answer = json.loads(text[name].split("</think>", 1)[1])
        assert set(answer) == {"ok", "n"}
    assert set(json.loads(text["answers"])) == {"ok", "n"}  # followed from the first token


def test_a_grammar_the_engine_fails_on_mid_output_ends_its_request_as_the_clients_error(
    loaded: LoadedModel,
) -> None:
    """llguidance builds a pattern's lexer lazily: a million-fold repeat compiles, and fails at the
    first token drawn under it. That request ends with a 400-type error naming the constraint; the
    batch beside it runs on."""
    grammar = guided.json_schema(
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}}, "required": ["a"]}
    )
    engine = EngineCore.build(loaded, 512, 4)
    events = run(engine, payload("huge", grammar=grammar, seed=1), payload("free", seed=1, ignore_eos=True))
    error = events["huge"][-1]
    assert error.kind == "error", events["huge"]
    assert (error.error["type"], error.error["code"]) == ("invalid_request_error", "constraint_failed")
    assert error.error["message"].startswith(
        "The output constraint could not be followed: lexer error: too many expressions constructed. "
    )
    assert events["free"][-1].usage.completion_tokens == 8
    assert not engine.requests


def with_tokenizer(demo_model: Path, path: Path, change) -> LoadedModel:  # type: ignore[no-untyped-def]
    """The demo model with its tokenizer.json as `change` leaves it."""
    shutil.copytree(demo_model, path)
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    change(data)
    (path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return load_model(path, torch.device("cpu"))


def test_a_tokenizer_with_a_token_past_the_models_logits_still_constrains(demo_model: Path, tmp_path: Path) -> None:
    """An added token past the embedding (id 4096 of a 4,096-row model; transformers' GGUF loader adds
    one to Llama 3's vocabulary): the model never draws it, and the grammar engine reads the tokenizer
    without it (llguidance refuses a tokenizer larger than the vocabulary it is given)."""

    def extra(data: dict) -> None:
        data["added_tokens"].append(
            {"id": 4096, "content": "<|extra|>", "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": True}
        )

    grammar = guided.json_schema(SCHEMA)
    events = run(
        EngineCore.build(with_tokenizer(demo_model, tmp_path / "m", extra), 512, 2),
        payload("j", grammar=grammar, seed=1, max_tokens=40),
    )
    assert events["j"][-1].finish_reason == "stop"
    assert set(json.loads("".join(e.text for e in events["j"] if e.kind == "token"))) == {"ok", "n"}


def test_a_tokenizer_the_grammar_engine_cannot_read_refuses_constrained_requests_at_once(
    demo_model: Path, tmp_path: Path
) -> None:
    """Reading a tokenizer holds the GIL for seconds on a large vocabulary: where llguidance refuses
    one (here, no decoder), it is tried once, and every constrained request is refused with the
    reason; the others run."""

    def no_decoder(data: dict) -> None:
        data["decoder"] = None

    engine = EngineCore.build(with_tokenizer(demo_model, tmp_path / "m", no_decoder), 512, 4)
    with pytest.raises(ConstraintFailed) as refused:
        _ = engine.grammars
    assert str(refused.value) == (
        "Constrained decoding is unavailable for this model: the grammar engine cannot read its tokenizer "
        "(can't determine decoder type: None)."
    )
    with pytest.raises(ConstraintFailed) as again:
        engine.add_request(payload("j1", grammar=guided.json_schema(SCHEMA)))
    assert again.value is refused.value  # kept, not read again
    events = run(engine, payload("free", seed=1, ignore_eos=True))
    assert events["free"][-1].usage.completion_tokens == 8


def test_a_complete_grammar_ends_the_output_before_min_tokens(loaded: LoadedModel) -> None:
    """Nothing the grammar allows could follow its end, so it wins over min_tokens (which held back
    the only token left: a 500)."""
    grammar = guided.json_schema(SCHEMA)
    events = run(
        EngineCore.build(loaded, 512, 2), payload("short", grammar=grammar, seed=1, max_tokens=60, min_tokens=50)
    )
    done = events["short"][-1]
    assert done.kind == "done" and done.finish_reason == "stop" and done.usage.completion_tokens < 50
    value = json.loads("".join(e.text for e in events["short"] if e.kind == "token"))
    assert set(value) == {"ok", "n"}


def test_min_tokens_holds_back_eos_and_stop_token_ids(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 512)
    eos = tuple(range(4000))  # nearly every token ends the sequence
    engine.output.eos_ids, engine.sampler.eos_ids = frozenset(eos), eos
    early = run(engine, payload("a", temperature=0, max_tokens=10, logprobs=0))["a"]
    first = next(e for e in early if e.kind == "token" or e.logprobs).logprobs[0][0]
    assert first < 4000 and early[-1].usage.completion_tokens == 1  # without min_tokens: one token
    events = run(engine, payload("b", temperature=0, min_tokens=3, max_tokens=10, logprobs=0, stop_token_ids=(4001,)))
    tokens = [entry[0] for e in events["b"] if e.logprobs for entry in e.logprobs]
    assert all(t >= 4000 and t != 4001 for t in tokens[:3])
    assert len(tokens) == events["b"][-1].usage.completion_tokens >= 4


def test_a_stop_token_id_ends_the_sequence(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 512)
    first = run(engine, payload("a", temperature=0, max_tokens=3, logprobs=0))["a"]
    token = next(e for e in first if e.kind == "token").logprobs[0][0]
    done = run(engine, payload("b", temperature=0, max_tokens=3, stop_token_ids=(token,)))["b"][-1]
    assert (done.finish_reason, done.usage.completion_tokens) == ("stop", 1)


def test_include_stop_str_in_output_keeps_the_stop_string(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 512)
    full = "".join(e.text for e in run(engine, payload("a", temperature=0, max_tokens=30, ignore_eos=True))["a"])
    stop = full[8:11]
    kept = run(engine, payload("b", temperature=0, max_tokens=30, stop=(stop,), include_stop_str_in_output=True))
    assert "".join(e.text for e in kept["b"]) == full[: full.index(stop) + len(stop)]


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(loaded: LoadedModel) -> None:
    events = run(EngineCore.build(loaded, 512), payload("r", max_tokens=0, prompt_logprobs=0))["r"]
    assert [e.kind for e in events] == ["prompt", "done"]
    assert events[-1].usage.completion_tokens == 0 and events[-1].finish_reason == "length"


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(loaded: LoadedModel) -> None:
    engine = EngineCore.build(loaded, 512)
    bos = 0  # the demo tokenizer's <|endoftext|>, a special token
    kept = run(engine, payload("a", temperature=0, max_tokens=3, logit_bias=((bos, 100.0),), skip_special_tokens=False))
    skipped = run(engine, payload("b", temperature=0, max_tokens=3, logit_bias=((bos, 100.0),)))
    assert "".join(e.text for e in kept["a"]) == "<|endoftext|>" * 3
    assert "".join(e.text for e in skipped["b"]) == ""


def test_include_stop_str_in_output_keeps_the_stopping_token_as_text_like_any_other(loaded: LoadedModel) -> None:
    """vLLM's detokenizer: with include_stop_str_in_output the EOS or stop token id that ended the output
    is text like any other token, a special one skipped unless skip_special_tokens is false. (EOS's
    text was dropped, and a special stop id's written even where special tokens were skipped.)"""
    engine = EngineCore.build(loaded, 512)
    eos, special_stop = min(engine.output.eos_ids), 0  # 0: the demo tokenizer's <|endoftext|>
    eos_text = engine.vocabulary.text_of(eos)
    assert eos_text == "<|im_end|>"
    for token, stop_ids in ((eos, ()), (special_stop, (special_stop,))):
        forced = {"temperature": 0, "max_tokens": 3, "logit_bias": ((token, 100.0),), "stop_token_ids": stop_ids}
        kept = run(engine, payload("k", include_stop_str_in_output=True, skip_special_tokens=False, **forced))["k"]
        skipped = run(engine, payload("s", include_stop_str_in_output=True, **forced))["s"]
        dropped = run(engine, payload("d", skip_special_tokens=False, **forced))["d"]
        text = "<|endoftext|>" if token == special_stop else eos_text
        assert "".join(e.text for e in kept) == text and kept[-1].finish_reason == "stop"
        assert "".join(e.text for e in skipped) == "" == "".join(e.text for e in dropped)


DEMO_BLOCK_BYTES = 16 * 2 * 4 * 2 * 64 * 4  # one 16-token block: K and V × 4 layers × 2 KV heads × 64 × float32


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("host_blocks", [0, 32])
def test_a_preempted_sequence_says_it_waits_after_its_last_token(
    loaded: LoadedModel, overlapped: bool, host_blocks: int
) -> None:
    """Four requests growing to 4 blocks each in a pool of 8: the newest are preempted (recomputed, or
    copied to a host tier). Each preemption is one "waiting" event (app/relay.py then bounds the
    silence as a queued request's), in the request's numbered order, after the token the sequence had
    in flight (when the engine launches step N + 1 before it reads step N's tokens): no token of it
    follows its "waiting" until a step has run it again."""
    cache = CacheConfig(
        block_size=16,
        mem_gib=(8 * DEMO_BLOCK_BYTES + 0.5) / 2**30,
        prefix_caching=False,
        host_gib=(host_blocks * DEMO_BLOCK_BYTES + 0.5) / 2**30,
    )
    engine = EngineCore.build(loaded, 512, 4, cache=cache)
    assert engine.kv.num_blocks == 8
    for i in range(4):
        engine.add_request(payload(f"r{i}", tuple(range(40 + i, 56 + i)), max_tokens=40, ignore_eos=True))
    events: dict[str, list] = {rid: [] for rid in engine.requests}
    waiting: dict[str, bool] = dict.fromkeys(events, False)
    run_again: dict[str, bool] = dict.fromkeys(events, False)

    def ran(launched: Launched | None) -> None:
        for item in launched.plan.scheduled if launched else ():
            run_again[item.sequence.request.request_id] = True

    pending = None
    while engine.has_work or pending is not None:
        launched, result = engine.launch() if engine.has_work else (None, StepResult())
        if overlapped:  # step N + 1 launched, then step N's tokens read
            if pending is not None:
                result.merge(engine.finish(pending))
            pending = launched
        else:
            ran(launched)
            if launched is not None:
                result.merge(engine.finish(launched))
        for event in result.events:
            rid = event.request_id
            if event.kind == "waiting":
                assert not waiting[rid] or run_again[rid]  # preempted again while it was computed again
                waiting[rid], run_again[rid] = True, False
            elif event.kind == "token" and waiting[rid]:
                assert run_again[rid], event  # a token drawn before the preemption came after "waiting"
                waiting[rid] = False
            events[rid].append(event)
        if overlapped:
            ran(launched)
    waits = sum(e.kind == "waiting" for evs in events.values() for e in evs)
    assert waits == engine.scheduler.preemptions > 0
    for rid, emitted in events.items():
        assert [e.seq for e in emitted] == list(range(len(emitted))), rid
        assert emitted[-1].kind == "done" and emitted[-1].usage.completion_tokens == 40
