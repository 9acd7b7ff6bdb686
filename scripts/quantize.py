"""Quantized checkpoints written from a float model as the real tools lay them out, and a plain-torch
reference model that emulates the same int8 math.

Layouts (`python scripts/quantize.py LAYOUT [--model DIR] [--out DIR] [--norm-bias]`):

- `w8a8`, `w8a8_dynamic`, `w8a16`: msModelSlim's (Huawei's, MindIE's and vllm-ascend's):
  `quant_model_weight_<type>.safetensors` and `quant_model_description_<type>.json` ({"model_quant_type",
  "version", and each tensor's scheme or FLOAT}). Weights per channel, symmetric (max |w| / 127,
  `weight_offset` zeros), but W8A16's asymmetric: scale (max − min) / 255, offset round(−128 − min /
  scale), and W ≈ (weight − weight_offset) · weight_scale, msModelSlim's definition (its
  quantized_weight_format.md; the NPU's operator adds the offset, so a loader negates it). W8A8
  calibrates one activation scale and offset per layer (min-max over a few texts): `input_scale`,
  `input_offset`, `deq_scale` = input_scale · weight_scale and `quant_bias` = round(bias / deq_scale) −
  input_offset · Σ_k W[:, k]; it keeps the MLPs' `down_proj` layers FLOAT,
  as msModelSlim's W8A8 recipes for Llama-family models fall them back (`disable_names`): their input,
  the gated product, has outliers that one per-tensor scale cannot hold (on SmolLM2, −0.88 nats per
  token quantized, −0.06 float).
- `w8a8_mix`: msModelSlim's prefill-decode mix (`W8A8_MIX`): every layer with both W8A8_DYNAMIC's
  tensors (and its float bias) and W8A8's (`down_proj` included); served per token, so its reference
  is W8A8_DYNAMIC's.
- `--norm-bias`: with the norm biases of msModelSlim's anti-outlier suppression (`shift_norms`).
- `compressed-tensors`: llm-compressor's int8 W8A8 (`model.safetensors` with `weight` int8 and
  `weight_scale` [out, 1] = max |w| / 127.5 as compressed-tensors computes a symmetric scale, and
  `quantization_config` in config.json; `lm_head` ignored).

msModelSlim's layouts keep `lm_head` FLOAT as its default configurations do. The reference (`reference`)
is the float model whose linear layers compute the layout's math in plain torch (exact integer
accumulators), for tests/test_quantization.py to compare tokenline with, token for token. `int8` is the
reference of the `quantization: int8` setting (no files: the worker quantizes at load).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MSMODELSLIM = {"w8a8": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "w8a16": "W8A16", "w8a8_mix": "W8A8_MIX"}
LAYOUTS = (*MSMODELSLIM, "compressed-tensors")
STATIC_FALLBACK = "mlp.down_proj"  # W8A8 keeps these float
RECIPE = "r3"  # in the cached layouts' directory names: a change to the recipe writes them again
CALIBRATION = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Water boils at 100 degrees Celsius at sea level; ice melts at 0.",
    "Once upon a time, a little robot learned to paint the sky in many colours.",
]
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
CHUNK = 1024  # int8 products of this many terms stay below 2^24: exact in float32


@dataclass
class Layer:
    """One linear layer's quantized tensors (what the layout writes; what the reference computes with)."""

    weight: torch.Tensor  # int8 [out, in]
    weight_scale: torch.Tensor  # float32 [out]
    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None  # W8A8: float32 [1]
    input_offset: torch.Tensor | None = None  # W8A8: float32 [1], an integer
    quant_bias: torch.Tensor | None = None  # W8A8: int32 [out]
    deq_scale: torch.Tensor | None = None  # W8A8: float32 [out]
    weight_offset: torch.Tensor | None = None  # W8A16: float32 [out], integers: W ≈ (weight − offset) · scale


def load_float(path: Path) -> nn.Module:
    """The float model; an MoE model's experts one by one, as the real tools quantize and write them
    (workers/models/quant/experts.py)."""
    from transformers import AutoModelForCausalLM

    from workers.models.quant.convert import replace
    from workers.models.quant.experts import computes_alike, fused_experts, split

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    for name, module in list(fused_experts(model)):
        experts = split(module)
        if not computes_alike(module, experts):
            raise SystemExit(f"{path}: {name} computes otherwise than each expert's down(act(gate) · up)")
        replace(model, name, experts)
    return model


