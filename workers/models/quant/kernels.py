"""The int8 products, one class per device; every device-specific operator of quantized serving is here.

Three products, as the checkpoint formats define them (x: a row of activations, W: int8 weights [N, K],
s_w: per-channel weight scales):

- dynamic (W8A8_DYNAMIC, compressed-tensors int8, `quantization: int8`): each row is quantized on its
  own, s_x = max|x| / 127, x_q = clamp(round(x / s_x), -128, 127); y = (x_q · Wᵀ) s_x s_w + bias.
- static (msModelSlim W8A8): one scale and offset for the tensor, x_q = clamp(round(x · (1 / s_in) +
  o_in), -128, 127); y = (x_q · Wᵀ + quant_bias) · deq_scale (quant_bias holds the float bias and the
  offset's correction, deq_scale = s_in s_w).
- weight-only (W8A16): y = x · ((W + weight_offset) s_w)ᵀ + bias.

Devices:

- CPU: fbgemm's int8 GEMM (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`, the kernel
  under torch's dynamic quantized Linear) with a prepacked weight. Without VNNI (AVX2), fbgemm multiplies
  uint8 by int8 with `vpmaddubsw`, whose pairwise int16 sums saturate for 8-bit activations (that is why
  torch's dynamic Linear quantizes activations to 7 bits). Each int8 row is therefore split exactly into
  x_q = 2h + l (h in [-64, 63], l in {0, 1}), both within 7 bits, and the two halves go through one
  GEMM as one batch of 2M rows (the weights are read once); 2·acc(h) + acc(l) is the exact int32
  accumulator. No weight-only int8 kernel for float32 activations is faster than float32 on this CPU,
  so W8A16 is dequantized at load (logged).
- CUDA: `torch._int_mm` (cuBLASLt int8 GEMM, int32 out; rows padded to 17, K and N multiples of 8).
- NPU: torch_npu's `npu_dynamic_quant` + `npu_quant_matmul` (dynamic), `npu_quantize` +
  `npu_quant_matmul` with `deq_scale` and `quant_bias` (static), `npu_weight_quant_batchmatmul` (W8A16).
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workers.models.quant.linear import Int8Linear

logger = logging.getLogger(__name__)

# A row of zeros has no scale: its quantized values are 0 whatever the scale, so any tiny one serves.
MIN_ABS_MAX = 1e-12
CUDA_MIN_ROWS = 17  # torch._int_mm takes more than 16 rows


def per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row: the int8 values (as float32) and each row's scale [M, 1]."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=MIN_ABS_MAX) / 127
    return torch.round(x / scale).clamp_(-128, 127), scale


def per_tensor(x: torch.Tensor, reciprocal: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Static int8 with msModelSlim's input scale (as its reciprocal, like npu_quantize) and offset."""
    return torch.round(x.float() * reciprocal + offset).clamp_(-128, 127)


class Int8Ops:
    """The products of a device with an int8 GEMM `int_mm` (exact int32 accumulators, as float32)."""

    name = "generic"
    weight_only = False  # whether W8A16 runs as int8 (else its weights are dequantized at load)

    def pack(self, weight: torch.Tensor) -> Any:
        raise NotImplementedError

    def int_mm(self, xq: torch.Tensor, packed: Any) -> torch.Tensor:
        raise NotImplementedError

    def dynamic(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        xq, scale = per_token(x)
        y = self.int_mm(xq, layer.packed).mul_(scale).mul_(layer.weight_scale)
        if layer.bias is not None:
            y += layer.bias
        return y.to(x.dtype)

    def static(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        xq = per_tensor(x, layer.input_reciprocal, layer.input_offset)
        y = self.int_mm(xq, layer.packed).add_(layer.quant_bias).mul_(layer.deq_scale)
        return y.to(x.dtype)

    def weight_only_product(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        raise NotImplementedError


class CpuInt8(Int8Ops):
    name = "fbgemm"

    def __init__(self) -> None:
        torch.backends.quantized.engine = "fbgemm"

    def pack(self, weight: torch.Tensor) -> Any:
        rows = weight.shape[0]
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; fbgemm's prepack takes one
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch._make_per_channel_quantized_tensor(
                weight, torch.ones(rows, dtype=torch.double), torch.zeros(rows, dtype=torch.long), 0
            )
        return torch.ops.quantized.linear_prepack(quantized, None)

    def int_mm(self, xq: torch.Tensor, packed: Any) -> torch.Tensor:
        rows = xq.shape[0]
        high = torch.floor(xq * 0.5)
        halves = torch.cat([high, xq - 2 * high])  # [2M, K], all in [-64, 63]: 7-bit with zero point 64
        acc = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(halves, 1.0, 64, packed)
        return torch.add(acc[rows:], acc[:rows], alpha=2)


class CudaInt8(Int8Ops):
    name = "torch._int_mm (cuBLASLt)"

    def pack(self, weight: torch.Tensor) -> Any:
        if weight.shape[0] % 8 or weight.shape[1] % 8:
            raise ValueError(f"torch._int_mm needs dimensions that are multiples of 8, not {tuple(weight.shape)}")
        return weight.contiguous()

    def int_mm(self, xq: torch.Tensor, packed: Any) -> torch.Tensor:
        rows = xq.shape[0]
        a = xq.to(torch.int8)
        if rows < CUDA_MIN_ROWS:
            a = torch.cat([a, a.new_zeros(CUDA_MIN_ROWS - rows, a.shape[1])])
        return torch._int_mm(a, packed.t())[:rows].float()


class NpuInt8(Int8Ops):
    """torch_npu's quantized matmuls take the weight as [K, N] and apply the scales themselves."""

    name = "torch_npu.npu_quant_matmul"
    weight_only = True

    def __init__(self) -> None:
        import torch_npu

        self.npu = torch_npu

    def pack(self, weight: torch.Tensor) -> Any:
        return weight.t().contiguous()

    def dynamic(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        xq, scale = self.npu.npu_dynamic_quant(x)
        return self.npu.npu_quant_matmul(
            xq, layer.packed, layer.weight_scale, pertoken_scale=scale, bias=layer.bias, output_dtype=x.dtype
        )

    def static(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        reciprocal = layer.input_reciprocal.expand(x.shape[-1]).to(x.dtype)
        offset = layer.input_offset.expand(x.shape[-1]).to(x.dtype)
        xq = self.npu.npu_quantize(x, reciprocal, offset, torch.qint8, -1, False)
        deq_scale = layer.deq_scale
        if x.dtype == torch.float16:  # float16 output takes the scale as int64 (npu_trans_quant_param)
            deq_scale = self.npu.npu_trans_quant_param(deq_scale)
        return self.npu.npu_quant_matmul(
            xq, layer.packed, deq_scale, bias=layer.quant_bias.to(torch.int32), output_dtype=x.dtype
        )

    def weight_only_product(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        return self.npu.npu_weight_quant_batchmatmul(
            x,
            layer.packed,
            layer.weight_scale.to(x.dtype),
            antiquant_offset=layer.weight_offset.to(x.dtype),
            bias=layer.bias,
        )


def ops_for(device: torch.device) -> Int8Ops | None:
    """The device's int8 products, or None where it has no int8 path (weights are then dequantized)."""
    if device.type == "npu":
        return NpuInt8()
    if device.type == "cuda":
        return CudaInt8()
    if device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines:
        return CpuInt8()
    return None
