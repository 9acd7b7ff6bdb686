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

from workers.models.quant.kernels import Int8Ops

DYNAMIC, STATIC, WEIGHT_ONLY = "W8A8_DYNAMIC", "W8A8", "W8A16"


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
        # Set by `bind` for siblings that read one input in turn (kernels.Int8Ops.per_token).
        self.shares_input = False  # the next layer reads this one's input
        self.reads_shared = False  # this layer reads the previous one's

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}"

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features

    def bind(self, ops: Int8Ops) -> None:
        """Pack the weight for `ops`' GEMM; the int8 tensor is dropped where the packed copy replaces it."""
        self.packed = ops.pack(self.qweight)
        self.ops = ops
        if self.packed is not self.qweight:
            self.qweight = None

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
        if self.scheme == DYNAMIC:
            y = self.ops.dynamic(rows, self, key=x)
        elif self.scheme == STATIC:
            y = self.ops.static(rows, self)
        else:
            y = self.ops.weight_only_product(rows, self)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Rows of int8 with one scale each (symmetric): row r is `weight[r] * scale[r]`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.register_buffer("qweight", weight.to(torch.int8), persistent=False)
        self.register_buffer("scale", scale.reshape(-1).float(), persistent=False)

    @property
    def weight_bytes(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(ids, self.qweight).float() * self.scale[ids].unsqueeze(-1)
        return rows.to(self.dtype)
