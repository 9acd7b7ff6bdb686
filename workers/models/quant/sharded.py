"""Tensor parallelism for a quantized model: the model's tensor-parallel plan in transformers
(`model.tp_plan`), applied by tokenline to its int8 layers, which transformers' parallel styles do not
know, and to the float layers of a quantized checkpoint, which transformers does not load.

Each rank holds the slice of a layer that the plan's style gives it (as transformers' `DTensor`s split a
dimension: chunks of ceil(size / world), the last one shorter). By style, what a rank holds, and what
follows its product:

- `colwise`: its output features (heads); nothing follows (the next layer reads them).
- `colwise_gather_output`: its output features (an LM head's vocabulary); every rank's are gathered.
- `rowwise`: its input features; summed over the group, then the bias (once).
- `rowwise_split_input`: its input features, taken from the whole input (Phi-3); as `rowwise`.
- `embedding_rowwise`: its rows of the vocabulary; summed over the group (one rank holds each row).
- `moe_tp_experts`: its rows of each expert's gate and up, its columns of each one's down; the
  experts' output summed over the group.
- `replicated_with_grad_allreduce`, `mla_kv_a_proj`: the whole (q/k norms of a rank's heads; MLA's
  compressing projection); nothing in inference (their gradients are summed in training).

A row-wise layer's activations are quantized per token over the rank's own input features, as vLLM
and vllm-ascend do (a group-wide scale would cost a collective per layer), and a static layer's
`quant_bias` is added on rank 0 only. An MoE layer's experts, one by one (experts.PerExpert), are
split as transformers splits its fused ones (`packed_colwise` gate and up rows, `rowwise` down
columns): each rank runs every expert on its part of the intermediate features, and the layer's
output is summed once. Any other style (Llama 4's experts, stored transposed and split by
`packed_rowwise`) is refused by name (`unsupported`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from schemas.quantization import UnsupportedQuantization

COLUMNS, GATHERED, ROWS, VOCABULARY = "colwise", "colwise_gather_output", "rowwise", "embedding_rowwise"
SPLIT_INPUT, EXPERTS = "rowwise_split_input", "moe_tp_experts"
WHOLE = ("replicated_with_grad_allreduce", "mla_kv_a_proj")  # styles that change nothing in inference
SUPPORTED = (COLUMNS, GATHERED, ROWS, SPLIT_INPUT, VOCABULARY, EXPERTS, *WHOLE)
ROW_STYLES = (ROWS, SPLIT_INPUT)  # a rank holds its input features of the layer
# The plan's entry for the fused experts' gate and up tensor, which tokenline splits with its experts.
FUSED_GATE_UP = (".experts.gate_up_proj", "packed_colwise")


@dataclass(frozen=True)
class Shard:
    """This rank's place in its group."""

    rank: int
    world: int

    @classmethod
    def of_group(cls) -> Shard:
        """This process's place in the torch.distributed group it has joined."""
        return cls(dist.get_rank(), dist.get_world_size())

    def span(self, size: int) -> tuple[int, int]:
        """This rank's [start, end) of a dimension of `size`, as a DTensor `Shard` splits it."""
        chunk = -(-size // self.world)
        start = min(self.rank * chunk, size)
        return start, min(start + chunk, size)


def unsupported(plan: dict[str, str]) -> tuple[str, str] | None:
    """The first (module, style) of `plan` that tokenline's quantized layers cannot be split by."""
    for name, style in plan.items():
        if style not in SUPPORTED and not (name.endswith(FUSED_GATE_UP[0]) and style == FUSED_GATE_UP[1]):
            return name, style
    return None


def styles(model: nn.Module) -> dict[str, str]:
    """Each of the model's modules that its tensor-parallel plan names, with its style (the plan's `*`
    is a layer's number)."""
    plan = getattr(model, "tp_plan", None) or {}
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in plan.items()]
    found = {}
    for name, _ in model.named_modules():
        style = next((style for pattern, style in patterns if pattern.fullmatch(name)), None)
        if style is not None:
            found[name] = style
    return found


def local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor transformers loaded sharded (a DTensor): this rank's part; any other: itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class RowParallel(nn.Module):
    """A layer that holds this rank's input features (`part`: of the whole input it is given, else the
    input is those already): the ranks' partial products summed, then the bias."""

    def __init__(self, layer: nn.Module, bias: torch.Tensor | None, part: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.part = part
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.part is not None:
            x = x[..., self.part[0] : self.part[1]]
        y = self.layer(x).contiguous()
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class SummedExperts(nn.Module):
    """A layer's experts, each holding this rank's part of its intermediate features: the ranks' outputs
    summed (called as the experts are called)."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        y = self.experts(*args).contiguous()
        dist.all_reduce(y)
        return y


class GatheredColumns(nn.Module):
    """A layer that holds this rank's output features (an LM head's part of the vocabulary): every
    rank's gathered along the last dimension."""

    def __init__(self, layer: nn.Module, out_features: int, shard: Shard) -> None:
        super().__init__()
        self.layer = layer
        self.out_features = out_features
        self.width = -(-out_features // shard.world)  # every rank's, the last one padded to it
        self.world = shard.world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        if y.shape[-1] < self.width:
            y = nn.functional.pad(y, (0, self.width - y.shape[-1]))
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.out_features]


