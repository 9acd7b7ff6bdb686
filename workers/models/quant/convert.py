"""Turning a loaded float model into a quantized one (`quantization: int8`), and binding a quantized
model's layers to the device's int8 products (or, where the device has none, dequantizing them, said
in the log)."""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.pytorch_utils import Conv1D

from schemas.quantization import QuantSpec
from workers.models.quant.experts import computes_alike, fused_experts, split
from workers.models.quant.kernels import Int8Ops, ops_for
from workers.models.quant.linear import DYNAMIC, WEIGHT_ONLY, Int8Embedding, Int8Linear, Siblings
from workers.models.quant.sharded import (
    EXPERTS,
    ROW_STYLES,
    Shard,
    inner,
    local,
    refusal,
    styles,
    unsupported,
    wrap,
)

logger = logging.getLogger(__name__)

# Linear layers that stay float under `quantization: int8`: MoE routers (as vLLM keeps them).
ROUTERS = ("re:.*mlp\\.gate$", "re:.*router.*")
# Projections that read one input in turn, in the order transformers' attention and MLP modules call
# them (Llama, Mistral, Qwen, Gemma and the rest that name them so).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def symmetric_rows(weight: torch.Tensor, whole_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: the int8 values and each row's scale (max |w| / 127). `whole_rows`: the
    weight holds this rank's columns of each row, and the scale is the whole row's (the group's max)."""
    weight = weight.detach().float()
    largest = weight.abs().amax(1)
    if whole_rows:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    scale = largest.clamp(min=1e-12) / 127
    return torch.round(weight / scale[:, None]).clamp_(-128, 127).to(torch.int8), scale


def replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_float(model: nn.Module, spec: QuantSpec, shard: Shard | None = None) -> int:
    """`quantization: int8`: every nn.Linear (and GPT-2's Conv1D; routers aside) becomes a dynamic W8A8
    layer, an MoE model's experts too, one by one (experts.split), and a plain input embedding (or
    Gemma's scaled one) becomes int8 rows; returns how many layers were quantized. `shard`: the model
    is this rank's part of it, as transformers loaded it by its tensor-parallel plan, and its int8
    layers are split alike (sharded.py): a row-wise layer's weight scales are its whole rows', so each
    rank holds the int8 values one process would."""
    plan = styles(model) if shard is not None else {}
    problem = unsupported(plan)
    if shard is not None and problem is not None:
        raise refusal(*problem, shard.world)
    ignore = QuantSpec(spec.source, spec.scheme, ignore=ROUTERS)
    whole_rows: set[int] = set()  # the layers that hold a rank's columns of their rows, experts' down too
    for name, module in list(fused_experts(model)):
        experts = split(module)
        over_group = plan.get(name) == EXPERTS
        summed = wrap(experts, EXPERTS, shard, 0) if over_group else experts
        if computes_alike(module, summed):
            replace(model, name, summed)
            if over_group:  # each expert's down projection holds this rank's columns of its rows
                whole_rows |= {id(expert.down_proj) for expert in experts}
        else:
            logger.warning(
                "quantization int8: the experts of %s compute otherwise than each expert's down(act(gate) · up): "
                "they stay float",
                name,
            )
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    multiplier = scaled_rows(embeddings)
    quantized_embedding = type(embeddings) is nn.Embedding or multiplier is not None
    tied = quantized_embedding and type(head) is nn.Linear and head.weight is embeddings.weight
    linears = [(n, m) for n, m in model.named_modules() if type(m) in (nn.Linear, Conv1D) and ignore.scheme_of(n)]
    for name, linear in linears:
        style = plan.get(name)
        rows = style in ROW_STYLES
        # [out, in]: GPT-2's Conv1D holds its weight [in, out] (y = x · W + b)
        whole = linear.weight if type(linear) is nn.Linear else linear.weight.t()
        weight, scale = symmetric_rows(local(whole), whole_rows=rows or id(linear) in whole_rows)
        layer = Int8Linear(DYNAMIC, weight, scale, local(linear.bias))
        size = whole.shape[1 if rows else 0]  # the split dimension's whole size
        replace(model, name, wrap(layer, style, shard, size) if shard is not None else layer)
    if quantized_embedding:
        name = _name_of(model, embeddings)
        quantized_head = inner(model.get_output_embeddings())
        if tied and isinstance(quantized_head, Int8Linear):  # one int8 tensor for both, until bind
            weight, scale = quantized_head.qweight, quantized_head.weight_scale
        else:
            weight, scale = symmetric_rows(local(embeddings.weight))
        embedding = Int8Embedding(weight, scale, embeddings.weight.dtype, tied=tied, multiplier=multiplier)
        vocabulary = embeddings.weight.shape[0]
        replace(model, name, wrap(embedding, plan.get(name), shard, vocabulary) if shard is not None else embedding)
    return len(linears)


def scaled_rows(embedding: nn.Module | None) -> torch.Tensor | None:
    """What a scaled input embedding (Gemma's `*ScaledWordEmbedding`: its rows times `embed_scale`, a
    number, in the weight's dtype) multiplies its rows by, in that dtype; None for any other module.
    Checked by running its class's forward on a small table of its own: one that computes otherwise is
    not quantized."""
    scale = getattr(embedding, "embed_scale", None)
    if not isinstance(embedding, nn.Embedding) or not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        return None
    weight = embedding.weight
    multiplier = scale.detach().reshape(()).to(weight.dtype)
    ids = torch.tensor([[0, 3, 1]])
    try:  # on a small table of its own, for the while
        embedding.weight = nn.Parameter(torch.randn(4, 3).to(weight.dtype), requires_grad=False)
        with torch.no_grad():  # the class's forward, not one a tensor-parallel plan installed on the module
            rows = type(embedding).forward(embedding, ids)
            alike = torch.equal(rows, nn.functional.embedding(ids, embedding.weight) * multiplier)
    finally:
        embedding.weight = weight
    return multiplier if alike else None


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def bind(model: nn.Module, device: torch.device, dtype: torch.dtype, ops: Int8Ops | None = None) -> str:
    """Hand every Int8Linear the device's products (or `ops`); where a layer cannot run in int8 on
    this device, replace it with its dequantized float layer in the model's `dtype` (logged). Returns
    the kernel that runs the int8 layers."""
    ops = ops or ops_for(device)
    if ops is not None and ops.dtypes is not None and dtype not in ops.dtypes:
        logger.warning(
            "%s takes %s models, not %s: the int8 layers are dequantized",
            ops.name,
            " or ".join(map(str, ops.dtypes)),
            dtype,
        )
        ops = None
    dequantized: Counter[str] = Counter()
    if ops is not None:
        join_siblings(model, ops)
    for name, module in list(model.named_modules()):
        if not isinstance(module, Int8Linear) or module.siblings is not None:
            continue
        if ops is None or (module.scheme == WEIGHT_ONLY and not ops.weight_only):
            replace(model, name, module.dequantized(dtype))
            dequantized[module.scheme] += 1
            continue
        try:
            module.bind(ops, dtype)
        except ValueError as exc:
            logger.warning("%s: %s; its weights are dequantized to float", name, exc)
            replace(model, name, module.dequantized(dtype))
            dequantized[module.scheme] += 1
    for scheme, count in dequantized.items():
        logger.warning(
            "%s on %s: no int8 path for %d %s layers; their weights are dequantized to float at load",
            "int8",
            device,
            count,
            scheme,
        )
    if ops is not None and ops.gathers_rows:
        share_tied_rows(model)
    if ops is None or not any(isinstance(m, Int8Linear) for m in model.modules()):
        return "dequantized at load"
    return ops.name


def share_tied_rows(model: nn.Module) -> None:
    """A tied LM head and the input embedding keep one int8 copy where the device's products can read
    the packed weight's rows: the embedding gathers them from the head's (CUDA, the NPU). fbgemm's
    packed layout cannot be read back, so on a CPU the embedding keeps its own copy."""
    embedding = inner(model.get_input_embeddings()) if hasattr(model, "get_input_embeddings") else None
    head = inner(model.get_output_embeddings()) if hasattr(model, "get_output_embeddings") else None
    if (
        isinstance(embedding, Int8Embedding)
        and embedding.tied
        and isinstance(head, Int8Linear)
        and head.ops is not None
    ):
        embedding.take_rows_from(head)


def join_siblings(model: nn.Module, ops: Int8Ops) -> None:
    """Dynamic layers of one module that transformers' code calls in turn on one input (`SIBLINGS`)
    become one product (linear.Siblings); where the device cannot pack their stacked weight, each
    stays its own layer."""
    for module in model.modules():
        for names in SIBLINGS:
            layers = [getattr(module, name, None) for name in names]
            if not all(isinstance(layer, Int8Linear) and layer.scheme == DYNAMIC for layer in layers):
                continue
            try:
                siblings = Siblings(layers, ops)  # type: ignore[arg-type]
            except ValueError:
                continue  # bound one by one below (each said in the log if it cannot run in int8)
            start = 0
            for layer in layers:
                layer.join(siblings, start, last=layer is layers[-1])  # type: ignore[union-attr]
                start += layer.out_features  # type: ignore[union-attr]


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its first floating-point parameter's, or, where it has none
    (every layer int8 and norms without weights, as OLMo's under `quantization: int8`), its int8
    embedding's."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    for module in model.modules():
        if isinstance(module, Int8Embedding):
            return module.dtype
    raise ValueError(f"{type(model).__name__} holds no floating-point weight to take its dtype from")


def weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's weights as the device holds them: float parameters and buffers, and the
    int8 layers' weights (packed or not) with their scales; of a tensor-parallel shard (a DTensor, whose
    numel is the whole tensor's), the part on this rank's device."""
    total = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int8Embedding)):
            total += module.weight_bytes
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is None or id(tensor) in seen or name == "qweight":
                continue
            seen.add(id(tensor))
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            total += local.numel() * local.element_size()
    return total
