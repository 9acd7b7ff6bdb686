"""tokenline's Llama forward (workers/models/llama.py) against transformers' forward on the same model and inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from schemas.config import load_settings
from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from workers.engine.core import EngineCore
from workers.engine.kv_cache import KVBatch
from workers.models.forward import FORWARDS, TransformersForward, left_padded, make_forward
from workers.models.llama import LlamaForward
from workers.models.loader import LoadedModel, load_model
from workers.serving.main import parse_args

PROMPTS = ["hello world", "the model is a long prompt with many words in it to need padding", "你好 世界"]


@pytest.fixture(scope="module")
def loaded(demo_model: Path) -> LoadedModel:
    return load_model(demo_model, torch.device("cpu"))


def encode(loaded: LoadedModel, *texts: str) -> list[list[int]]:
    return [loaded.tokenizer.encode(text).ids for text in texts]


def test_the_demo_model_runs_on_tokenlines_forward_unless_told_otherwise(loaded: LoadedModel) -> None:
    assert LlamaForward.unsupported(loaded.model) is None
    assert isinstance(make_forward(loaded.model), LlamaForward)
    assert isinstance(make_forward(loaded.model, "transformers"), TransformersForward)
    with pytest.raises(ValueError, match="forward must be one of auto, transformers"):
        make_forward(loaded.model, "fast")


def test_projections_laid_side_by_side_share_the_models_memory(loaded: LoadedModel) -> None:
    forward = LlamaForward(loaded.model)
    attention, fused = loaded.model.model.layers[0].self_attn, forward.layers[0].qkv.weight
    assert fused.shape == (256, sum(p.weight.shape[0] for p in (attention.q_proj, attention.k_proj, attention.v_proj)))
    assert attention.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attention.v_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    layer = loaded.model.model.layers[0]
    for module, projection in (
        (layer.mlp.up_proj, forward.layers[0].gate_up),
        (layer.mlp.down_proj, forward.layers[0].down),
    ):
        assert module.weight.untyped_storage().data_ptr() == projection.weight.untyped_storage().data_ptr()


def test_a_model_it_does_not_compute_exactly_keeps_transformers_forward() -> None:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    model = LlamaForCausalLM(config)
    assert LlamaForward.unsupported(model) == "rope_type 'dynamic'"
    assert isinstance(make_forward(model), TransformersForward)


@torch.inference_mode()
def test_a_left_padded_prefill_gives_transformers_logits_keys_and_values(loaded: LoadedModel) -> None:
    ids, positions, mask = left_padded(encode(loaded, *PROMPTS), 0)
    ours_logits, ours_kv = LlamaForward(loaded.model).prefill(ids, positions, mask)
    theirs_logits, theirs_kv = TransformersForward(loaded.model).prefill(ids, positions, mask)
    assert ours_logits.shape == theirs_logits.shape == (3, loaded.vocab_size)
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=1e-5, atol=1e-5)
    real = mask.bool()
    for (ours_k, ours_v), (theirs_k, theirs_v) in zip(ours_kv, theirs_kv, strict=True):
        for row in range(3):  # padding positions are masked out everywhere: only the real ones must agree
            torch.testing.assert_close(ours_k[row, :, real[row]], theirs_k[row, :, real[row]], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours_v[row, :, real[row]], theirs_v[row, :, real[row]], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_decode_steps_give_transformers_logits_as_rows_join_and_leave(loaded: LoadedModel) -> None:
    forwards = [LlamaForward(loaded.model), TransformersForward(loaded.model)]
    batches = [KVBatch(), KVBatch()]
    tokens: list[list[int]] = [[], []]

    def prefill(prompts: list[list[int]]) -> None:
        ids, positions, mask = left_padded(prompts, 0)
        results = [f.prefill(ids, positions, mask) for f in forwards]
        for kv, (_, layers) in zip(batches, results, strict=True):
            kv.append(layers, mask)
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
        for row in results[1][0].argmax(-1).tolist():
            tokens[0].append(row)

    def decode() -> None:
        ids = torch.tensor(tokens[0]).view(-1, 1)
        logits = []
        for forward, kv in zip(forwards, batches, strict=True):
            positions = kv.next_positions()
            kv.grow()
            logits.append(forward.decode(ids, positions, kv))
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
        tokens[0] = logits[1].argmax(-1).tolist()

    prompts = encode(loaded, *PROMPTS)
    prefill(prompts[:1])
    decode()
    prefill(prompts[1:])  # a longer prompt joins: more padding on the left of the running row
    for _ in range(3):
        decode()
    for kv in batches:
        order = kv.drop([0])
    tokens[0] = [tokens[0][i] for i in order]
    for _ in range(3):
        decode()


def test_a_mixed_pass_gives_the_prefill_and_the_decode_step_of_separate_passes(loaded: LoadedModel) -> None:
    forward = LlamaForward(loaded.model)
    prompts = encode(loaded, *PROMPTS)
    separate, mixed = KVBatch(), KVBatch()
    ids, positions, mask = left_padded(prompts[:2], 0)
    for kv in (separate, mixed):  # two running rows, decoded twice
        kv.append(forward.prefill(ids, positions, mask)[1], mask)
        for token in (7, 11):
            step = torch.tensor([[token], [token + 1]])
            at = kv.next_positions()
            kv.grow()
            forward.decode(step, at, kv)
    new_ids, new_positions, new_mask = left_padded(prompts[2:] + prompts[:1], 0)  # two newcomers, padded
    step = torch.tensor([[13], [14]])

    at = separate.next_positions()
    separate.grow()
    decoded = forward.decode(step, at, separate)
    prefilled, layers = forward.prefill(new_ids, new_positions, new_mask)
    separate.append(layers, new_mask)

    at = mixed.next_positions()
    mixed.grow()
    mixed_prefilled, mixed_layers, mixed_decoded = forward.mixed(new_ids, new_positions, new_mask, step, at, mixed)
    mixed.append(mixed_layers, new_mask)

    torch.testing.assert_close(mixed_decoded, decoded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed_prefilled, prefilled, rtol=1e-5, atol=1e-5)
    assert torch.equal(mixed.mask, separate.mask)
    for ours, theirs in zip(mixed.slabs(), separate.slabs(), strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-5)


def test_greedy_text_is_transformers_generate_text(loaded: LoadedModel) -> None:
    prompt = encode(loaded, PROMPTS[1])[0]
    engine = EngineCore.build(loaded, 2560, 2)
    assert isinstance(engine.runner.forward, LlamaForward)
    engine.add_request(
        JobPayload("r", "demo", tuple(prompt), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), "ch")
    )
    sequence = engine.requests["r"].sequences[0]
    while engine.has_work:
        engine.step()
    with torch.inference_mode():
        out = loaded.model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=0
        )
    assert sequence.output_ids == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("params", [{"seed": 5, "top_p": 0.9}, {"seed": 9, "top_k": 50, "presence_penalty": 1.0}])
def test_a_batch_samples_the_same_text_on_either_forward(loaded: LoadedModel, params: dict) -> None:
    def run(forward: str) -> dict[str, str]:
        engine = EngineCore.build(loaded, 2560, 4, forward=forward)
        for i, prompt in enumerate(encode(loaded, *PROMPTS)):
            sampling = SamplingParams(**{"max_tokens": 16, "ignore_eos": True, **params})
            engine.add_request(JobPayload(f"r{i}", "demo", tuple(prompt), sampling, "ch"))
        texts: dict[str, str] = {}
        while engine.has_work:
            for event in engine.step().events:
                texts[event.request_id] = texts.get(event.request_id, "") + (event.text or "")
        return texts

    assert run("auto") == run("transformers")


@torch.inference_mode()
def test_bfloat16_stays_within_bfloat16s_rounding_of_transformers(demo_model: Path) -> None:
    model = load_model(demo_model, torch.device("cpu"), "bfloat16")
    ids, positions, mask = left_padded(encode(model, *PROMPTS), 0)
    ours, _ = LlamaForward(model.model).prefill(ids, positions, mask)
    theirs, _ = TransformersForward(model.model).prefill(ids, positions, mask)
    assert ours.dtype == theirs.dtype == torch.float32
    assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()


def test_the_worker_takes_either_forward_and_refuses_others() -> None:
    settings = load_settings({}, require_model=False)
    assert parse_args([], settings).forward == "auto"
    for kind in FORWARDS:
        assert parse_args(["--forward", kind], settings).forward == kind
    settings = load_settings({"TOKENLINE_FORWARD": "transformers"}, require_model=False)
    assert parse_args([], settings).forward == "transformers"
    with pytest.raises(SystemExit):
        parse_args(["--forward", "fast"], settings)
