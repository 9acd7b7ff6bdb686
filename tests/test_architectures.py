"""The paged engine against transformers' own `generate()`: greedy float32 output, token for token, for
tiny random-weight models of the architectures people serve (GQA, QKV bias, q/k norm, tied embeddings,
sliding windows smaller than the prompt, logit soft-capping, learned positions, MoE), alone, in a
batch with prompts split into chunks, joining a running batch, after preemption and on a prefix-cache
hit. The models are built here from transformers configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from schemas.job import JobPayload
from schemas.model_files import ModelFiles, ModelFilesError
from schemas.sampling import SamplingParams
from tests.engine_runs import (
    ARCHITECTURES,
    DEVICE,
    HEADS,
    NEW_TOKENS,
    POOL,
    POOL_GIB,
    SMALL,
    build,
    pass_position_bias,
    payload,
    prompts,
    saved,
    serve,
)
from workers.engine.core import CacheConfig, EngineCore
from workers.models.kv_pool import KVLayout, KVShape, PagedKV
from workers.models.loader import LoadedModel, load_model


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny(request: pytest.FixtureRequest, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = build(request.param, tmp_path_factory.mktemp(request.param), demo_model)
    return load_model(path, DEVICE)


def reference(model: torch.nn.Module, prompt: list[int], eos: list[int] | None = None, whole: bool = True) -> list[int]:
    """`generate()`'s greedy output: NEW_TOKENS tokens (`whole`), or up to an EOS id of `eos`."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS if whole else None,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=eos,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_output_equals_generate_alone_batched_joining_preempted_and_cached(tiny: LoadedModel) -> None:
    loaded = tiny
    expected = {f"p{i}": reference(loaded.model, p) for i, p in enumerate(prompts())}
    payloads = [payload(f"p{i}", p) for i, p in enumerate(prompts())]
    for p in payloads:  # alone
        got = serve(EngineCore.build(loaded, 512, 1, cache=POOL), {0: [p]})
        assert got[p.request_id] == expected[p.request_id], ("alone", p.request_id)
    # In one batch, prompts split into chunks of 16 tokens.
    chunked = CacheConfig(block_size=4, max_prefill_tokens=16, mem_gib=POOL_GIB)
    assert serve(EngineCore.build(loaded, 512, 4, cache=chunked), {0: payloads}) == expected
    # Joining a running batch, one after the other.
    assert (
        serve(EngineCore.build(loaded, 512, 4, cache=chunked), {0: payloads[:1], 2: payloads[1:2], 4: payloads[2:]})
        == expected
    )
    # A pool of 20 blocks of 4 for the full-attention layers: the three cannot grow together, the newest
    # ones are preempted and resumed. Sliding-window layers hold a ring of their window (8) and a step's
    # tokens (16) per batch slot. (One more block and ring: the scratch a compiled step's padding uses.)
    shape = KVShape.of(loaded.model)
    small = CacheConfig(block_size=4, max_prefill_tokens=16, mem_gib=_gib(shape, 20 * 4, rings=4, step=16))
    engine = EngineCore.build(loaded, 512, 4, cache=small)
    slots = [len(keys) for keys in engine.runner.kv.keys]
    assert slots == [(4 + 1) * (w - 1 + 16) if w else (20 + 1) * 4 for w in shape.windows]
    assert serve(engine, {0: payloads}) == expected
    if shape.full_layers:
        assert engine.kv.num_blocks == 20 and engine.scheduler.preemptions > 0
    else:  # every layer slides: the rings are all its memory, and they never run out
        assert engine.scheduler.preemptions == 0
    # The same prompts again on the same engine: from the prefix cache, unless sliding-window layers,
    # which keep only their window, make it unusable.
    again = [payload(f"again-{p.request_id}", list(p.prompt_token_ids)) for p in payloads]
    hits = engine.kv.hits
    got = serve(engine, {0: again})
    assert {k.removeprefix("again-"): v for k, v in got.items()} == expected
    if max(shape.windows):
        assert engine.kv.hits == hits == 0
    else:
        assert engine.kv.hits > hits


