"""Real weights: SmolLM2-135M-Instruct (a 30-layer Llama, GQA 9/3, a real byte-level BPE tokenizer and
ChatML template) on the engine, against transformers' own `generate()`, greedy, token for token and
text for text: a dozen chat prompts alone, in one batch with their prompts in chunks, joining a
running batch, in a pool too small for all of them (preempted and recomputed), and again from the
prefix cache. Real text shows a wrong token where random weights' noise would hide it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.prompt import PromptBuilder
from schemas.chat import Message
from schemas.job import JobPayload
from schemas.model_files import ModelFiles
from schemas.sampling import SamplingParams
from tests.engine_runs import run, serve
from workers.engine.core import CacheConfig, EngineCore
from workers.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.real_weights

MAX_NEW_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "List two fruits that are red.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def loaded(smollm2: Path) -> LoadedModel:
    return load_model(smollm2, torch.device("cpu"))


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False)
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def expected(loaded: LoadedModel, prompt_ids: list[list[int]]) -> dict[str, list[int]]:
    """`generate()`'s greedy ids, up to and with the end-of-turn token, before an engine takes the model."""
    out = {}
    for i, ids in enumerate(prompt_ids):
        tokens = loaded.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        out[f"p{i}"] = tokens[0, len(ids) :].tolist()
    return out


def payloads(prompt_ids: list[list[int]], prefix: str = "") -> list[JobPayload]:
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    return [JobPayload(f"{prefix}p{i}", "smollm2", tuple(ids), sampling, "ch") for i, ids in enumerate(prompt_ids)]


def test_the_api_renders_the_prompts_transformers_renders(smollm2: Path, prompt_ids: list[list[int]]) -> None:
    builder = PromptBuilder(ModelFiles(smollm2))
    for prompt, ids in zip(PROMPTS, prompt_ids, strict=True):
        text = builder.chat_prompt((Message("user", prompt),))
        assert builder.encode(text, add_special_tokens=False) == ids


def test_the_model_answers_in_real_text(tokenizer: PreTrainedTokenizerBase, expected: dict[str, list[int]]) -> None:
    assert tokenizer.decode(expected["p0"], skip_special_tokens=True) == "The capital of France is Paris."


def test_each_prompt_alone_equals_generate(loaded: LoadedModel, prompt_ids: list[list[int]], expected: dict) -> None:
    engine = EngineCore.build(loaded, 2048, 1, cache=CacheConfig(prefix_caching=False))
    for p in payloads(prompt_ids)[::2]:  # every other prompt: the batched tests below serve all twelve
        assert serve(engine, {0: [p]}) == {p.request_id: expected[p.request_id]}


def test_one_batch_with_chunked_prompts_equals_generate_and_so_does_its_text(
    loaded: LoadedModel, prompt_ids: list[list[int]], expected: dict, tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = EngineCore.build(loaded, 2048, 12, cache=CacheConfig(block_size=16, max_prefill_tokens=64))
    events = run(engine, *payloads(prompt_ids))
    for request_id, ids in expected.items():
        text = "".join(e.text for e in events[request_id] if e.kind == "token")
        assert text == tokenizer.decode(ids, skip_special_tokens=True), request_id
    # The same prompts again on the same engine: their prefixes come from the cache.
    hits = engine.kv.hits
    again = serve(engine, {0: payloads(prompt_ids, "again-")})
    assert {k.removeprefix("again-"): v for k, v in again.items()} == expected
    assert engine.kv.hits > hits


def test_requests_joining_a_running_batch_equal_generate(
    loaded: LoadedModel, prompt_ids: list[list[int]], expected: dict
) -> None:
    engine = EngineCore.build(loaded, 2048, 12, cache=CacheConfig(block_size=16, max_prefill_tokens=32))
    batch = payloads(prompt_ids)
    assert serve(engine, {0: batch[:4], 3: batch[4:8], 6: batch[8:]}) == expected


def test_requests_preempted_and_recomputed_equal_generate(
    loaded: LoadedModel, prompt_ids: list[list[int]], expected: dict
) -> None:
    """A pool of 24 blocks of 16 tokens: eight prompts of 3 blocks fill it, and as they grow the newest
    are preempted."""
    per_block = 16 * 2 * 30 * 3 * 64 * 4  # 16 tokens × K and V × 30 layers × 3 KV heads × 64 × float32
    pool = (24 * per_block + 0.5) / 2**30  # (no prefix cache: the prompts would share their system prompt)
    cache = CacheConfig(block_size=16, max_prefill_tokens=256, mem_gib=pool, prefix_caching=False)
    engine = EngineCore.build(loaded, 2048, 12, cache=cache)
    assert engine.kv.num_blocks == 24
    assert serve(engine, {0: payloads(prompt_ids)}) == expected
    assert engine.scheduler.preemptions > 0


BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 4  # one 16-token block: K and V × 30 layers × 3 KV heads × 64 × float32


def test_requests_preempted_to_the_host_tier_resume_without_recomputing_and_equal_generate(
    loaded: LoadedModel, prompt_ids: list[list[int]], expected: dict
) -> None:
    """The pool of the test above, with a host tier (cpuMemSize) of 96 blocks: the preempted sequences'
    blocks go there and come back; nothing is computed twice."""
    cache = CacheConfig(
        block_size=16,
        max_prefill_tokens=256,
        mem_gib=(24 * BLOCK_BYTES + 0.5) / 2**30,
        prefix_caching=False,
        host_gib=(96 * BLOCK_BYTES + 0.5) / 2**30,
    )
    engine = EngineCore.build(loaded, 2048, 12, cache=cache)
    assert engine.runner.host is not None and engine.runner.host.num_blocks == 96
    assert serve(engine, {0: payloads(prompt_ids)}) == expected
    assert engine.scheduler.preemptions > 0 and engine.scheduler.recomputed == 0
    assert engine.kv.swapped_out > 0 and engine.kv.swapped_in == engine.kv.swapped_out
    assert sorted(engine.kv.host.free) == list(range(96))  # every swapped block came back


def test_a_prefix_evicted_to_the_host_tier_is_copied_back_and_equals_generate(
    loaded: LoadedModel, prompt_ids: list[list[int]], expected: dict
) -> None:
    """A pool of 24 blocks: three prompts, then the others (a few tokens each) evict their blocks to the
    host tier, from which the three, sent again, take their prefixes."""
    cache = CacheConfig(
        block_size=16,
        max_prefill_tokens=256,
        mem_gib=(24 * BLOCK_BYTES + 0.5) / 2**30,
        host_gib=(200 * BLOCK_BYTES + 0.5) / 2**30,
    )
    engine = EngineCore.build(loaded, 2048, 4, cache=cache)
    first = payloads(prompt_ids[:3])
    want = {p.request_id: expected[p.request_id] for p in first}
    assert serve(engine, {0: first}) == want
    short = SamplingParams(max_tokens=4, temperature=0.0)
    others = [JobPayload(f"other-{i}", "smollm2", tuple(ids), short, "ch") for i, ids in enumerate(prompt_ids[3:])]
    serve(engine, {0: others})
    assert engine.kv.swapped_out > 0 and engine.kv.host_hits == 0
    again = serve(engine, {0: payloads(prompt_ids[:3], "again-")})
    assert {k.removeprefix("again-"): v for k, v in again.items()} == want
    assert engine.kv.host_hits > 0 and engine.kv.swapped_in > 0
