"""The quantized modules that replace a model's nn.Linear and nn.Embedding: int8 weights, kept as int8.

An Int8Linear holds what its scheme needs as buffers (so `model.to(device)` moves them; not in the
state dict, which names the float checkpoint's tensors); `bind`
hands it the device's products (kernels.py), which pack the weight for their GEMM. Until then it
cannot run. An Int8Embedding gathers int8 rows and scales them (every device).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.models.quant.kernels import DYNAMIC, STATIC, WEIGHT_ONLY, Int8Ops

__all__ = ["DYNAMIC", "STATIC", "WEIGHT_ONLY", "Int8Embedding", "Int8Linear", "Siblings"]


class Int8Linear(nn.Module):
    def __init__(
        self,
        scheme: str,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        **static: torch.Tensor,
    ) -> None:
        """`weight` int8 [out, in]; `weight_scale` [out]; for W8A16 `weight_offset` [out]; for W8A8
        `input_scale`, `input_offset` (one each), `quant_bias` and `deq_scale` [out]."""
        super().__init__()
        self.scheme = scheme
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", weight.to(torch.int8), persistent=False)
        self.register_buffer("weight_scale", weight_scale.reshape(-1).float(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        for name in ("weight_offset", "quant_bias", "deq_scale"):
            value = static.get(name)
            self.register_buffer(name, None if value is None else value.reshape(-1).float(), persistent=False)
        scale, offset = static.get("input_scale"), static.get("input_offset")
        self.register_buffer(
            "input_reciprocal", None if scale is None else 1 / scale.reshape(1).float(), persistent=False
        )
        self.register_buffer("input_offset", None if offset is None else offset.reshape(1).float(), persistent=False)
        self.ops: Int8Ops | None = None
        self.packed: Any = None
        self.constants: dict[str, torch.Tensor] = {}  # what the device's products take, made at bind
        # Set by `join` for a layer whose output is its columns of its siblings' one product.
        self.siblings: Siblings | None = None
        self.columns = (0, self.out_features)
        self.last = False  # the siblings' last: it lets their product go

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}"

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features

    def keep(self, rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None) -> None:
        """Keep output features [start, end) of `rows` (with their scales, offsets and bias), or input
        features `columns` of the weight: a tensor-parallel rank's part (sharded.py). Before `bind`."""
        if rows is not None:
            for name in ("qweight", "weight_scale", "bias", "weight_offset", "quant_bias", "deq_scale"):
                value = getattr(self, name)
                if value is not None:
                    setattr(self, name, value[rows[0] : rows[1]].clone())
        if columns is not None:
            self.qweight = self.qweight[:, columns[0] : columns[1]].clone()
        self.out_features, self.in_features = self.qweight.shape

    def bind(self, ops: Int8Ops, dtype: torch.dtype) -> None:
        """Pack the weight for `ops`' GEMM (and make the constants its products take in a `dtype`
        model); the int8 tensor is dropped where the packed copy replaces it."""
        self.packed = ops.pack(self.qweight, self.weight_scale if self.scheme == DYNAMIC else None)
        self.ops = ops
        ops.prepare(self, dtype)
        if self.packed is not self.qweight:
            self.qweight = None

    def join(self, siblings: Siblings, start: int, last: bool) -> None:
        """From now on this layer's output is columns [start, start + out_features) of `siblings`'
        product, which holds its weight, scales and bias."""
        self.siblings, self.ops = siblings, siblings.ops
        self.columns, self.last = (start, start + self.out_features), last
        self.qweight = self.weight_scale = self.bias = None

    def dequantized(self, dtype: torch.dtype) -> nn.Linear:
        """The float layer this one approximates, in the model's `dtype`: for a device without an int8
        path (W8A16 exactly, but for the cast)."""
        weight = self.qweight.float()
        if self.weight_offset is not None:
            weight = weight + self.weight_offset[:, None]
        weight = weight * self.weight_scale[:, None]
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=weight.device)
        linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.to(dtype), requires_grad=False)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.ops is not None, "Int8Linear used before bind()"
        rows = x.reshape(-1, self.in_features)
        if self.siblings is not None:
            y = self.siblings.output(rows, x, self.last)[:, self.columns[0] : self.columns[1]]
        elif self.scheme == DYNAMIC:
            y = self.ops.dynamic(rows, self)
        elif self.scheme == STATIC:
            y = self.ops.static(rows, self)
        else:
            y = self.ops.weight_only_product(rows, self)
        return y.reshape(*x.shape[:-1], self.out_features)


