"""An MoE layer's experts one by one, as the checkpoints of MoE models hold them.

transformers holds a layer's experts as two 3-D tensors (`gate_up_proj` [experts, 2 × intermediate,
hidden], gate rows first, and `down_proj` [experts, hidden, intermediate]) in a module that the MoE
block calls with the tokens [tokens, hidden], each token's chosen experts [tokens, k] and their
weights [tokens, k]. msModelSlim and llm-compressor quantize each expert's projections and write them
one by one (`mlp.experts.0.gate_proj.weight`, with its scales), as the float checkpoints they start from
name them. `PerExpert` takes the fused module's place with those projections (int8 layers, or float
ones where the checkpoint leaves them float), named as the checkpoint names them, and computes what
transformers' experts compute: each expert on the tokens routed to it, its output weighted and summed.

Which experts run depends on the routing, read on the host: the loop is a registered op,
`tokenline::moe_experts`, opaque to torch.compile as the attention op is (a compiled decode step
calls it between its compiled pieces); a step that runs it cannot be captured as a device graph.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator

import torch
from torch import nn

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# What the checkpoints of Mixtral-style MoE models name otherwise than transformers does once it has
# loaded them (its conversion mapping renames them as it loads): the MoE block, `block_sparse_moe`
# (transformers: `mlp`), each expert's w1, w3 and w2 (gate, up, down) and PhiMoE's router, `gate`
# (`router`). Pairs (the checkpoint's, transformers'), applied in order; `{}` is an expert's number.
_MIXTRAL = (
    (".block_sparse_moe.", ".mlp."),
    (".experts.{}.w1.", ".experts.{}.gate_proj."),
    (".experts.{}.w3.", ".experts.{}.up_proj."),
    (".experts.{}.w2.", ".experts.{}.down_proj."),
)
RENAMED = {"mixtral": _MIXTRAL, "minimax_m2": _MIXTRAL, "phimoe": (*_MIXTRAL, (".mlp.gate.", ".mlp.router."))}
CHECKED_EXPERTS = 4  # computes_alike routes its tokens to these first experts alone

# The PerExpert modules alive, by the key their op calls name them with.
_LAYERS: weakref.WeakValueDictionary[int, PerExpert] = weakref.WeakValueDictionary()

torch.library.define(
    "tokenline::moe_experts", "(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, int layer) -> Tensor"
)


@torch.library.impl("tokenline::moe_experts", "CompositeExplicitAutograd")
def moe_experts_op(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, layer: int
) -> torch.Tensor:
    return _LAYERS[layer].run(hidden_states, top_k_index, top_k_weights)


@torch.library.register_fake("tokenline::moe_experts")
def _(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)


def model_name(stored: str, model_type: str) -> str:
    """The name transformers gives the checkpoint's tensor (or module) `stored`."""
    for old, new in RENAMED.get(model_type, ()):
        stored = _rename(stored, old, new)
    return stored


def stored_name(name: str, model_type: str) -> str:
    """The name the checkpoints of `model_type` give transformers' tensor (or module) `name`."""
    for old, new in reversed(RENAMED.get(model_type, ())):
        name = _rename(name, new, old)
    return name


def _rename(name: str, old: str, new: str) -> str:
    pattern = re.escape(old).replace(r"\{\}", r"(\d+)")
    return re.sub(pattern, new.replace("{}", r"\1"), f"{name}.")[:-1]


class Expert(nn.Module):
    """One expert's projections: down(act(gate(x)) · up(x)). gate and up read one input in turn, so
    where both are dynamic int8 layers they become one product (convert.join_siblings). The activation
    (a module without state) is the fused module's, shared by its experts."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate_proj, up_proj, down_proj, act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PerExpert(nn.ModuleList):
    """A layer's experts one by one (children `0`, `1`, … as the checkpoint names them), called as
    transformers' experts module is called."""

    def __init__(self, experts: list[Expert]) -> None:
        super().__init__(experts)
        self.key = id(self)
        _LAYERS[self.key] = self

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.tokenline.moe_experts(hidden_states, top_k_index, top_k_weights, self.key)

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for index in top_k_index.unique().tolist():  # the experts this step's tokens chose (read on the host)
            if index >= len(self):  # no expert (a router's padding), as transformers' experts skip it
                continue
            tokens, slots = torch.where(top_k_index == index)
            y = self[index](hidden_states[tokens])
            out.index_add_(0, tokens, (y * top_k_weights[tokens, slots, None]).to(out.dtype))
        return out


def fused_experts(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Each module of `model` that holds a layer's experts as transformers' fused 3-D tensors, gate and
    up rows stacked, without biases (Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4.5, Mixtral and the others that
    share the layout); by name."""
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
            continue
        if gate_up.dim() != 3 or down.dim() != 3 or not hasattr(module, "act_fn"):
            continue
        experts, rows, hidden = gate_up.shape
        if tuple(down.shape) != (experts, hidden, rows // 2) or getattr(module, "gate_up_proj_bias", None) is not None:
            continue
        yield name, module


def computes_alike(module: nn.Module, experts: nn.Module) -> bool:
    """Whether `experts` (the fused `module` split; across a tensor-parallel group, each rank's part
    with the ranks' outputs summed, as the fused module's are) computes what `module` computes: some
    architectures gate otherwise than act(gate) · up, or norm the experts' output. Checked on random
    tokens routed among the first CHECKED_EXPERTS experts, in the module's dtype (the same tokens on
    every rank)."""
    weight = module.gate_up_proj
    generator = torch.Generator().manual_seed(0)
    count = min(CHECKED_EXPERTS, weight.shape[0])
    chosen = min(2, count)
    hidden = torch.randn(4, weight.shape[2], generator=generator).to(weight.device, weight.dtype)
    index = torch.stack([torch.randperm(count, generator=generator)[:chosen] for _ in range(4)]).to(weight.device)
    weights = torch.rand(4, chosen, generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        fused, split_ = module(hidden, index, weights).float(), experts(hidden, index, weights).float()
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return torch.allclose(fused, split_, rtol=tolerance, atol=tolerance * float(fused.abs().max()))


def split(module: nn.Module) -> PerExpert:
    """The fused experts as float linear layers one by one, whose weights are views of the fused
    tensors (nothing is copied: quantized one by one, the fused tensors go once the last is); of a
    tensor-parallel rank's part of them, its part of each expert."""
    from workers.models.quant.sharded import local

    experts = []
    for gate_up, down in zip(local(module.gate_up_proj).detach(), local(module.down_proj).detach(), strict=True):
        layers = [_linear(w) for w in (*gate_up.chunk(2), down)]
        experts.append(Expert(*layers, module.act_fn))
    return PerExpert(experts)


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer
