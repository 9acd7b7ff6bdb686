"""Reading a quantized checkpoint: the architecture from config.json, the float tensors into it, and
each quantized linear layer's tensors into an Int8Linear, by the names its format writes.

A quantized layer's tensors, beside `<layer>.weight` (int8 [out, in]), by format:

- msModelSlim W8A8_DYNAMIC: `weight_scale` [out, 1], `weight_offset` [out, 1] (zeros: symmetric).
- msModelSlim W8A8: `input_scale` [1], `input_offset` [1], `quant_bias` int32 [out], `deq_scale`
  [out]; the older exporter also `weight_scale` and `weight_offset` (zeros).
- msModelSlim W8A16: `weight_scale` [out, 1], `weight_offset` [out, 1]: W = (weight − weight_offset)
  · weight_scale.
- msModelSlim W8A8_MIX: W8A8_DYNAMIC's and W8A8's; served as W8A8_DYNAMIC (schemas/quantization.py
  MIX).
- compressed-tensors int8: `weight_scale` [out, 1] (symmetric: no `weight_zero_point`).

Every `*.safetensors` file of the directory is read (msModelSlim names its file
`quant_model_weight_w8a8_dynamic.safetensors`, llm-compressor `model.safetensors`). deq_scale is
float32, or for float16 models
int64 holding float32 bits. msModelSlim's W8A16 offset is subtracted (its quantized_weight_format.md);
Int8Linear's, as the NPU's operator, is added: it is negated at load, as Ascend's frameworks do.
Per-group W8A16 scales ([out, in / group]) are refused.
"""

from __future__ import annotations

import logging
import re
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from schemas.quantization import MIX, QuantSpec, UnsupportedQuantization
from workers.models.quant.convert import replace
from workers.models.quant.experts import (
    CHECKED_EXPERTS,
    PROJECTIONS,
    Expert,
    PerExpert,
    computes_alike,
    fused_experts,
    model_name,
    split,
    stored_name,
)
from workers.models.quant.linear import DYNAMIC, STATIC, Int8Linear
from workers.models.quant.sharded import Shard, refusal, shard_model, styles, take_part, unsupported

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# Rotary frequencies, which older exporters saved and transformers computes.
ROTARY = (".inv_freq", ".original_inv_freq")
LAYER = re.compile(r"model\.layers\.(\d+)\.")
MTP = re.compile(r"(^|\.)mtp\.")
# An MoE layer's experts as the checkpoints of MoE models store them: one projection per expert
# (`mlp.experts.0.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.0.w1.weight`).
PER_EXPERT = re.compile(r"\.experts\.\d+\.")


class Tensors:
    """The tensors of a directory's safetensors files, read on demand, by the names transformers gives
    them (experts.model_name: Mixtral-style checkpoints name their MoE blocks otherwise)."""

    def __init__(self, path: Path, stack: ExitStack, model_type: str = "") -> None:
        self.files = {}
        self.stored: dict[str, str] = {}  # the checkpoint's name of each tensor, by transformers' name
        self.read: set[str] = set()  # the names of those read
        for file in sorted(path.glob("*.safetensors")):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for key in handle.keys():  # noqa: SIM118 (safe_open is no dict)
                name = model_name(key, model_type)
                self.files[name], self.stored[name] = handle, key
        if not self.files:
            raise FileNotFoundError(f"{path} has no *.safetensors file")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise UnsupportedQuantization(f"the checkpoint has no tensor {name}")
        self.read.add(name)
        return self.files[name].get_tensor(self.stored[name])