class Siblings(nn.Module):
    """Dynamic layers that a model calls in turn on one input (q, k and v; gate and up), as one product:
    their weights stacked [sum of outputs, in], the activations quantized once, one GEMM (one call and
    its fixed costs where there were three or two; docs/benchmarks.md). The first of them to run on an
    input computes it, and each takes its columns; it is held until the last has taken its own. A layer
    called alone on another input gets the same columns (the product computed again)."""

    def __init__(self, layers: list[Int8Linear], ops: Int8Ops) -> None:
        super().__init__()
        self.scheme = DYNAMIC
        self.in_features = layers[0].in_features
        self.out_features = sum(layer.out_features for layer in layers)
        self.register_buffer("weight_scale", torch.cat([layer.weight_scale for layer in layers]), persistent=False)
        biases = [layer.bias for layer in layers]
        if all(bias is None for bias in biases):
            self.register_buffer("bias", None, persistent=False)
        else:
            zeros = [layer.weight_scale.new_zeros(layer.out_features) for layer in layers]
            bias = torch.cat([b if b is not None else z for b, z in zip(biases, zeros, strict=True)])
            self.register_buffer("bias", bias, persistent=False)
        self.packed = ops.pack(torch.cat([layer.qweight for layer in layers]), self.weight_scale)
        self.ops = ops
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, product)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}"

    def output(self, rows: torch.Tensor, key: torch.Tensor, last: bool) -> torch.Tensor:
        """The product [rows, out_features] of the input `key` (`rows` is it as rows): the held one while
        it is of this very tensor, else computed; held on for the next sibling unless `last`."""
        held = self.held
        product = held[1] if held is not None and held[0] is key else self.ops.dynamic(rows, self)
        self.held = None if last else (key, product)
        return product


class Int8Embedding(nn.Module):
    """Rows of int8 with one scale each (symmetric): row r is `weight[r] * scale[r]` (in `dtype`, then
    times `multiplier` where the float embedding scaled its rows so: Gemma's). `tied`: an LM head tied to
    the embedding holds the same int8 values and scales (convert.quantize_float)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        tied: bool = False,
        multiplier: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.tied = tied
        self.register_buffer("qweight", weight.to(torch.int8), persistent=False)
        self.register_buffer("scale", scale.reshape(-1).float(), persistent=False)
        self.register_buffer("multiplier", multiplier, persistent=False)
        # Set by `take_rows_from`: the rows are read from a tied head's packed weight.
        self.ops: Int8Ops | None = None
        self.packed: Any = None

    @property
    def weight_bytes(self) -> int:
        return 0 if self.qweight is None else self.num_embeddings * self.embedding_dim

    def keep(self, rows: tuple[int, int]) -> None:
        """Keep rows [start, end) of the vocabulary: a tensor-parallel rank's part (sharded.py)."""
        self.qweight = self.qweight[rows[0] : rows[1]].clone()
        self.scale = self.scale[rows[0] : rows[1]].clone()
        self.num_embeddings = self.qweight.shape[0]

    def take_rows_from(self, head: Int8Linear) -> None:
        """From now on the rows are gathered from the tied `head`'s packed weight (its device's layout
        must allow it, Int8Ops.gathers_rows), and this copy of them is dropped."""
        self.ops, self.packed = head.ops, head.packed
        self.qweight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            int8 = nn.functional.embedding(ids, self.qweight)
        else:
            int8 = self.ops.rows(self.packed, ids)  # type: ignore[union-attr]
        rows = (int8.float() * self.scale[ids].unsqueeze(-1)).to(self.dtype)
        return rows if self.multiplier is None else rows * self.multiplier
