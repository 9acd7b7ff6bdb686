"""What the architecture and tensor-parallel tests run on an engine: tiny random-weight models of the
architectures people serve, built from transformers configs, their prompts, and an engine driven
step by step with requests arriving at given steps. Imported by the tests and by tests/tp_rank.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import transformers

from schemas.job import Event, JobPayload
from schemas.sampling import SamplingParams
from workers.engine.core import CacheConfig, EngineCore, Launched, StepResult
from workers.models.compile import generates_code

# The device the engine tests run on: the CPU, or the device `make device-check` names.
DEVICE = torch.device(os.environ.get("TOKENLINE_TEST_DEVICE", "cpu"))
# Whether torch.compile can compile for it (not on an NPU without triton-ascend, which the NPU image
# does not install).
COMPILES = generates_code(DEVICE)
SMALL = {"vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
MLA = {
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
}
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**SMALL, **HEADS}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {**SMALL, **HEADS, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**SMALL, **HEADS, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**SMALL, **HEADS, "sliding_window": 8}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {**SMALL, **HEADS, "sliding_window": 8, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    ),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**SMALL, **HEADS, "sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"vocab_size": 4096, "n_embd": 32, "n_layer": 2, "n_head": 4}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**SMALL, **HEADS, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # DeepSeek's latent attention (MLA): keys of 8 + 8 dimensions (not rotated, rotated), values of 8.
    # V2 as V2-Lite has it (no query compression, its heads split by the tensor-parallel plan), V3 as
    # V3 and R1 have it (queries compressed, grouped routing, its attention whole on every rank).
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**SMALL, **MLA, "q_lora_rank": None}),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**SMALL, **MLA, "q_lora_rank": 16, "n_group": 2, "topk_group": 1},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **SMALL,
            **HEADS,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
}
# The heads the device check's models have by default: on an NPU 128 dimensions, what the fused
# attention's TND layout documents (attention/npu.py); elsewhere 8.
DEFAULT_HEAD_DIM = 128 if DEVICE.type == "npu" else 8
PROMPT_LENGTHS = (5, 23, 41)
NEW_TOKENS = 10
# npuMemSize of the tests' engines: on an accelerator 1 GiB, not 90% of what the device has free
# (npuMemSize -1), so that `make device-check`'s test processes share one device.
POOL_GIB = -1.0 if DEVICE.type == "cpu" else 1.0
POOL = CacheConfig(mem_gib=POOL_GIB)
# The tensor-parallel runs: prompts split into chunks of 16 tokens, blocks of 4.
MAX_LEN, MAX_BATCH = 512, 4
CACHE = CacheConfig(block_size=4, max_prefill_tokens=16, mem_gib=POOL_GIB)


def build(architecture: str, path: Path, demo_model: Path, head_dim: int = DEFAULT_HEAD_DIM, **overrides: int) -> Path:
    """A tiny random-weight model of `architecture` saved in `path`, with the demo model's tokenizer;
    its heads of 8 dimensions (128 on an NPU), or of `head_dim` (its widths scaled alike); `overrides`:
    configuration values of its own."""
    config_class, model_class, options = ARCHITECTURES[architecture]
    scale = head_dim // 8
    options = {
        key: value * scale if key in ("hidden_size", "n_embd", "head_dim") else value for key, value in options.items()
    } | overrides
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**options, max_position_embeddings=512, pad_token_id=0)
    return saved(getattr(transformers, model_class)(config), path, demo_model)


def saved(model: torch.nn.Module, path: Path, demo_model: Path, generation_config: bool = True) -> Path:
    """The model's directory: its weights and the demo model's tokenizer (and generation config)."""
    model.save_pretrained(path)
    names = ("tokenizer.json", "tokenizer_config.json") + (("generation_config.json",) if generation_config else ())
    for name in names:
        shutil.copy(demo_model / name, path / name)
    return path


def pass_position_bias(model: torch.nn.Module) -> None:
    """Make the model's second layer pass an ALiBi `position_bias` to the attention function, as
    transformers' layers pass their keyword arguments on: what no attention backend computes."""
    attention = model.model.layers[1].self_attn
    forward = attention.forward
    attention.forward = lambda *args, **kwargs: forward(*args, **kwargs, position_bias=1.0)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def payload(request_id: str, prompt: list[int]) -> JobPayload:
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return JobPayload(request_id, "tiny", tuple(prompt), sampling, "ch")


def run(engine: EngineCore, *payloads: JobPayload) -> dict[str, list[Event]]:
    """Add the requests and step until idle; each request's events."""
    for payload in payloads:
        engine.add_request(payload)
    events: dict[str, list[Event]] = {p.request_id: [] for p in payloads}
    while engine.has_work:
        for event in engine.step().events:
            events[event.request_id].append(event)
    return events


def serve(engine: EngineCore, arrivals: dict[int, list[JobPayload]], overlapped: bool = False) -> dict[str, list[int]]:
    """Step until idle, adding `arrivals[k]` before step k; each request's output ids. `overlapped`:
    as the engine thread runs an accelerator, launch step k + 1 before processing step k's tokens (a
    decode's input is then the token still on the device)."""
    outputs: dict[str, list[int]] = {}
    pending: Launched | None = None
    step = 0
    while engine.has_work or pending is not None or any(k >= step for k in arrivals):
        for p in arrivals.get(step, []):
            engine.add_request(p)
            outputs[p.request_id] = engine.requests[p.request_id].sequences[0].output_ids
        if overlapped:
            launched, result = engine.launch() if engine.has_work else (None, StepResult())
            if pending is not None:
                result.merge(engine.finish(pending))
            pending = launched
        else:
            result = engine.step()
        for event in result.events:
            assert event.kind != "error", event.error
        step += 1
    return outputs


def arrivals() -> dict[str, dict[int, list[JobPayload]]]:
    """Named runs for one engine: each prompt alone, then all three in a batch where the last joins
    the running ones (JSON keys: the step numbers become strings)."""
    payloads = [payload(f"p{i}", p) for i, p in enumerate(prompts())]
    runs = {f"alone-{p.request_id}": {0: [p]} for p in payloads}
    runs["batch"] = {0: payloads[:2], 3: payloads[2:]}
    return runs


def overlapped_batch() -> dict[int, list[JobPayload]]:
    """The batch run again, to be served overlapped (its ids prefixed "o-")."""
    return {
        step: [payload(f"o-{p.request_id}", list(p.prompt_token_ids)) for p in batch]
        for step, batch in arrivals()["batch"].items()
    }


def steps(engine: EngineCore, arrivals: dict[int, list]) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Each request's output ids, and the logits of every step (in order), serving `arrivals`."""
    logits: list[torch.Tensor] = []
    run_pass = engine._pass

    def watched(plan):  # type: ignore[no-untyped-def]
        result = run_pass(plan)
        logits.append(result.logits.detach().clone())
        return result

    engine._pass = watched  # type: ignore[method-assign]
    outputs: dict[str, list[int]] = {}
    step = 0
    while engine.has_work or any(k >= step for k in arrivals):
        for p in arrivals.get(step, []):
            engine.add_request(p)
            outputs[p.request_id] = engine.requests[p.request_id].sequences[0].output_ids
        for event in engine.step().events:
            assert event.kind != "error", event.error
        step += 1
    return outputs, logits
