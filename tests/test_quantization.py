"""Quantized weights on real SmolLM2: each layout that scripts/quantize.py writes as msModelSlim and
llm-compressor lay it out (and the `quantization: int8` setting on the float checkpoint) is served by
the engine with int8 products, greedy, and equals a plain-torch reference of the same int8 math token
for token, prompts alone and in one batch; the float model's own answers stay as likely under it
(mean log-probability per token within 0.1 nats); an unsupported scheme is refused at start-up with
its name. Three prompts (six for the log-probabilities) keep the file within the suite's budget."""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from schemas.job import JobPayload
from schemas.model_files import ModelFiles
from schemas.quantization import UnsupportedQuantization, detect
from schemas.sampling import SamplingParams
from scripts import quantize
from tests.engine_runs import arrivals, build, saved, serve, steps
from tests.engine_runs import payload as engine_payload
from tests.engine_runs import prompts as engine_prompts
from tests.test_architectures import reference as architecture_reference
from tests.test_real_weights import PROMPTS
from workers.engine.core import CacheConfig, EngineCore
from workers.models.kv_pool import KVShape
from workers.models.loader import LoadedModel, load_model
from workers.models.quant.checkpoint import NormBias
from workers.models.quant.convert import scaled_rows
from workers.models.quant.experts import PerExpert, stored_name
from workers.models.quant.linear import Int8Embedding, Int8Linear

pytestmark = pytest.mark.real_weights

NEW_TOKENS = 8  # against the reference, alone and batched
PROMPT_COUNT = 3
CLOSE_TOKENS = 32  # the float model's answers, scored under each layout
CLOSE_PROMPTS = 6
LAYOUTS = ("int8", "compressed-tensors", "w8a8_dynamic", "w8a8", "w8a16")
LABELS = {
    "int8": "w8a8_dynamic (load)",
    "compressed-tensors": "w8a8_dynamic (compressed-tensors)",
    "w8a8_dynamic": "w8a8_dynamic (msmodelslim)",
    "w8a8": "w8a8 (msmodelslim)",
    "w8a16": "w8a16 (msmodelslim)",
}


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def all_prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False)
        for p in PROMPTS[:CLOSE_PROMPTS]
    ]


@pytest.fixture(scope="module")
def prompt_ids(all_prompt_ids: list[list[int]]) -> list[list[int]]:
    return all_prompt_ids[:PROMPT_COUNT]


def padded(prompt_ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded into one batch, and its attention mask."""
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    return ids, mask


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt_ids: list[list[int]], tokens: int, pad: int) -> dict[str, list[int]]:
    """transformers' generate() on each prompt alone (no padding: per-token int8 turns the last bit of a
    padded batch's attention into other tokens), up to and with the end-of-turn token."""
    answers = {}
    for i, ids in enumerate(prompt_ids):
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
        answers[f"p{i}"] = out[0, len(ids) :].tolist()
    return answers


@torch.inference_mode()
def mean_logprob(model: torch.nn.Module, prompt_ids: list[list[int]], answers: dict, pad: int) -> float:
    """The mean log-probability per token that `model` gives the answers after their prompts."""
    texts = [p + answers[f"p{i}"] for i, p in enumerate(prompt_ids)]
    ids, mask = padded(texts, pad)
    logprobs = model(ids, attention_mask=mask).logits.float().log_softmax(-1)
    total, count = 0.0, 0
    for i, (prompt, text) in enumerate(zip(prompt_ids, texts, strict=True)):
        start = ids.shape[1] - len(text) + len(prompt)
        targets = ids[i, start:]
        total += logprobs[i, start - 1 : -1].gather(-1, targets[:, None]).sum().item()
        count += len(targets)
    return total / count


def payloads(prompt_ids: list[list[int]], tokens: int) -> list[JobPayload]:
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0)
    return [JobPayload(f"p{i}", "smollm2", tuple(ids), sampling, "ch") for i, ids in enumerate(prompt_ids)]


@pytest.fixture(scope="module")
def pad(tokenizer: PreTrainedTokenizerBase) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def float_answers(smollm2: Path, all_prompt_ids: list[list[int]], pad: int) -> tuple[dict, float]:
    """The float model's greedy answers and their mean log-probability under it."""
    model = quantize.load_float(smollm2)
    answers = greedy(model, all_prompt_ids, CLOSE_TOKENS, pad)
    return answers, mean_logprob(model, all_prompt_ids, answers, pad)