# The norms msModelSlim's anti-outlier suppression biases, and the layers that read each one.
SHIFTED = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def shift_norms(model: nn.Module, size: float = 1.0) -> None:
    """msModelSlim's asymmetric anti-outlier suppression as its checkpoints show it (MindIE-LLM's
    anti_outlier.md): a bias β (float32) added to each decoder layer's input and post-attention norm
    (`input_layernorm.bias`), and taken off again in the linear layers that read it: their bias becomes
    b − W·β (created where there was none), which per-token W8A8 keeps as the layer's `bias` and static
    W8A8 folds into quant_bias. The float model computes as before, up to rounding; its int8
    activations do not. β here is random (its size: `size`), deterministic."""
    generator = torch.Generator().manual_seed(0)
    for layer in model.model.layers:
        for norm_name, readers in SHIFTED.items():
            norm = getattr(layer, norm_name)
            beta = torch.randn(norm.weight.shape, generator=generator) * size
            norm.bias = nn.Parameter(beta, requires_grad=False)  # `<norm>.bias` in the state dict
            norm.forward = _biased(norm)
            for reader in readers:
                linear = layer.get_submodule(reader)
                with torch.no_grad():
                    bias = -(linear.weight @ beta) if linear.bias is None else linear.bias - linear.weight @ beta
                linear.bias = nn.Parameter(bias, requires_grad=False)


def _biased(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The norm's own forward, its bias added."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return type(norm).forward(norm, x) + norm.bias.to(x.dtype)

    return forward


def linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder's linear layers (the LM head stays float in every layout, and so do MoE routers, as
    the tools keep them)."""
    from schemas.quantization import QuantSpec
    from workers.models.quant.convert import ROUTERS

    kept = QuantSpec("load", "W8A8_DYNAMIC", ignore=ROUTERS)  # scheme_of: None for a router
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in f".{n}" and kept.scheme_of(n) is not None
    }


def per_channel(weight: torch.Tensor, divisor: float = 127.0) -> tuple[torch.Tensor, torch.Tensor]:
    weight = weight.detach().float()
    scale = weight.abs().amax(1).clamp(min=1e-12) / divisor
    return torch.round(weight / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def asymmetric_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 values, scales and offsets per row, asymmetric: W ≈ (values − offset) · scale."""
    weight = weight.detach().float()
    low, high = weight.amin(1), weight.amax(1)
    scale = (high - low).clamp(min=1e-12) / 255
    offset = torch.round(-128 - low / scale)
    values = torch.round(weight / scale[:, None] + offset[:, None]).clamp(-128, 127).to(torch.int8)
    return values, scale, offset


@torch.no_grad()
def input_ranges(model: nn.Module, path: Path) -> dict[str, tuple[float, float]]:
    """Min and max of each linear layer's input over the calibration texts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ranges: dict[str, tuple[float, float]] = {}

    def hook(name: str):
        def record(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            low, high = ranges.get(name, (0.0, 0.0))
            ranges[name] = (min(low, args[0].min().item()), max(high, args[0].max().item()))

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears(model).items()]
    for text in CALIBRATION:
        model(torch.tensor([tokenizer.encode(text)]))
    for handle in handles:
        handle.remove()
    return ranges


def quantize(model: nn.Module, path: Path, layout: str) -> dict[str, Layer]:
    """Each decoder linear layer's tensors in `layout`."""
    ranges = input_ranges(model, path) if layout in ("w8a8", "w8a8_mix") else {}
    layers = {}
    for name, linear in linears(model).items():
        if layout == "w8a8" and name.endswith(STATIC_FALLBACK):
            continue
        divisor = 127.5 if layout == "compressed-tensors" else 127.0
        weight, scale = per_channel(linear.weight, divisor)
        bias = None if linear.bias is None else linear.bias.detach().float()
        layer = Layer(weight, scale, bias)
        if layout == "w8a16":
            values, scale, offset = asymmetric_per_channel(linear.weight)
            layer = Layer(values, scale, bias, weight_offset=offset)
        if layout in ("w8a8", "w8a8_mix"):  # the mix: both schemes' tensors, the dynamic one's bias kept
            low, high = ranges[name]
            input_scale = torch.tensor([(high - low) / 255])
            input_offset = torch.round(-128 - torch.tensor([low]) / input_scale)
            deq_scale = input_scale * scale
            rounded = torch.zeros_like(scale) if bias is None else torch.round(bias / deq_scale)
            quant_bias = rounded - input_offset * weight.double().sum(1).float()
            kept = bias if layout == "w8a8_mix" else None
            layer = Layer(weight, scale, kept, input_scale, input_offset, quant_bias.to(torch.int32), deq_scale)
        layers[name] = layer
    return layers


def write(path: Path, layout: str, out: Path, norm_bias: bool = False) -> Path:
    """The layout written from the float model at `path` into `out` (`norm_bias`: with the norm biases of
    msModelSlim's anti-outlier suppression, `shift_norms`)."""
    from workers.models.quant.experts import stored_name

    model = load_float(path)
    if norm_bias:
        shift_norms(model)
    if layout in ("w8a8", "w8a8_mix") and any(".experts." in name for name in linears(model)):
        # One activation scale per expert projection, from the calibration texts, which need not reach
        # every expert.
        raise SystemExit(f"{path}: an MoE model; this script writes its static W8A8 layout for dense models only")
    layers = quantize(model, path, layout)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (path / name).is_file():
            shutil.copy(path / name, out / name)
    config = json.loads((path / "config.json").read_text())
    # Named as the model's own checkpoints name them (Mixtral's MoE blocks: experts.stored_name).
    kind = str(config.get("model_type", ""))
    state = {stored_name(name, kind): tensor for name, tensor in state.items()}
    layers = {stored_name(name, kind): layer for name, layer in layers.items()}
    if layout == "compressed-tensors":
        # As llm-compressor's MoE recipes leave the routers float: named in `ignore`, as the checkpoint names them.
        routers = [stored_name(name, kind) for name in routers_of(model)]
        _write_compressed_tensors(state, layers, config, out, ["lm_head", *routers])
    else:
        _write_msmodelslim(state, layers, config, MSMODELSLIM[layout], out)
    return out


def _write_msmodelslim(state: dict, layers: dict[str, Layer], config: dict, kind: str, out: Path) -> None:
    from safetensors.torch import save_file

    description: dict[str, str] = {"model_quant_type": kind, "version": "1.0.0"}
    description.update(dict.fromkeys(state, "FLOAT"))
    for name, layer in layers.items():
        del state[f"{name}.weight"]
        description.pop(f"{name}.weight")
        tensors = {
            "weight": layer.weight,
            "weight_scale": layer.weight_scale[:, None],
            "weight_offset": (
                torch.zeros_like(layer.weight_scale) if layer.weight_offset is None else layer.weight_offset
            )[:, None],
        }
        if layer.bias is not None:
            tensors["bias"] = layer.bias
        if kind in ("W8A8", "W8A8_MIX"):
            tensors.update(
                input_scale=layer.input_scale,
                input_offset=layer.input_offset,
                quant_bias=layer.quant_bias,
                deq_scale=layer.deq_scale,
            )
        if kind == "W8A8":
            state.pop(f"{name}.bias", None)
        for key, tensor in tensors.items():
            state[f"{name}.{key}"] = tensor.contiguous()
            description[f"{name}.{key}"] = kind
    save_file(state, str(out / f"quant_model_weight_{kind.lower()}.safetensors"), metadata={"format": "pt"})
    (out / f"quant_model_description_{kind.lower()}.json").write_text(json.dumps(description, indent=2))
    (out / "config.json").write_text(json.dumps({**config, "quantize": kind.lower()}, indent=2))


def routers_of(model: nn.Module) -> list[str]:
    """The MoE routers that are linear layers (PhiMoE's; others' are modules of their own)."""
    from schemas.quantization import QuantSpec
    from workers.models.quant.convert import ROUTERS

    kept = QuantSpec("load", "W8A8_DYNAMIC", ignore=ROUTERS)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and kept.scheme_of(n) is None]


def _write_compressed_tensors(
    state: dict, layers: dict[str, Layer], config: dict, out: Path, ignore: list[str]
) -> None:
    from safetensors.torch import save_file

    for name, layer in layers.items():
        state[f"{name}.weight"] = layer.weight
        state[f"{name}.weight_scale"] = layer.weight_scale[:, None].contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None}
    group = {
        "targets": ["Linear"],
        "weights": {**int8, "strategy": "channel", "dynamic": False, "observer": "minmax", "actorder": None},
        "input_activations": {**int8, "strategy": "token", "dynamic": True, "observer": None, "actorder": None},
        "output_activations": None,
        "format": "int-quantized",
    }
    config["quantization_config"] = {
        "config_groups": {"group_0": group},
        "format": "int-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.20.0",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))