def load_quantized(
    path: Path, spec: QuantSpec, dtype: torch.dtype, config: PretrainedConfig, shard: Shard | None = None
) -> nn.Module:
    """The model of `path` (whose configuration the loader has read: `config`, which becomes the
    model's) with its quantized layers as Int8Linear and the rest in `dtype`, on the CPU; with `shard`,
    this rank's part of it, by the model's tensor-parallel plan (sharded.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if hasattr(config, "quantization_config"):  # read by tokenline, not by transformers' quantizers
        del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    plan = styles(model) if shard is not None else {}  # each split layer's style, read once
    problem = unsupported(plan)
    if shard is not None and problem is not None:
        raise refusal(*problem, shard.world)
    with ExitStack() as stack:
        model_type = str(config.model_type)
        tensors = Tensors(path, stack, model_type)
        taken: set[str] = set()  # the layers of which this rank has kept its part as they were read
        quantized = _per_expert(model, spec, tensors, model_type, shard, plan, taken)
        quantized += _quantized_layers(model, spec, tensors, model_type, shard, plan, taken)
        state = model.state_dict()
        wanted = [name for name in state if name in tensors]
        missing = set(state) - set(wanted) - _tied(model)
        experts = sorted(name for name in tensors.files if PER_EXPERT.search(name) and name not in state)
        if missing and experts:
            raise UnsupportedQuantization(
                f"the checkpoint stores its MoE experts under names this model's layers do not have "
                f"({tensors.stored[experts[0]]} first): tokenline loads a quantized MoE checkpoint's experts named "
                "`mlp.experts.<expert>.gate_proj`, `up_proj` and `down_proj`, or as Mixtral's are"
            )
        if missing:
            raise UnsupportedQuantization(f"the checkpoint lacks {len(missing)} tensors, {sorted(missing)[0]} first")
        model.load_state_dict(
            {name: _float(name, tensors.get(name), state[name], spec) for name in wanted}, strict=False
        )
        _norm_biases(model, tensors)
        layers = int(config.get_text_config().num_hidden_layers)
        left = [name for name in tensors.files if name not in tensors.read]
        unused = sorted(name for name in left if not _not_run(name, layers))
        if len(left) > len(unused):
            logger.info("%s: %d tensors of what the model does not run are not loaded", path, len(left) - len(unused))
        if unused:
            raise UnsupportedQuantization(
                f"the checkpoint holds {len(unused)} tensor{'s' if len(unused) > 1 else ''} that no layer of "
                f"{type(model).__name__} takes "
                f"({tensors.stored[unused[0]]} first): served without them, the model would answer otherwise"
            )
    model.tie_weights()
    if shard is not None:
        shard_model(model, shard, plan, taken)
    logger.info("%s: %d linear layers in int8 (%s)", path, quantized, spec.label)
    return model


def _not_run(name: str, layers: int) -> bool:
    """A checkpoint's tensor of what transformers' model of it does not run, and whose own loading
    ignores too: rotary frequencies, and multi-token-prediction layers (stored past the model's
    `layers`, as DeepSeek-V3's layer 61 and GLM-4.5's, or as `mtp.` modules)."""
    if name.endswith(ROTARY) or MTP.search(name):
        return True
    match = LAYER.match(name)
    return match is not None and int(match.group(1)) >= layers


def _norm_biases(model: nn.Module, tensors: Tensors) -> None:
    """msModelSlim's asymmetric anti-outlier suppression adds a bias to the norms before the quantized
    layers (`input_layernorm.bias`, `post_attention_layernorm.bias`, float32), and takes it off again in
    those layers' own biases (per-token W8A8) or quant_bias (per-tensor W8A8). RMSNorm has none:
    each such norm becomes a NormBias."""
    for name in sorted(tensors.files):
        module_name = name.removesuffix(".bias")
        if name == module_name or name in tensors.read:
            continue
        try:
            norm = model.get_submodule(module_name)
        except AttributeError:
            continue
        if "norm" in type(norm).__name__.lower() and getattr(norm, "bias", None) is None:
            bias = tensors.get(name)
            if not bias.is_floating_point() or tuple(bias.shape) != tuple(norm.weight.shape):
                raise UnsupportedQuantization(
                    f"{name} is {bias.dtype} {tuple(bias.shape)}, not a float bias of its norm"
                )
            model.set_submodule(module_name, NormBias(norm, bias))


class NormBias(nn.Module):
    """A norm and the bias msModelSlim's anti-outlier suppression adds to its output."""

    def __init__(self, norm: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.norm = norm
        self.register_buffer("bias", bias.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return y + self.bias.to(y.dtype)


def _float(name: str, tensor: torch.Tensor, expected: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """A tensor of a layer the checkpoint leaves float, in the model's dtype: integers there are a
    quantized layer the description does not name (cast to float they would be served as weights)."""
    if not tensor.is_floating_point() and expected.is_floating_point():
        raise UnsupportedQuantization(
            f"{name} is {tensor.dtype} in the checkpoint, but its {spec.source} description leaves the layer float"
        )
    if tensor.shape != expected.shape:
        raise UnsupportedQuantization(
            f"{name} is {tuple(tensor.shape)} in the checkpoint, not {tuple(expected.shape)} as config.json makes it"
        )
    return tensor.to(expected.dtype)


def _tied(model: nn.Module) -> set[str]:
    """The state names that share another's tensor (a tied LM head), which checkpoints do not repeat."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return set()
    output = model.get_output_embeddings()
    return {f"{name}.weight" for name, module in model.named_modules() if module is output}


def _per_expert(
    model: nn.Module,
    spec: QuantSpec,
    tensors: Tensors,
    model_type: str,
    shard: Shard | None,
    plan: dict[str, str],
    taken: set[str],
) -> int:
    """Put each layer's experts that the checkpoint stores one by one in place of transformers' fused
    ones (experts.PerExpert): int8 layers where the description quantizes a projection, float layers
    (filled with the rest of the state) where it does not; how many int8 layers that made. With
    `shard`, each layer keeps this rank's part of its experts as it is read, by its style in `plan`
    (its name added to `taken`)."""
    count = 0
    checked: set[type] = set()
    for name, module in list(fused_experts(model)):
        if f"{name}.0.gate_proj.weight" not in tensors:
            continue
        if type(module) not in checked:  # its weights are not loaded: random ones show what it computes
            with torch.no_grad():  # (those of the experts the check routes to: a layer's are gigabytes)
                module.gate_up_proj[:CHECKED_EXPERTS].normal_(0, 0.1)
                module.down_proj[:CHECKED_EXPERTS].normal_(0, 0.1)
            if not computes_alike(module, split(module)):
                raise UnsupportedQuantization(
                    f"{type(module).__name__} computes otherwise than each expert's down(act(gate) · up): "
                    "tokenline does not load its experts one by one"
                )
            checked.add(type(module))
        number, rows, hidden = module.gate_up_proj.shape
        shapes = {"gate_proj": (rows // 2, hidden), "up_proj": (rows // 2, hidden), "down_proj": (hidden, rows // 2)}
        dtype = module.gate_up_proj.dtype
        experts = []
        for index in range(number):
            layers = []
            for projection in PROJECTIONS:
                key, (outputs, inputs) = f"{name}.{index}.{projection}", shapes[projection]
                scheme = spec.scheme_of(stored_name(key, model_type))  # the description names it so
                if scheme is None:
                    layers.append(nn.Linear(inputs, outputs, bias=False, dtype=dtype))
                    continue
                stub = nn.Linear(inputs, outputs, bias=False, dtype=dtype, device="meta")
                layers.append(_layer(key, scheme, stub, tensors, spec.source))
                count += 1
            experts.append(Expert(*layers, module.act_fn))
        replace(model, name, PerExpert(experts))
        if shard is not None and name in plan:
            take_part(model, name, plan[name], shard)
            taken.add(name)
    return count


def _quantized_layers(
    model: nn.Module,
    spec: QuantSpec,
    tensors: Tensors,
    model_type: str,
    shard: Shard | None,
    plan: dict[str, str],
    taken: set[str],
) -> int:
    """Each quantized linear layer's Int8Linear in place of its nn.Linear; with `shard`, only this
    rank's part of it is kept as each is read, by its style in `plan` (a rank never holds the whole
    model's int8 weights), and its name added to `taken`."""
    count = 0
    for name, module in list(model.named_modules()):
        scheme = spec.scheme_of(stored_name(name, model_type))
        if scheme is None or type(module) is not nn.Linear:  # a subclass (a router) computes more than a product
            continue
        replace(model, name, _layer(name, scheme, module, tensors, spec.source))
        if shard is not None and name in plan:
            take_part(model, name, plan[name], shard)
            taken.add(name)
        count += 1
    return count


# What each of a quantized layer's tensors may be stored as. Scales and biases are real numbers: an
# integer tensor there (a scale cast to int8 is all zeros) would be served as if it were one. Offsets
# and quant_bias are integers, stored as integers or as floats holding them; deq_scale is float32, or
# int64 holding float32 bits.
FLOAT, INTEGRAL = "floating-point", "integer or floating-point"
KINDS = {
    "bias": FLOAT,
    "weight_scale": FLOAT,
    "input_scale": FLOAT,
    "weight_offset": INTEGRAL,
    "input_offset": INTEGRAL,
    "quant_bias": INTEGRAL,
}


def _kind_problem(key: str, tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot be the layer's `key`, by its dtype; None if it can."""
    if key == "deq_scale":
        return None if tensor.dtype in (torch.float32, torch.int64) else "float32 or int64 (float32 bits)"
    kind = KINDS[key]
    if tensor.is_floating_point() or (kind == INTEGRAL and not tensor.is_complex() and tensor.dtype != torch.bool):
        return None
    return kind


def _layer(name: str, scheme: str, linear: nn.Linear, tensors: Tensors, source: str) -> Int8Linear:
    weight = tensors.get(f"{name}.weight")
    if weight.dtype != torch.int8 or tuple(weight.shape) != tuple(linear.weight.shape):
        raise UnsupportedQuantization(
            f"{name}.weight is {weight.dtype} {tuple(weight.shape)}, not int8 {tuple(linear.weight.shape)}"
        )
    outputs = linear.out_features

    def get(key: str, count: int = outputs) -> torch.Tensor:
        """The layer's tensor `key`: `count` values (per output channel, or one for the input)."""
        tensor = tensors.get(f"{name}.{key}")
        expected = _kind_problem(key, tensor)
        if expected is not None:
            raise UnsupportedQuantization(f"{name}.{key} is {tensor.dtype}, not {expected}")
        if key == "weight_scale" and tensor.dim() == 2 and tensor.shape[1] != 1:
            raise UnsupportedQuantization(f"per-group {scheme} ({name}.weight_scale is {tuple(tensor.shape)})")
        if tensor.numel() != count:
            raise UnsupportedQuantization(
                f"{name}.{key} is {tuple(tensor.shape)}, not {count} value{'s' if count > 1 else ''} for {name}.weight "
                f"{tuple(weight.shape)}"
            )
        return tensor

    def optional(key: str) -> torch.Tensor | None:
        return get(key) if f"{name}.{key}" in tensors else None

    bias = optional("bias")  # a static layer's is in its quant_bias already, where msModelSlim keeps both
    scale = optional("weight_scale")  # first: a per-group scale is refused as such
    offset = optional("weight_offset")
    if scheme in (DYNAMIC, STATIC, MIX) and offset is not None and offset.any():
        raise UnsupportedQuantization(f"{scheme} with asymmetric weights ({name}.weight_offset is not zero)")
    if source == "msmodelslim" and scheme == STATIC:
        static = {
            "input_scale": get("input_scale", 1),
            "input_offset": get("input_offset", 1),
            "quant_bias": get("quant_bias"),
        }
        deq_scale = _deq_scale(get("deq_scale"))
        # msModelSlim's newer exporter writes no weight_scale: deq_scale = input_scale · weight_scale.
        scale = deq_scale / static["input_scale"].float() if scale is None else scale
        return Int8Linear(STATIC, weight, scale, None, deq_scale=deq_scale, **static)
    if scale is None:
        scale = get("weight_scale")  # refused: the scheme needs it
    if scheme == MIX:  # per token, as vllm-ascend outside a disaggregated decode node: its static tensors unused
        for key, count in (("input_scale", 1), ("input_offset", 1), ("quant_bias", outputs), ("deq_scale", outputs)):
            if f"{name}.{key}" in tensors:
                get(key, count)
        return Int8Linear(DYNAMIC, weight, scale, bias)
    if source != "msmodelslim":
        if f"{name}.weight_zero_point" in tensors and tensors.get(f"{name}.weight_zero_point").any():
            raise UnsupportedQuantization(f"asymmetric compressed-tensors weights ({name}.weight_zero_point)")
        return Int8Linear(DYNAMIC, weight, scale, bias)
    if scheme == DYNAMIC:
        return Int8Linear(DYNAMIC, weight, scale, bias)
    return Int8Linear(scheme, weight, scale, bias, weight_offset=-get("weight_offset"))


def _deq_scale(value: torch.Tensor) -> torch.Tensor:
    """msModelSlim writes deq_scale as float32, or for float16 models as int64 holding float32 bits."""
    if value.dtype == torch.int64:
        return value.to(torch.int32).view(torch.float32)
    return value.float()