class References(dict):
    """Each layout's plain-torch reference model, built once."""

    def __init__(self, smollm2: Path) -> None:
        super().__init__()
        self.smollm2 = smollm2

    def __missing__(self, name: str) -> torch.nn.Module:
        self[name] = quantize.reference(self.smollm2, name)
        return self[name]


@pytest.fixture(scope="module")
def references(smollm2: Path) -> References:
    return References(smollm2)


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(
    request: pytest.FixtureRequest, smollm2: Path, references: References, prompt_ids: list[list[int]], pad: int
) -> dict:
    """One layout: tokenline's loaded model, the reference model and the reference's greedy answers."""
    name = request.param
    if name == "int8":
        loaded = load_model(smollm2, torch.device("cpu"), quantization="int8")
    else:
        loaded = load_model(quantize.smollm2(name), torch.device("cpu"))
    ref = references[name]
    return {"name": name, "loaded": loaded, "reference": ref, "expected": greedy(ref, prompt_ids, NEW_TOKENS, pad)}


def test_the_layout_is_detected_and_runs_its_linear_layers_in_int8(layout: dict) -> None:
    loaded: LoadedModel = layout["loaded"]
    assert loaded.quantization == LABELS[layout["name"]]
    int8 = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
    if layout["name"] == "w8a16":  # no weight-only int8 kernel on a CPU: dequantized at load
        assert int8 == []
    else:
        # The LM head too under the setting; msModelSlim's W8A8 keeps down_proj float (scripts/quantize.py).
        per_layer = 6 if layout["name"] == "w8a8" else 7
        assert len(int8) == 30 * per_layer + (layout["name"] == "int8")
        assert all(type(m.mlp.down_proj) is torch.nn.Linear for m in loaded.model.model.layers) == (per_layer == 6)
        assert all(m.qweight is None for m in int8)  # packed for the GEMM, as one layer or siblings
        alone = [m for m in int8 if m.siblings is None]
        assert all(m.packed is not None for m in alone)
        # q, k and v as one product, and gate and up, where the scheme quantizes the activations per token.
        assert len(alone) == (len(int8) if layout["name"] == "w8a8" else 30 * 2 + (layout["name"] == "int8"))


def test_each_prompt_alone_equals_the_reference(layout: dict, prompt_ids: list[list[int]]) -> None:
    engine = EngineCore.build(layout["loaded"], 2048, 1, cache=CacheConfig(prefix_caching=False))
    for p in payloads(prompt_ids, NEW_TOKENS):
        assert serve(engine, {0: [p]}) == {p.request_id: layout["expected"][p.request_id]}


def test_one_batch_equals_the_reference(layout: dict, prompt_ids: list[list[int]]) -> None:
    engine = EngineCore.build(layout["loaded"], 2048, 4, cache=CacheConfig(block_size=16, max_prefill_tokens=2048))
    answers = serve(engine, {0: payloads(prompt_ids, NEW_TOKENS)})
    # In one batch the attention's float sums run in another order than alone; per-token int8 around
    # SmolLM2's activation outliers can turn such a last-bit difference into another token.
    equal = [k for k, v in layout["expected"].items() if answers[k] == v]
    assert len(equal) >= PROMPT_COUNT - 1, f"{len(equal)} of {PROMPT_COUNT} batched answers equal the reference's"


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_float_models_answers_stay_as_likely(
    name: str,
    references: dict[str, torch.nn.Module],
    all_prompt_ids: list[list[int]],
    float_answers: tuple[dict, float],
    pad: int,
) -> None:
    """The float model's greedy answers score within 0.1 nats per token under the layout's int8 math.
    (Greedy text itself parts early: SmolLM2-135M's top two logits are often closer than int8's error.)"""
    float_text, float_logprob = float_answers
    assert abs(mean_logprob(references[name], all_prompt_ids, float_text, pad) - float_logprob) < 0.1