def exact_product(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x_q · Wᵀ for integer-valued x_q and W (int8 values, as float32), exact, as float32: products of up
    to CHUNK terms are exact in float32; longer ones are summed from such chunks in float64."""
    if xq.shape[1] <= CHUNK:
        return xq @ weight.t()
    total = torch.zeros(xq.shape[0], weight.shape[0], dtype=torch.float64)
    for start in range(0, xq.shape[1], CHUNK):
        total += (xq[:, start : start + CHUNK] @ weight[:, start : start + CHUNK].t()).double()
    return total.float()


class ReferenceLinear(nn.Module):
    """A layer's int8 math in plain torch: dynamic per-token (W8A8_DYNAMIC, compressed-tensors, int8),
    static per-tensor (W8A8), or float activations on dequantized weights (W8A16). `parts`: the input
    features split as a tensor-parallel group's ranks hold a row-wise layer's (each part's activations
    quantized on their own, W8A8's quant_bias in the first), the parts' products summed, then the bias."""

    def __init__(self, kind: str, layer: Layer, parts: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.kind, self.layer = kind, layer
        self.values = layer.weight.float()  # the int8 values, as float32 for torch's float GEMM
        self.parts = parts or [(0, self.values.shape[1])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, layer = x.reshape(-1, x.shape[-1]).float(), self.layer
        y = None
        for start, end in self.parts:
            part = self.product(rows[:, start:end], self.values[:, start:end], first=start == 0)
            y = part if y is None else y + part
        if layer.bias is not None and self.kind != "W8A8":
            y = y + layer.bias
        return y.reshape(*x.shape[:-1], -1)

    def product(self, rows: torch.Tensor, values: torch.Tensor, first: bool) -> torch.Tensor:
        layer = self.layer
        if self.kind == "W8A16":
            return rows @ ((values - layer.weight_offset[:, None]) * layer.weight_scale[:, None]).t()
        if self.kind == "W8A8":
            xq = torch.clamp(torch.round(rows * (1 / layer.input_scale) + layer.input_offset), -128, 127)
            quant_bias = layer.quant_bias.float() if first else torch.zeros_like(layer.deq_scale)
            return (exact_product(xq, values) + quant_bias) * layer.deq_scale
        scale = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.clamp(torch.round(rows / scale), -128, 127)
        return exact_product(xq, values) * layer.weight_scale * scale  # the weight scales first


class ReferenceRanks(nn.Module):
    """A layer's experts (each projection a ReferenceLinear) as a tensor-parallel group runs them: each
    rank its part of every expert's intermediate features (gate and up rows, down columns), the ranks'
    outputs summed."""

    def __init__(self, experts: nn.Module, world: int) -> None:
        from workers.models.quant.experts import Expert, PerExpert
        from workers.models.quant.sharded import Shard

        super().__init__()
        ranks = []
        for rank in range(world):
            copies = []
            for expert in experts:
                kind = expert.gate_proj.kind
                start, end = Shard(rank, world).span(expert.gate_proj.layer.weight.shape[0])
                gate, up = (_rows(getattr(expert, p).layer, start, end) for p in ("gate_proj", "up_proj"))
                down = replace(expert.down_proj.layer, weight=expert.down_proj.layer.weight[:, start:end])
                layers = [ReferenceLinear(kind, layer) for layer in (gate, up, down)]
                copies.append(Expert(*layers, expert.act_fn))
            ranks.append(PerExpert(copies))
        self.ranks = nn.ModuleList(ranks)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        y = None
        for experts in self.ranks:
            part = experts(*args)
            y = part if y is None else y + part
        return y


def _rows(layer: Layer, start: int, end: int) -> Layer:
    """The layer's output features [start, end)."""
    rows = {
        name: None if value is None else value[start:end]
        for name, value in vars(layer).items()
        if name not in ("input_scale", "input_offset")
    }
    return replace(layer, **rows)


class ReferenceParts(nn.Module):
    """A float layer whose input features are split as a tensor-parallel group's ranks hold a row-wise
    layer's: the parts' products summed, then the bias."""

    def __init__(self, linear: nn.Linear, parts: list[tuple[int, int]]) -> None:
        super().__init__()
        self.linear, self.parts = linear, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.linear.weight
        y = sum(nn.functional.linear(x[..., s:e], weight[:, s:e]) for s, e in self.parts)
        return y if self.linear.bias is None else y + self.linear.bias


class ReferenceEmbedding(nn.Module):
    """Int8 rows, each with its scale, times `multiplier` where the float embedding scales its rows
    (Gemma's `embed_scale`)."""

    def __init__(self, weight: torch.Tensor, multiplier: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight, scale = per_channel(weight)
        # A parameter: a model whose every layer is a reference one still has one (transformers reads
        # a model's device and dtype from its parameters).
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.multiplier = multiplier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[ids].float() * self.scale[ids].unsqueeze(-1)
        return rows if self.multiplier is None else rows * self.multiplier


def reference(path: Path, layout: str, world: int = 1, norm_bias: bool = False) -> nn.Module:
    """The float model at `path` computing `layout`'s int8 math (`int8`: the quantization setting's,
    which also quantizes the LM head and the embedding); `world`: as a tensor-parallel group of that
    many ranks computes it (the row-wise layers' input features split among them); `norm_bias`: as
    `write` wrote it."""
    from workers.models.quant.sharded import EXPERTS, ROW_STYLES, Shard, styles

    model = load_float(path)
    if norm_bias:
        shift_norms(model)
    plan = styles(model) if world > 1 else {}
    rowwise = {name for name, style in plan.items() if style in ROW_STYLES}
    # The mix is served per token (schemes.quantization.MIX).
    kind = "W8A8_DYNAMIC" if layout in ("int8", "compressed-tensors", "w8a8_mix") else MSMODELSLIM[layout]
    # The setting quantizes every linear layer but the routers, the LM head too, and GPT-2's Conv1D.
    targets = linears(model) if layout != "int8" else setting_linears(model)
    layers = quantize(model, path, layout) if layout != "int8" else {}
    for name, linear in targets.items():
        if name not in layers and layout != "int8":
            continue  # kept float by the layout
        if layout == "int8":
            weight, scale = per_channel(linear.weight if isinstance(linear, nn.Linear) else linear.weight.t())
            bias = None if linear.bias is None else linear.bias.detach().float()
            layers[name] = Layer(weight, scale, bias)
        inputs = layers[name].weight.shape[1]
        parts = [Shard(rank, world).span(inputs) for rank in range(world)] if name in rowwise else None
        model.set_submodule(name, ReferenceLinear(kind, layers[name], parts))
    for name in rowwise:  # those the layout keeps float
        linear = model.get_submodule(name)
        if isinstance(linear, nn.Linear):
            parts = [Shard(rank, world).span(linear.in_features) for rank in range(world)]
            model.set_submodule(name, ReferenceParts(linear, parts))
    for name, style in plan.items():
        if style == EXPERTS:
            model.set_submodule(name, ReferenceRanks(model.get_submodule(name), world))
    if layout == "int8":
        embedding = model.get_input_embeddings()
        scale = getattr(embedding, "embed_scale", None)  # Gemma's rows times sqrt(hidden size)
        multiplier = None if scale is None else scale.reshape(()).to(embedding.weight.dtype)
        model.set_input_embeddings(ReferenceEmbedding(embedding.weight.detach(), multiplier))
    return model


def setting_linears(model: nn.Module) -> dict[str, nn.Module]:
    """What `quantization: int8` quantizes: every linear layer (GPT-2's Conv1D, its weight [in, out],
    too) but the MoE routers."""
    from transformers.pytorch_utils import Conv1D

    from schemas.quantization import QuantSpec
    from workers.models.quant.convert import ROUTERS

    kept = QuantSpec("load", "W8A8_DYNAMIC", ignore=ROUTERS)
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and kept.scheme_of(n)}


def smollm2(layout: str) -> Path:
    """SmolLM2 in `layout`, written once per machine under models/ (as scripts/real_models.py caches)."""
    from scripts import real_models

    float_model = real_models.smollm2()
    return real_models._cached(
        real_models.MODELS / f"smollm2-{layout}-{RECIPE}", lambda _tmp, out: write(float_model, layout, out)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layout", choices=LAYOUTS)
    parser.add_argument("--model", type=Path, help="the float model (default: SmolLM2, scripts/real_models.py)")
    parser.add_argument("--out", type=Path, help="default: models/smollm2-<layout>-<recipe>")
    parser.add_argument(
        "--norm-bias", action="store_true", help="msModelSlim's anti-outlier norm biases (msModelSlim's layouts)"
    )
    args = parser.parse_args(argv)
    if args.model is None and args.out is None and not args.norm_bias:
        print(smollm2(args.layout))
        return 0
    from scripts import real_models

    suffix = "-norm-bias" if args.norm_bias else ""
    out = args.out or real_models.MODELS / f"smollm2-{args.layout}{suffix}-{RECIPE}"
    print(write(args.model or real_models.smollm2(), args.layout, out, args.norm_bias))
    return 0


if __name__ == "__main__":
    sys.exit(main())