class VocabParallel(nn.Module):
    """An embedding that holds rows [start, start + its rows) of the vocabulary: a token's row from
    the rank that holds it, zeros from the others, summed."""

    def __init__(self, embedding: nn.Module, start: int, rows: int) -> None:
        super().__init__()
        self.embedding = embedding
        self.start, self.rows = start, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        index = ids - self.start
        outside = (index < 0) | (index >= self.rows)
        y = self.embedding(index.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0).contiguous()
        dist.all_reduce(y)
        return y


def wrap(layer: nn.Module, style: str | None, shard: Shard, size: int) -> nn.Module:
    """`layer`, which holds this rank's part of a layer by `style`, in what makes the whole of it from
    the ranks' parts; `size`: the whole of the split dimension (an LM head's vocabulary, a row-wise
    layer's input features)."""
    if style in ROW_STYLES:
        bias = layer.bias
        layer.bias = None  # added once, after the sum
        if shard.rank and getattr(layer, "quant_bias", None) is not None:
            layer.quant_bias = torch.zeros_like(layer.quant_bias)  # a static layer's: rank 0's alone
        part = shard.span(size) if style == SPLIT_INPUT else None
        return RowParallel(layer, None if bias is None else bias.detach(), part)
    if style == GATHERED:
        return GatheredColumns(layer, size, shard)
    if style == VOCABULARY:
        start, end = shard.span(size)
        return VocabParallel(layer, start, end - start)
    if style == EXPERTS:
        return SummedExperts(layer)
    return layer


def shard_model(model: nn.Module, shard: Shard, plan: dict[str, str], taken: set[str]) -> None:
    """Keep this rank's part of each layer `plan` (`styles`, checked by `unsupported`) splits, but those
    `taken` already, in the wrapper that makes the whole (`wrap`): for a quantized checkpoint's model,
    loaded whole (each part is copied, and the whole tensor freed). A tied LM head stays tied: it and
    the embedding keep the same rows."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = isinstance(head, nn.Linear) and head.weight is getattr(embedding, "weight", None)
    for name, style in plan.items():
        if name not in taken:
            take_part(model, name, style, shard)
    if tied and head.weight.shape == embedding.weight.shape:  # both split: the same rows of the vocabulary
        head.weight = embedding.weight


def take_part(model: nn.Module, name: str, style: str, shard: Shard) -> None:
    """Keep this rank's part of the layer `name` (split by `style`), wrapped."""
    module = model.get_submodule(name)
    if style in (COLUMNS, GATHERED):
        size = module.out_features
        _keep(module, rows=shard.span(size))
    elif style in ROW_STYLES:
        size = module.in_features
        _keep(module, columns=shard.span(size))
    elif style == VOCABULARY:
        size = module.num_embeddings
        _keep(module, rows=shard.span(size))
    elif style == EXPERTS:
        from workers.models.quant.experts import PerExpert

        if not isinstance(module, PerExpert):
            raise UnsupportedQuantization(
                f"{name}: transformers' fused experts ({type(module).__name__}) are not split over a device group "
                "as tokenline's int8 experts are"
            )
        size = 0
        for expert in module:
            part = shard.span(expert.gate_proj.out_features)
            _keep(expert.gate_proj, rows=part)
            _keep(expert.up_proj, rows=part)
            _keep(expert.down_proj, columns=part)
    else:
        return
    model.set_submodule(name, wrap(module, style, shard, size))


def _keep(module: nn.Module, rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None) -> None:
    from workers.models.quant.linear import Int8Embedding, Int8Linear

    if isinstance(module, Int8Embedding) and rows is not None:
        module.keep(rows)
        return
    if isinstance(module, Int8Linear):
        module.keep(rows, columns)
        return
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise UnsupportedQuantization(f"{type(module).__name__} cannot be split over a device group as int8 layers are")
    with torch.no_grad():
        weight = module.weight[rows[0] : rows[1]] if rows is not None else module.weight[:, columns[0] : columns[1]]
        module.weight = nn.Parameter(weight.clone(), requires_grad=False)
        if isinstance(module, nn.Linear):
            if rows is not None and module.bias is not None:
                module.bias = nn.Parameter(module.bias[rows[0] : rows[1]].clone(), requires_grad=False)
            module.out_features, module.in_features = module.weight.shape
        else:
            module.num_embeddings = module.weight.shape[0]


def refusal(name: str, style: str, world: int) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"quantized weights with worldSize {world}: the model's tensor-parallel plan splits {name} as {style!r}, "
        f"which tokenline's int8 layers are not split by (it splits {', '.join(SUPPORTED[: -len(WHOLE)])}): "
        "serve it with worldSize 1, or float weights"
    )


def inner(module: nn.Module | None) -> nn.Module | None:
    """The layer a wrapper of this module holds (the module itself where it is none)."""
    if isinstance(module, (RowParallel, GatheredColumns)):
        return module.layer
    return module.embedding if isinstance(module, VocabParallel) else module