def _gib(shape: KVShape, tokens: int, rings: int, step: int) -> float:
    """npuMemSize for `tokens` tokens of the full-attention layers and the sliding ones' rings."""
    window = max(shape.windows)
    ring_bytes = rings * (window - 1 + step) * shape.sliding_bytes_per_token if window else 0
    return (tokens * shape.full_bytes_per_token + ring_bytes + 0.5) / 2**30


def test_a_longrope_models_short_request_is_not_switched_to_long_factors_by_its_neighbour(
    demo_model: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    half = HEADS["head_dim"] // 2
    config = transformers.Phi3Config(
        **SMALL,
        **HEADS,
        max_position_embeddings=512,
        original_max_position_embeddings=16,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * half,
            "long_factor": [4.0 + i for i in range(half)],
            "original_max_position_embeddings": 16,
        },
    )
    loaded = load_model(saved(transformers.Phi3ForCausalLM(config), tmp_path, demo_model), DEVICE)
    short, long = (payload(name, p) for name, p in zip(("short", "long"), prompts()[::2], strict=True))
    expected = reference(loaded.model, list(short.prompt_token_ids))  # before an engine takes the model over
    alone_engine = EngineCore.build(loaded, 512, 1, cache=POOL)
    alone_logits = logits_of(alone_engine, "short")
    assert serve(alone_engine, {0: [short]})["short"] == expected
    # The long prompt (41 tokens) passes the original 16 positions in the same steps as the short one,
    # whose logits stay those it has alone (a switch to the long factors moves them by ~1e-3 here).
    engine = EngineCore.build(loaded, 512, 2, cache=POOL)
    together_logits = logits_of(engine, "short")
    assert serve(engine, {0: [short, long]})["short"] == expected
    assert len(together_logits) == len(alone_logits) == NEW_TOKENS
    for batched, solo in zip(together_logits, alone_logits, strict=True):
        torch.testing.assert_close(batched, solo, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_a_rope_scaled_context_is_served_past_max_position_embeddings_as_generate_runs_it(
    demo_model: Path, tmp_path: Path, rope: dict
) -> None:
    """YaRN added to config.json as Qwen's model cards have users add it (max_position_embeddings left at
    the original 16), and linear scaling: the engine serves 16 × 4 positions, and prompts of 23 and 41
    tokens, alone and together, get `generate()`'s tokens."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **SMALL, **HEADS, max_position_embeddings=16, pad_token_id=0, rope_parameters={**rope, "rope_theta": 10000.0}
    )
    loaded = load_model(saved(transformers.LlamaForCausalLM(config), tmp_path, demo_model), DEVICE)
    assert loaded.files.context_length == 64
    long = [payload(f"p{i}", p) for i, p in enumerate(prompts()) if len(p) > 16]
    expected = {p.request_id: reference(loaded.model, list(p.prompt_token_ids)) for p in long}
    engine = EngineCore.build(loaded, 512, 2, cache=POOL)
    assert engine.max_model_len == 64
    for p in long:
        assert serve(EngineCore.build(loaded, 512, 1, cache=POOL), {0: [p]}) == {p.request_id: expected[p.request_id]}
    assert serve(engine, {0: long}) == expected


def logits_of(engine: EngineCore, request_id: str) -> list[torch.Tensor]:
    """The logits each of the engine's steps samples the request's next token from, from now on."""
    run_pass, seen = engine._pass, []

    def watched(plan):  # type: ignore[no-untyped-def]
        result = run_pass(plan)
        seen.extend(result.logits[i].clone() for i, s in enumerate(result.rows) if s.request.request_id == request_id)
        return result

    engine._pass = watched  # type: ignore[method-assign]
    return seen


def test_a_model_with_several_eos_ids_stops_where_generate_stops(demo_model: Path, tmp_path: Path) -> None:
    config_class, model_class, options = ARCHITECTURES["qwen3"]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**options, pad_token_id=0))
    saved(model, tmp_path, demo_model, generation_config=False)  # its own, with two EOS ids, below
    free_running = {f"p{i}": reference(model, p, whole=False) for i, p in enumerate(prompts())}
    # Two EOS ids: an id one prompt's greedy output reaches at its fourth token, and another one's third.
    eos = [free_running["p0"][3], free_running["p2"][2]]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": 0}))
    loaded = load_model(tmp_path, DEVICE)
    expected = {f"p{i}": reference(loaded.model, p, eos=eos, whole=False) for i, p in enumerate(prompts())}
    assert len(expected["p0"]) <= 4 and len(expected["p2"]) <= 3  # they stop early
    stopping = [
        JobPayload(f"p{i}", "tiny", tuple(p), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), "ch")
        for i, p in enumerate(prompts())
    ]
    assert serve(EngineCore.build(loaded, 512, 4, cache=POOL), {0: stopping}) == expected


PHI35_CONFIG = Path(__file__).parent / "data" / "phi-3.5-mini-instruct.config.json"


def phi35(path: Path, demo_model: Path) -> LoadedModel:
    """Phi-3.5-mini-instruct's shipped config (LongRoPE factors, original context 4,096, a sliding
    window of 262,144 above its 131,072-token context) at tiny widths: 2 layers of 2 heads of 96."""
    config = json.loads(PHI35_CONFIG.read_text())
    config.update(
        hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    config.update(vocab_size=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config.from_dict(config))
    return load_model(saved(model, path, demo_model), DEVICE)


def test_phi35s_real_attention_dimensions_plan_full_attention_under_4_gib() -> None:
    """Its window is above any context it serves: full attention, no ring per batch slot (which at
    262,143 tokens would take ~198 GiB)."""
    config = transformers.Phi3Config.from_dict(json.loads(PHI35_CONFIG.read_text()))
    with torch.device("meta"):
        model = transformers.Phi3ForCausalLM(config).to(torch.bfloat16)
    shape = KVShape.of(model, context=131072)
    assert shape.windows == (0,) * 32 and shape.kv_heads == 32 and shape.head_dim == 96
    layout = KVLayout.plan(shape, torch.device("cpu"), 4.0, 128, 64, 131072, 8192)
    assert layout.rings == 0
    assert layout.num_blocks == 4 * 2**30 // (128 * 2 * 32 * 32 * 96 * 2)  # 8,192 tokens of 512 KiB


def test_deepseek_v2_lites_latent_attention_is_pooled_decompressed_keys_and_values_of_their_sizes() -> None:
    """DeepSeek-V2-Lite's attention as its config ships it (16 heads, keys of 128 + 64 dimensions not
    rotated and rotated, values of 128, 27 layers): its config's head_dim is the rotated part's alone,
    and a token costs 27 × 16 × (192 + 128) × 2 bytes in bfloat16, its keys and values kept per head."""
    config = transformers.DeepseekV2Config(
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        hidden_size=2048,
        n_routed_experts=4,
    )
    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    shape = KVShape.of(model, context=32768)
    assert (shape.kv_heads, shape.head_dim, shape.value_dim) == (16, 192, 128)
    assert shape.bytes_per_token == 27 * 16 * 320 * 2
    layout = KVLayout.plan(shape, torch.device("cpu"), 0.25, 16, 4, 32768, 256)
    pool = PagedKV(layout, torch.device("meta"))
    assert pool.keys[0].shape == ((layout.num_blocks + 1) * 16, 16, 192)
    assert pool.values[26].shape == ((layout.num_blocks + 1) * 16, 16, 128)


def test_a_long_longrope_prompt_in_chunks_joining_a_batch_equals_generate(demo_model: Path, tmp_path: Path) -> None:
    """Phi-3.5's LongRoPE: a 4,203-token prompt (past the original 4,096) enters in chunks of 1,024
    while a short request runs, and equals `generate()` alone."""
    loaded = phi35(tmp_path, demo_model)
    generator = torch.Generator().manual_seed(2)
    short, long = (torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (40, 4203))
    expected = {"short": reference(loaded.model, short), "long": reference(loaded.model, long)}
    engine = EngineCore.build(
        loaded, 8192, 2, cache=CacheConfig(block_size=16, max_prefill_tokens=1024, mem_gib=POOL_GIB)
    )
    assert engine.runner.kv.windows == (0, 0)
    assert serve(engine, {0: [payload("short", short)], 2: [payload("long", long)]}) == expected


def test_longrope_sequences_crossing_the_original_context_equal_generate_also_recomputed(
    demo_model: Path, tmp_path: Path
) -> None:
    """Two prompts below 4,096 tokens whose outputs cross it, in a pool too small for both: the newer
    is preempted past 4,096 and recomputed in one chunk (no prefix cache), its positions below 4,096
    with the short factors and those above with the long ones, as `generate()` computed them."""
    loaded = phi35(tmp_path, demo_model)
    generator = torch.Generator().manual_seed(2)
    first, second = (torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (4106, 4092))
    expected = {"first": reference(loaded.model, first), "second": reference(loaded.model, second)}
    shape = KVShape.of(loaded.model, context=8192)
    pool = _gib(shape, 514 * 16, rings=0, step=0)  # 514 blocks of 16: 257 each, until the first needs its 258th
    cache = CacheConfig(block_size=16, max_prefill_tokens=8192, mem_gib=pool, prefix_caching=False)
    engine = EngineCore.build(loaded, 8192, 2, cache=cache)
    assert serve(engine, {0: [payload("first", first), payload("second", second)]}) == expected
    assert engine.scheduler.preemptions == 1


def test_a_model_whose_attention_has_sinks_is_refused_by_name_before_its_weights_load(
    demo_model: Path, tmp_path: Path
) -> None:
    """gpt-oss adds a learned sink logit to each head's softmax (transformers passes it as `s_aux`),
    which no attention backend computes: the model is refused by its files (the API's check and the
    worker's), not served wrong. Another architecture with sinks (Flint) is refused once loaded, by its
    attention's `sinks`; what reaches the attention op anyway (sinks, ALiBi's position bias) raises."""
    from workers.models.attention import UnsupportedAttention, paged_attention

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        **SMALL, **HEADS, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512, sliding_window=8
    )
    path = saved(transformers.GptOssForCausalLM(config), tmp_path / "gpt_oss", demo_model)
    with pytest.raises(ModelFilesError, match="model_type 'gpt_oss' adds learned attention sinks"):
        ModelFiles.of(path).check()
    with pytest.raises(ModelFilesError, match="attention sinks"):
        load_model(path, DEVICE)
    flint = saved(
        transformers.FlintForCausalLM(transformers.FlintConfig(**SMALL, **HEADS, max_position_embeddings=512)),
        tmp_path / "flint",
        demo_model,
    )
    ModelFiles.of(flint).check()  # its files say nothing of sinks
    with pytest.raises(ModelFilesError, match=r"attention \(FlintAttention\) adds learned attention sinks"):
        load_model(flint, DEVICE)
    tensors = (torch.zeros(1, 2, 3, 8),) * 3
    for passed, what in (
        ({"s_aux": torch.zeros(2)}, "attention sinks"),
        ({"sinks": torch.zeros(2)}, "attention sinks"),
        ({"position_bias": torch.zeros(1)}, "ALiBi"),
    ):
        with pytest.raises(UnsupportedAttention, match=what):
            paged_attention(torch.nn.Module(), *tensors, None, **passed)


def test_an_engine_on_a_model_whose_attention_passes_what_no_backend_computes_is_not_built(
    demo_model: Path, tmp_path: Path
) -> None:
    """The runner's probe forward, before any request: a model that hands the attention an ALiBi bias
    (a layer's forward passing `position_bias` on, as transformers' layers pass their keyword
    arguments) stops the engine's build with the reason (the worker then exits refused, code 2),
    rather than failing its first batch and restarting into the same failure."""
    from workers.models.attention import UnsupportedAttention

    loaded = load_model(build("llama", tmp_path / "llama", demo_model), DEVICE)
    EngineCore.build(loaded, 512, 2, cache=POOL)  # the same model, as it is: built
    pass_position_bias(loaded.model)
    with pytest.raises(UnsupportedAttention, match=r"a position bias \(ALiBi\) \(`position_bias`\)"):
        EngineCore.build(loaded, 512, 2, cache=POOL)


def test_a_model_whose_attention_bypasses_transformers_attention_interface_is_refused(
    demo_model: Path, tmp_path: Path
) -> None:
    """Falcon (like StableLM, GPT-J, Bloom, MPT in transformers 5) computes attention in its own code: the
    paged KV pool would never see it, and every decode step would attend to its own token alone (served,
    its greedy output left transformers' after the first token). Refused by name once loaded."""
    config = transformers.FalconConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    path = saved(transformers.FalconForCausalLM(config), tmp_path / "falcon", demo_model)
    with pytest.raises(ModelFilesError, match=r"FalconForCausalLM \(model_type 'falcon'\) does not run its attention"):
        load_model(path, DEVICE)


@pytest.mark.parametrize(
    ("layer_types", "refused"),
    [
        (["full_attention", "linear_attention"], "linear_attention"),  # Qwen3-Next, MiniMax
        (["conv", "full_attention"], "conv"),  # LFM2
        (["mamba", "attention"], "attention, mamba"),  # hybrids that name their layers so
    ],
)
def test_a_model_with_layers_that_keep_a_state_is_refused_by_its_config(
    demo_model: Path, tmp_path: Path, layer_types: list[str], refused: str
) -> None:
    """Layers that carry a recurrent state instead of keys and values: the KV pool does not hold it, and
    each step would run them from nothing. Refused by the files (the API's check and the worker's),
    also where the layer types are the text model's of a multimodal config."""
    shutil.copytree(demo_model, tmp_path / "model")
    config = json.loads((demo_model / "config.json").read_text())
    for changed in ({**config, "layer_types": layer_types}, {**config, "text_config": {"layer_types": layer_types}}):
        (tmp_path / "model" / "config.json").write_text(json.dumps(changed))
        with pytest.raises(ModelFilesError, match=f"has {refused} layers, whose state"):
            ModelFiles.of(tmp_path / "model").check()


def test_a_model_whose_config_implies_recurrent_layers_is_refused_by_the_worker(
    demo_model: Path, tmp_path: Path
) -> None:
    """RecurrentGemma's config.json names its layers in `block_types` (two recurrent, one attention),
    from which transformers derives `layer_types`; its attention goes through transformers' attention
    interface, so the worker loaded it and served each recurrent layer from nothing every step. The
    worker's loader refuses it by the layer types transformers derives."""
    config = transformers.RecurrentGemmaConfig(
        vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, lru_width=32
    )
    path = saved(transformers.RecurrentGemmaForCausalLM(config), tmp_path / "model", demo_model)
    shipped = json.loads((path / "config.json").read_text())
    assert "layer_types" not in shipped and shipped["block_types"] == ["recurrent", "recurrent", "attention"]
    ModelFiles.of(path).check()  # the file alone, as the API reads it, names no such layer
    with pytest.raises(ModelFilesError, match="model_type 'recurrent_gemma' has linear_attention layers, whose state"):
        load_model(path, DEVICE)


def test_a_model_with_chunked_attention_serves_its_first_chunk(demo_model: Path, tmp_path: Path) -> None:
    """Llama 4's chunked attention is attention over every position within the first chunk: the model is
    served, its context kept to that chunk."""
    shutil.copytree(demo_model, tmp_path / "model")
    config = json.loads((demo_model / "config.json").read_text())
    chunked = {**config, "layer_types": ["chunked_attention", "full_attention"], "attention_chunk_size": 64}
    (tmp_path / "model" / "config.json").write_text(json.dumps(chunked))
    files = ModelFiles.of(tmp_path / "model")
    files.check()
    assert config["max_position_embeddings"] > 64 and files.context_length == 64