def test_a_checkpoint_with_an_unsupported_scheme_is_refused_naming_it(smollm2: Path, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(smollm2 / name, tmp_path / name)
    config = json.loads((smollm2 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match="quant_method 'gptq'"):
        load_model(tmp_path, torch.device("cpu"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": None}))
    (tmp_path / "quant_model_description_w4a8_dynamic.json").write_text(
        json.dumps({"model_quant_type": "W4A8_DYNAMIC"})
    )
    with pytest.raises(UnsupportedQuantization, match="model_quant_type 'W4A8_DYNAMIC'"):
        detect(ModelFiles(tmp_path))
    # W8A8 with msModelSlim's quantized KV cache (its scales in the weights, which a float cache ignores).
    (tmp_path / "quant_model_description_w4a8_dynamic.json").write_text(
        json.dumps({"model_quant_type": "W8A8", "kv_quant_type": "C8", "fa_quant_type": None})
    )
    with pytest.raises(UnsupportedQuantization, match="msModelSlim kv_quant_type 'C8' in quant_model_description"):
        detect(ModelFiles(tmp_path))


def rewritten(layout: str, out: Path, change: dict) -> Path:
    """The layout's checkpoint copied into `out` with its tensors changed: `change` maps a tensor's
    name to its new value (a name the checkpoint lacks: a tensor added), or to None to leave it out (and
    out of the description file)."""
    from safetensors.torch import load_file, save_file

    source = quantize.smollm2(layout)
    out.mkdir()
    for file in source.iterdir():
        if file.suffix == ".json" and file.name.startswith("quant_model_description"):
            description = {k: v for k, v in json.loads(file.read_text()).items() if change.get(k, True) is not None}
            (out / file.name).write_text(json.dumps(description))
        elif file.suffix == ".safetensors":
            tensors = {k: change.get(k, v) for k, v in load_file(file).items()}
            tensors |= {k: v for k, v in change.items() if k not in tensors}
            save_file(
                {k: v for k, v in tensors.items() if v is not None}, str(out / file.name), metadata={"format": "pt"}
            )
        elif file.is_file():
            shutil.copy(file, out / file.name)
    return out


def test_a_w8a8_checkpoint_without_weight_scales_loads_as_msmodelslims_newer_exporter_writes_it(
    tmp_path: Path, prompt_ids: list[list[int]]
) -> None:
    """msModelSlim's newer exporter writes a W8A8 layer's `weight`, `input_scale`, `input_offset`,
    `quant_bias` and `deq_scale` only (no `weight_scale`, no `weight_offset`): such a checkpoint loads,
    each layer's weight scale is deq_scale / input_scale, and its logits are those of the checkpoint
    with the scales, exactly."""
    from safetensors import safe_open

    (file,) = quantize.smollm2("w8a8").glob("*.safetensors")
    with safe_open(str(file), framework="pt") as handle:
        names = list(handle.keys())
    dropped = {k: None for k in names if k.endswith((".weight_scale", ".weight_offset"))}
    assert len(dropped) == 2 * 30 * 6
    cpu = torch.device("cpu")
    newer = load_model(rewritten("w8a8", tmp_path / "newer", dropped), cpu)
    older = load_model(quantize.smollm2("w8a8"), cpu)
    pairs = list(zip(newer.model.modules(), older.model.modules(), strict=True))
    static = [(a, b) for a, b in pairs if isinstance(a, Int8Linear)]
    assert len(static) == 30 * 6 and all(a.scheme == "W8A8" for a, _ in static)
    for a, b in static:
        torch.testing.assert_close(a.weight_scale, b.weight_scale, rtol=1e-6, atol=0)
    ids = torch.tensor([prompt_ids[0]])
    with torch.inference_mode():
        assert torch.equal(newer.model(ids).logits, older.model(ids).logits)


def test_per_group_w8a16_weights_are_refused_naming_the_layer(tmp_path: Path) -> None:
    """msModelSlim's per-group W8A16 writes `weight_scale` [out, in / group]: refused at start-up with
    the layer's name, not read as per-channel."""
    from safetensors import safe_open

    (file,) = quantize.smollm2("w8a16").glob("*.safetensors")
    name = "model.layers.3.mlp.up_proj"
    with safe_open(str(file), framework="pt") as handle:
        scale, offset = handle.get_tensor(f"{name}.weight_scale"), handle.get_tensor(f"{name}.weight_offset")
    groups = {f"{name}.weight_scale": scale.repeat(1, 4), f"{name}.weight_offset": offset.repeat(1, 4)}
    with pytest.raises(UnsupportedQuantization, match=f"per-group W8A16 \\({name}.weight_scale is \\(1536, 4\\)\\)"):
        load_model(rewritten("w8a16", tmp_path / "grouped", groups), torch.device("cpu"))


# MoE checkpoints as the real tools write them: each expert's projections one by one. Qwen2-MoE (a
# shared expert beside the routed ones) and DeepSeek-V3 (latent attention, grouped routing).
MOE_LAYOUTS = [
    ("qwen2_moe", "w8a8_dynamic"),
    ("qwen2_moe", "compressed-tensors"),
    ("deepseek_v3", "w8a8_dynamic"),
    ("deepseek_v3", "w8a16"),
    ("mixtral", "w8a8_dynamic"),  # its checkpoints' own names: block_sparse_moe.experts.0.w1 (gate), w3, w2
]


@pytest.mark.parametrize(("architecture", "layout"), MOE_LAYOUTS)
def test_an_moe_checkpoints_experts_load_one_by_one_and_answer_as_the_reference(
    architecture: str, layout: str, demo_model: Path, tmp_path: Path
) -> None:
    """msModelSlim and llm-compressor quantize an MoE model's experts one by one and write each
    expert's projections (`mlp.experts.0.gate_proj.weight`, int8, with its scales), as the float
    checkpoints they start from name them, where transformers holds a layer's experts as one tensor.
    Loaded one by one, in int8, the model's greedy output equals the reference's (the float model whose
    every projection, each expert's too, computes the layout's int8 math), each prompt alone and the
    three batched in chunks. Before, the start stopped with `the checkpoint lacks N tensors`."""
    from safetensors import safe_open

    float_model = build(architecture, tmp_path / "float", demo_model)
    path = quantize.write(float_model, layout, tmp_path / layout)
    (file,) = path.glob("*.safetensors")
    with safe_open(str(file), framework="pt") as handle:
        down = stored_name("model.layers.1.mlp.experts.3.down_proj.weight", architecture)
        assert handle.get_tensor(down).dtype == torch.int8
        assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in handle.keys())  # noqa: SIM118 (safe_open is no dict)
    loaded = load_model(path, torch.device("cpu"))
    experts = loaded.model.model.layers[1].mlp.experts
    assert isinstance(experts, PerExpert) and len(experts) == 4
    reference = quantize.reference(float_model, layout)
    prompts = engine_prompts()
    expected = {f"p{i}": architecture_reference(reference, prompt) for i, prompt in enumerate(prompts)}
    runs = [engine_payload(f"p{i}", prompt) for i, prompt in enumerate(prompts)]
    cache = CacheConfig(block_size=4, max_prefill_tokens=16)
    for run in runs:
        assert serve(EngineCore.build(loaded, 512, 1, cache=cache), {0: [run]}) == {
            run.request_id: expected[run.request_id]
        }
    assert serve(EngineCore.build(loaded, 512, 4, cache=cache), {0: runs[:2], 2: runs[2:]}) == expected


def test_an_int8_moe_models_compiled_decode_step_gives_the_eager_steps_tokens_and_logits(
    demo_model: Path, tmp_path: Path
) -> None:
    """The experts' loop, which reads the routing on the host, is an op opaque to the compiler
    (`tokenline::moe_experts`): the decode step compiles around it (fullgraph, as every compiled step)
    and gives the eager step's tokens and logits."""
    path = quantize.write(build("qwen2_moe", tmp_path / "float", demo_model), "w8a8_dynamic", tmp_path / "int8")
    loaded = load_model(path, torch.device("cpu"))
    cache = CacheConfig(block_size=4, max_prefill_tokens=16)
    eager_tokens, eager_logits = steps(EngineCore.build(loaded, 512, 4, cache=cache), arrivals()["batch"])
    compiled = EngineCore.build(loaded, 512, 4, cache=replace(cache, compile="on"))
    assert compiled.runner.graphs is not None
    tokens, logits = steps(compiled, arrivals()["batch"])
    assert tokens == eager_tokens and len(logits) == len(eager_logits)
    for got, expected in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("architecture", ["qwen2_moe", "deepseek_v3", "mixtral"])
def test_experts_one_by_one_are_the_checkpoints_and_compute_what_transformers_fused_experts_compute(
    architecture: str, demo_model: Path, tmp_path: Path
) -> None:
    """What the MoE layouts and their reference rest on: transformers' fused experts split one by one
    (experts.split) are the float checkpoint's own experts, as transformers writes them (gate, up and
    down of each), and PerExpert computes the fused module's output."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = build(architecture, tmp_path / "float", demo_model)
    fused = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    split = quantize.load_float(path)
    assert isinstance(split.model.layers[1].mlp.experts, PerExpert)
    (file,) = path.glob("*.safetensors")
    with safe_open(str(file), framework="pt") as handle:
        for index, projection in ((0, "gate_proj"), (3, "up_proj"), (2, "down_proj")):
            saved = handle.get_tensor(
                stored_name(f"model.layers.1.mlp.experts.{index}.{projection}.weight", architecture)
            )
            assert torch.equal(getattr(split.model.layers[1].mlp.experts[index], projection).weight, saved)
    ids = torch.tensor([engine_prompts()[2]])
    with torch.inference_mode():
        torch.testing.assert_close(split(ids).logits, fused(ids).logits)


def test_experts_that_compute_otherwise_are_not_split_under_int8_and_their_checkpoint_is_refused(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Some architectures' experts gate otherwise than act(gate) · up or norm their output (in
    transformers, an `_apply_gate` of their own, `has_post_expert_norm`): one by one they would answer
    wrongly. What the fused module computes is checked on random tokens first (here it doubles its
    output): under `quantization: int8` its experts stay float, said in the log, and a quantized
    checkpoint of it stops the start naming the module."""
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    float_model = build("qwen2_moe", tmp_path / "float", demo_model)
    path = quantize.write(float_model, "w8a8_dynamic", tmp_path / "int8")
    forward = modeling_qwen2_moe.Qwen2MoeExperts.forward
    monkeypatch.setattr(modeling_qwen2_moe.Qwen2MoeExperts, "forward", lambda self, *args: 2 * forward(self, *args))
    with caplog.at_level(logging.WARNING, logger="workers.models.quant.convert"):
        loaded = load_model(float_model, torch.device("cpu"), quantization="int8")
    assert type(loaded.model.model.layers[1].mlp.experts) is modeling_qwen2_moe.Qwen2MoeExperts
    assert "quantization int8: the experts of model.layers.1.mlp.experts compute otherwise than each" in caplog.text
    with pytest.raises(UnsupportedQuantization, match=r"^Qwen2MoeExperts computes otherwise than each expert's"):
        load_model(path, torch.device("cpu"))


def test_a_quantized_moe_checkpoint_whose_experts_have_other_names_is_refused_saying_so(
    demo_model: Path, tmp_path: Path
) -> None:
    """Experts under names neither transformers' modules nor Mixtral's checkpoints give them (here
    each expert's gate projection renamed `w_in`) stop the start, naming the first tensor it could not
    place, not `the checkpoint lacks N tensors`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = quantize.write(build("qwen2_moe", tmp_path / "float", demo_model), "w8a8_dynamic", tmp_path / "int8")
    (file,) = path.glob("*.safetensors")
    with safe_open(str(file), framework="pt") as handle:
        state = {name.replace(".gate_proj.", ".w_in."): handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    save_file(state, str(file))
    description = json.loads(description_of(path).read_text())
    description_of(path).write_text(json.dumps({k.replace(".gate_proj.", ".w_in."): v for k, v in description.items()}))
    refused = (
        r"^the checkpoint stores its MoE experts under names this model's layers do not have "
        r"\(model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight first\)"
    )
    with pytest.raises(UnsupportedQuantization, match=refused):
        load_model(path, torch.device("cpu"))


@pytest.mark.parametrize("architecture", ["qwen2_moe", "deepseek_v3"])
def test_quantization_int8_quantizes_an_moe_models_experts_one_by_one_and_answers_as_the_reference(
    architecture: str, demo_model: Path, tmp_path: Path
) -> None:
    """`quantization: int8` on a float MoE model: transformers' fused experts are split one by one
    (views of its tensors) and each projection quantized as every linear layer is (the routers stay
    float); the greedy output equals the setting's plain-torch reference, alone and batched."""
    path = build(architecture, tmp_path / "float", demo_model)
    loaded = load_model(path, torch.device("cpu"), quantization="int8")
    experts = loaded.model.model.layers[1].mlp.experts
    assert isinstance(experts, PerExpert) and len(experts) == 4
    assert not any(p.dim() == 3 for p in loaded.model.parameters())
    projections = [getattr(expert, name) for expert in experts for name in ("gate_proj", "up_proj", "down_proj")]
    assert all(isinstance(layer, Int8Linear) for layer in projections)
    answers_as_its_reference(loaded, quantize.reference(path, "int8"))


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])
def test_quantization_int8_quantizes_gemmas_scaled_embedding_and_answers_as_the_reference(
    architecture: str, demo_model: Path, tmp_path: Path
) -> None:
    """Gemma's input embedding scales its rows by the square root of the hidden size (a
    `*ScaledWordEmbedding`; Gemma 2 2B's, 256,000 × 2,304, is its largest tensor), and stayed float
    under `quantization: int8`. Its rows are int8 now, scaled alike, and tied to the int8 LM head; the
    greedy output equals the setting's plain-torch reference, alone and batched."""
    path = build(architecture, tmp_path / "float", demo_model)
    float_model = quantize.load_float(path)
    loaded = load_model(path, torch.device("cpu"), quantization="int8")
    embedding = loaded.model.get_input_embeddings()
    assert isinstance(embedding, Int8Embedding) and embedding.tied
    assert float(embedding.multiplier) == float(float_model.get_input_embeddings().embed_scale) > 1
    answers_as_its_reference(loaded, quantize.reference(path, "int8"))


def test_quantization_int8_quantizes_gpt2s_conv1d_layers_and_answers_as_the_reference(
    demo_model: Path, tmp_path: Path
) -> None:
    """GPT-2's attention and MLP layers are transformers' Conv1D (a weight [in, out]), not nn.Linear,
    and stayed float under `quantization: int8` without a word. They are int8 now; the greedy output
    equals the setting's plain-torch reference, alone and batched."""
    from transformers.pytorch_utils import Conv1D

    path = build("gpt2", tmp_path / "float", demo_model)
    loaded = load_model(path, torch.device("cpu"), quantization="int8")
    assert not any(isinstance(module, Conv1D) for module in loaded.model.modules())
    assert sum(isinstance(module, Int8Linear) for module in loaded.model.modules()) == 2 * 4 + 1  # and the head
    answers_as_its_reference(loaded, quantize.reference(path, "int8"))


def test_a_compressed_tensors_moe_checkpoint_names_its_linear_routers_in_ignore(
    demo_model: Path, tmp_path: Path
) -> None:
    """PhiMoE's routers are linear layers (`block_sparse_moe.gate` in its checkpoints), which
    llm-compressor's MoE recipes leave float and name in `ignore`; scripts/quantize.py left them float
    without naming them, so its checkpoint was refused as int8 layers stored float. It names them, and
    the checkpoint loads with its routers float."""
    import transformers

    options = {"vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = transformers.PhimoeConfig(
        **options, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, max_position_embeddings=512
    )
    torch.manual_seed(0)
    float_model = saved(transformers.PhimoeForCausalLM(config), tmp_path / "phimoe", demo_model)
    path = quantize.write(float_model, "compressed-tensors", tmp_path / "ct")
    ignore = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", "model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"]
    loaded = load_model(path, torch.device("cpu"))
    router = loaded.model.model.layers[0].mlp.router  # transformers' PhimoeTopKRouter, a float nn.Linear
    assert type(router).__name__ == "PhimoeTopKRouter" and router.weight.dtype == torch.float32
    assert isinstance(loaded.model.model.layers[0].mlp.experts, PerExpert)


def test_quantization_int8_serves_a_model_whose_norms_hold_no_weight(demo_model: Path, tmp_path: Path) -> None:
    """OLMo's layer norms have no weights: once every linear layer and the embedding were int8 the
    model held no floating-point parameter, and its worker's start failed (StopIteration, reading the
    model's dtype from its first parameter). It loads, keeps its KV cache in the float dtype, and its
    greedy output equals the setting's plain-torch reference, alone and batched."""
    import transformers

    options = {"vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = transformers.OlmoConfig(**options, num_attention_heads=4, max_position_embeddings=512, pad_token_id=0)
    torch.manual_seed(0)
    path = saved(transformers.OlmoForCausalLM(config), tmp_path / "olmo", demo_model)
    loaded = load_model(path, torch.device("cpu"), quantization="int8")
    assert not any(p.is_floating_point() for p in loaded.model.parameters())
    assert loaded.dtype == KVShape.of(loaded.model).dtype == torch.float32
    answers_as_its_reference(loaded, quantize.reference(path, "int8"))


def test_only_an_embedding_that_computes_its_rows_times_its_scale_is_quantized_as_scaled() -> None:
    """The check behind Gemma's: an embedding with an `embed_scale` whose forward computes anything
    else than its rows times that number is left float."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    gemma = Gemma2TextScaledWordEmbedding(16, 8, padding_idx=0, embed_scale=8**0.5)
    assert float(scaled_rows(gemma)) == pytest.approx(8**0.5)

    class Shifted(Gemma2TextScaledWordEmbedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) + 1

    assert scaled_rows(Shifted(16, 8, padding_idx=0, embed_scale=8**0.5)) is None
    assert scaled_rows(torch.nn.Embedding(16, 8)) is None  # no scale: a plain embedding


def answers_as_its_reference(loaded: LoadedModel, reference: torch.nn.Module) -> None:
    """The engine's greedy output on `loaded` equals the reference model's generate(): the first of
    three prompts alone, then the three in one batch in chunks, the last joining later."""
    prompts = engine_prompts()
    expected = {f"p{i}": architecture_reference(reference, prompt) for i, prompt in enumerate(prompts)}
    runs = [engine_payload(f"p{i}", prompt) for i, prompt in enumerate(prompts)]
    cache = CacheConfig(block_size=4, max_prefill_tokens=16)
    assert serve(EngineCore.build(loaded, 512, 1, cache=cache), {0: runs[:1]}) == {"p0": expected["p0"]}
    assert serve(EngineCore.build(loaded, 512, 4, cache=cache), {0: runs[:2], 2: runs[2:]}) == expected


def description_of(path: Path) -> Path:
    (file,) = path.glob("quant_model_description*.json")
    return file


@pytest.mark.parametrize("how", ["marked FLOAT", "left out"])
def test_int8_weights_of_a_layer_the_description_leaves_float_are_refused(tmp_path: Path, how: str) -> None:
    """Cast to float they were served as weights (the model answered noise); the start stops naming
    the tensor."""
    path = rewritten("w8a8_dynamic", tmp_path / "model", {})
    description = json.loads(description_of(path).read_text())
    name = "model.layers.0.mlp.gate_proj.weight"
    if how == "marked FLOAT":
        description[name] = "FLOAT"
    else:
        del description[name]
    description_of(path).write_text(json.dumps(description))
    refused = f"^{name} is torch.int8 in the checkpoint, but its msmodelslim description leaves the layer float$"
    with pytest.raises(UnsupportedQuantization, match=refused):
        load_model(path, torch.device("cpu"))


@pytest.mark.parametrize("shape", [(100, 1), (7,)])
def test_a_scale_of_the_wrong_size_is_refused_naming_it(tmp_path: Path, shape: tuple[int, ...]) -> None:
    name = "model.layers.3.mlp.up_proj"
    path = rewritten("w8a8_dynamic", tmp_path / "model", {f"{name}.weight_scale": torch.ones(shape)})
    refused = rf"^{name}\.weight_scale is {re.escape(str(shape))}, not 1536 values for {name}\.weight \(1536, 576\)$"
    with pytest.raises(UnsupportedQuantization, match=refused):
        load_model(path, torch.device("cpu"))


@pytest.mark.parametrize(
    ("layout", "key", "dtype", "expected"),
    [
        ("w8a8_dynamic", "weight_scale", torch.int8, "floating-point"),
        ("w8a8", "deq_scale", torch.int32, "float32 or int64 \\(float32 bits\\)"),
        ("w8a8", "quant_bias", torch.bool, "integer or floating-point"),
    ],
)
def test_a_scale_of_the_wrong_dtype_is_refused_naming_it(
    tmp_path: Path, layout: str, key: str, dtype: torch.dtype, expected: str
) -> None:
    """A weight scale cast to int8 (all zeros) was served: the layer's outputs were zeros and the model
    answered otherwise, with no word at start-up; only the int8 weight's dtype was checked."""
    from safetensors import safe_open

    name = "model.layers.7.mlp.gate_proj"
    (file,) = quantize.smollm2(layout).glob("*.safetensors")
    with safe_open(str(file), framework="pt") as handle:
        original = handle.get_tensor(f"{name}.{key}")
    path = rewritten(layout, tmp_path / "model", {f"{name}.{key}": original.to(dtype)})
    with pytest.raises(UnsupportedQuantization, match=rf"^{name}\.{key} is {dtype}, not {expected}$"):
        load_model(path, torch.device("cpu"))


def test_a_checkpoint_tensor_that_no_layer_takes_is_refused_naming_it(tmp_path: Path) -> None:
    """A tensor the loader has no place for was dropped without a word (a norm's anti-outlier bias
    was, and the model answered otherwise). Here a scale of msModelSlim's KV-cache quantization, which
    tokenline does not apply."""
    name = "model.layers.0.self_attn.k_proj.kv_cache_scale"
    path = rewritten("w8a8_dynamic", tmp_path / "model", {name: torch.ones(1)})
    refused = rf"^the checkpoint holds 1 tensor that no layer of LlamaForCausalLM takes \({name} first\)"
    with pytest.raises(UnsupportedQuantization, match=refused):
        load_model(path, torch.device("cpu"))
    # What the model does not run, and transformers' own loading ignores too, is left: a layer past
    # SmolLM2's 30 (DeepSeek-V3 stores its multi-token-prediction layer so), `mtp.` modules, rotary
    # frequencies.
    ignored = [
        "model.layers.30.mlp.down_proj.weight",
        "mtp.0.norm.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
    ]
    path = rewritten("w8a8_dynamic", tmp_path / "mtp", {name: torch.ones(4) for name in ignored})
    assert load_model(path, torch.device("cpu")).quantization == "w8a8_dynamic (msmodelslim)"


@pytest.mark.parametrize(("architecture", "layout"), [("qwen3", "w8a8_dynamic"), ("llama", "w8a8")])
def test_msmodelslims_anti_outlier_norm_biases_are_added_and_answer_as_the_reference(
    architecture: str, layout: str, demo_model: Path, tmp_path: Path
) -> None:
    """msModelSlim's asymmetric anti-outlier suppression adds a bias to the norms before the quantized
    layers (`input_layernorm.bias`) and takes it off again in those layers: in their `bias` under
    W8A8_DYNAMIC (created for Qwen3, whose projections have none), in quant_bias under W8A8. The norm
    biases were dropped without a word, and the model answered otherwise; each such norm now adds its
    bias, and the greedy output equals the reference's, alone and batched."""
    float_model = build(architecture, tmp_path / "float", demo_model)
    path = quantize.write(float_model, layout, tmp_path / layout, norm_bias=True)
    loaded = load_model(path, torch.device("cpu"))
    for layer in loaded.model.model.layers:
        assert isinstance(layer.input_layernorm, NormBias) and isinstance(layer.post_attention_layernorm, NormBias)
    answers_as_its_reference(loaded, quantize.reference(float_model, layout, norm_bias=True))


@pytest.mark.parametrize("norm_bias", [False, True])
def test_msmodelslims_prefill_decode_mix_is_served_per_token(norm_bias: bool, demo_model: Path, tmp_path: Path) -> None:
    """msModelSlim's W8A8 for current models is the prefill-decode mix (`W8A8_MIX`: each layer with
    W8A8_DYNAMIC's tensors and W8A8's), which was refused as an unknown scheme. vllm-ascend quantizes
    its layers per token except on a disaggregated decode node; tokenline is none, and serves it per
    token: the greedy output equals W8A8_DYNAMIC's reference on the same weights and biases (Qwen2's
    q/k/v biases; with anti-outlier norm biases, Qwen2's compensated ones), alone and batched."""
    float_model = build("qwen2", tmp_path / "float", demo_model)
    path = quantize.write(float_model, "w8a8_mix", tmp_path / "mix", norm_bias=norm_bias)
    loaded = load_model(path, torch.device("cpu"))
    assert loaded.quantization == "w8a8_mix (msmodelslim)"
    layers = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 2 * 7 and {m.scheme for m in layers} == {"W8A8_DYNAMIC"}
    answers_as_its_reference(loaded, quantize.reference(float_model, "w8a8_mix", norm_bias=norm_bias))


def test_a_float_tensor_of_the_wrong_shape_is_refused_naming_it(tmp_path: Path) -> None:
    name = "model.layers.2.input_layernorm.weight"
    path = rewritten("w8a8_dynamic", tmp_path / "model", {name: torch.ones(100)})
    refused = rf"^{name} is \(100,\) in the checkpoint, not \(576,\) as config\.json makes it$"
    with pytest.raises(UnsupportedQuantization, match=refused):
        load_model(path, torch.device("cpu"))


def test_quantization_int8_on_a_quantized_checkpoint_says_the_checkpoints_scheme_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="workers.models.loader"):
        loaded = load_model(quantize.smollm2("w8a8_dynamic"), torch.device("cpu"), quantization="int8")
    assert loaded.quantization == "w8a8_dynamic (msmodelslim)"
    assert (
        "quantization int8: the checkpoint is quantized already (w8a8_dynamic (msmodelslim)), and served so"
        in caplog.text
    )


def test_a_cpu_pool_is_sized_for_the_context_a_sequence_can_reach(demo_model: Path) -> None:
    """npuMemSize -1 on a CPU: two contexts per batch slot of the model's context where maxSeqLen is
    longer (it was sized for maxSeqLen: 54.954 GiB asked for a model that serves 8,192 tokens)."""
    loaded = load_model(demo_model, torch.device("cpu"))
    context = loaded.files.context_length
    assert context is not None and context < 100_000
    engine = EngineCore.build(loaded, 100_000, 2, cache=CacheConfig(mem_gib=-1, block_size=16))
    assert engine.max_model_len == context
    assert engine.runner.kv.num_blocks == 2 * 2 * (context + 16) // 16
