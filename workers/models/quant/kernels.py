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
  under torch's dynamic quantized Linear) with a prepacked weight. It takes float rows and quantizes
  them with scale 1 and zero point 128 (the uint8 it multiplies is x_q + 128; its row offsets take the
  128 back out), clamped to uint8's range. It adds the zero point before it rounds, in float32, which
  moves values within 1e-5 of a half, so the rows are rounded first (`torch.round`): an integer plus
  128 is exact. With VNNI (`vpdpbusd`) the uint8 × int8 products accumulate exactly in int32. Without
  it (plain AVX2, AVX-512), fbgemm multiplies with `vpmaddubsw`, whose pairwise int16 sums saturate for
  8-bit activations (that is why torch's dynamic Linear quantizes activations to 7 bits); there each
  int8 row is split exactly into x_q = 2h + l (h in [-64, 63], l in {0, 1}), both within 7 bits, and
  the two halves go through one GEMM as one batch of 2M rows (the weights are read once); 2·acc(h) +
  acc(l) is the exact int32 accumulator. Which of the two the CPU needs is measured at start-up on the
  worst case (`exact_8bit`), not read from its flags. The packed weight is a TorchScript object, which
  torch.compile cannot take as an argument: each is held in a table under a number (`PackedWeight`),
  and a compiled forward calls fbgemm through `tokenline::fbgemm_int8_mm` (the rows, the weight's
  number), an op opaque to the compiler as the attention op is. No weight-only int8 kernel for float32
  activations is faster than float32 on a CPU, so W8A16 is dequantized at load (logged).
- CUDA: `torch._int_mm` (cuBLASLt int8 GEMM, int32 out; more than 16 rows, so 17 zero rows are
  appended; K and N multiples of 8).
- NPU: torch_npu's `npu_dynamic_quant` + `npu_quant_matmul` (dynamic), `npu_quantize` +
  `npu_quant_matmul` with `deq_scale` and `quant_bias` (static), `npu_weight_quant_batchmatmul` (W8A16),
  in float16 and bfloat16 models (the operators' types; a float32 model's layers are dequantized,
  logged); a weight with more than 65,535 outputs is held and multiplied in column pieces.
  tests/test_npu_int8.py runs them through stand-ins written from their documents.
"""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workers.models.quant.linear import Int8Linear, Siblings

logger = logging.getLogger(__name__)

# A row of zeros has no scale: its quantized values are 0 whatever the scale, so any tiny one serves.
MIN_ABS_MAX = 1e-12
CUDA_MIN_ROWS = 17  # torch._int_mm takes more than 16 rows
NPU_MAX_DIM = 65535  # the most inputs and outputs torch_npu's quantized matmuls take
DYNAMIC, STATIC, WEIGHT_ONLY = "W8A8_DYNAMIC", "W8A8", "W8A16"  # the schemes, as msModelSlim names them


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic symmetric int8 per row: each row's scale [M, 1], max |x| / 127. (`abs` and `amax`, not
    the infinity norm: on a CPU the norm reduces row by row, 5× their time at 8 rows, 13× at 32.)"""
    return torch.amax(torch.abs(x), -1, True).clamp_(min=MIN_ABS_MAX).div_(127)


def to_int8(values: torch.Tensor) -> torch.Tensor:
    """Rows already divided by their scale, rounded (half to even) into int8's range, as float32."""
    return torch.round(values).clamp_(-128, 127)


class Int8Ops:
    """The products of a device whose int8 GEMM is `int_mm(quantize(values), packed, rows)`: `values`
    are float32 rows already divided by their scale (and offset), which `quantize` rounds into int8
    (half to even, clamped to [-128, 127], as `to_int8`) in the form the GEMM takes; `int_mm` returns
    the exact int32 accumulators of the `rows` rows as float32.

    A layer here is an Int8Linear or the Siblings of several (linear.py): what the products read of it
    is `packed`, `weight_scale`, `bias` and, for W8A8, its input's scale and offset."""

    name = "generic"
    weight_only = False  # whether W8A16 runs as int8 (else its weights are dequantized at load)
    # Whether `rows` can read a packed weight's rows: a tied LM head's packed weight then serves the
    # input embedding too, one int8 copy for both (linear.Int8Embedding.take_rows_from).
    gathers_rows = False
    dtypes: tuple[torch.dtype, ...] | None = None  # the model dtypes its products take (None: any)

    def pack(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
        """The weight [N, K] laid out for the GEMM; `scale` [N], a dynamic layer's weight scales, for
        a GEMM that can apply them itself (`applies_scales`)."""
        raise NotImplementedError

    def applies_scales(self, packed: Any) -> bool:
        """Whether `int_mm` of `packed` returns the accumulators already times the weight scales."""
        return False

    def quantize(self, values: torch.Tensor) -> Any:
        raise NotImplementedError

    def int_mm(self, quantized: Any, packed: Any, rows: int) -> torch.Tensor:
        raise NotImplementedError

    def dynamic_quantize(self, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
        x = x.float()
        scale = row_scales(x)
        return self.quantize(x / scale), scale

    def dynamic(self, x: torch.Tensor, layer: Int8Linear | Siblings) -> torch.Tensor:
        """(x_q · Wᵀ) s_w s_x + bias, in that order: the weight scales first, which a GEMM may apply
        itself, then the rows'."""
        quantized, scale = self.dynamic_quantize(x)
        y = self.int_mm(quantized, layer.packed, len(x))
        if not self.applies_scales(layer.packed):
            y.mul_(layer.weight_scale)
        y.mul_(scale)
        if layer.bias is not None:
            y += layer.bias
        return y.to(x.dtype)

    def static(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        quantized = self.quantize(x.float() * layer.input_reciprocal + layer.input_offset)
        y = self.int_mm(quantized, layer.packed, len(x)).add_(layer.quant_bias).mul_(layer.deq_scale)
        return y.to(x.dtype)

    def weight_only_product(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, packed: Any, ids: torch.Tensor) -> torch.Tensor:
        """The int8 rows `ids` of the weight [N, K] that `pack` laid out as `packed`: [*ids.shape, K]."""
        raise NotImplementedError

    def prepare(self, layer: Int8Linear, dtype: torch.dtype) -> None:
        """Make once, at bind, what the products take of `layer` in a `dtype` model beyond what it
        holds (`layer.constants`): none here."""


class PackedWeight:
    """fbgemm's prepacked int8 weight [N, K], known to `tokenline::fbgemm_int8_mm` by its number while
    the layer that holds it lives; `scaled`: packed with the layer's weight scales, which fbgemm's
    products then apply (else with ones: the products are the int32 sums)."""

    __slots__ = ("__weakref__", "number", "out_features", "scaled", "weight")
    _numbers = itertools.count()

    def __init__(self, weight: Any, out_features: int, scaled: bool) -> None:
        self.weight = weight
        self.out_features = out_features
        self.scaled = scaled
        self.number = next(self._numbers)
        _PACKED[self.number] = self


_PACKED: weakref.WeakValueDictionary[int, PackedWeight] = weakref.WeakValueDictionary()


def _fbgemm_product(values: torch.Tensor, zero_point: int, packed: Any) -> torch.Tensor:
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(values, 1.0, zero_point, packed)


# Defined with torch.library's low-level API, as the attention op is (a fraction of the per-call cost of
# `torch.library.custom_op`); only a compiled forward calls it.
torch.library.define("tokenline::fbgemm_int8_mm", "(Tensor values, int weight, int zero_point) -> Tensor")


@torch.library.impl("tokenline::fbgemm_int8_mm", "CPU")
def fbgemm_int8_mm(values: torch.Tensor, weight: int, zero_point: int) -> torch.Tensor:
    """fbgemm's product of float rows already rounded to integers with the weight numbered `weight`:
    the int32 sums as float32 [rows, N] (CpuInt8.int_mm)."""
    return _fbgemm_product(values, zero_point, _PACKED[weight].weight)


@torch.library.register_fake("tokenline::fbgemm_int8_mm")
def _(values: torch.Tensor, weight: int, zero_point: int) -> torch.Tensor:
    return values.new_empty(values.shape[0], _PACKED[weight].out_features)


class CpuInt8(Int8Ops):
    def __init__(self) -> None:
        super().__init__()
        torch.backends.quantized.engine = "fbgemm"
        self.exact_8bit = self._exact_8bit()
        self.name = "fbgemm" if self.exact_8bit else "fbgemm (7-bit halves: this CPU has no VNNI)"

    def pack(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> PackedWeight:
        """With 8-bit rows, a dynamic layer's weight scales go into the packed weight: fbgemm's output
        stage multiplies each int32 sum by its column's scale in float32 (and by the input scale 1,
        exactly), the value a multiplication of its own would give, one operation fewer per product.
        The 7-bit halves need the plain sums, to add them up before scaling."""
        rows = weight.shape[0]
        scaled = scale is not None and self.exact_8bit
        scales = scale.double() if scaled else torch.ones(rows, dtype=torch.double)  # type: ignore[union-attr]
        with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors; fbgemm's prepack takes one
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch._make_per_channel_quantized_tensor(weight, scales, torch.zeros(rows, dtype=torch.long), 0)
        return PackedWeight(torch.ops.quantized.linear_prepack(quantized, None), rows, scaled)

    def applies_scales(self, packed: PackedWeight) -> bool:
        return packed.scaled

    @staticmethod
    def _gemm(values: torch.Tensor, zero_point: int, packed: PackedWeight) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.tokenline.fbgemm_int8_mm(values, packed.number, zero_point)
        return _fbgemm_product(values, zero_point, packed.weight)

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        """8-bit rows rounded (fbgemm clamps them to [-128, 127] itself), or without VNNI the rows
        split into two 7-bit halves stacked [2M, K]: x_q = 2h + l, h in [-64, 63], l in {0, 1}."""
        if self.exact_8bit:
            return torch.round(values)
        xq = to_int8(values)
        high = torch.floor(xq * 0.5)
        return torch.cat([high, torch.sub(xq, high, alpha=2)])

    def int_mm(self, quantized: torch.Tensor, packed: Any, rows: int) -> torch.Tensor:
        if self.exact_8bit:
            return self._gemm(quantized, 128, packed)
        acc = self._gemm(quantized, 64, packed)  # 7-bit values with zero point 64
        return torch.add(acc[rows:], acc[:rows], alpha=2)

    def _exact_8bit(self) -> bool:
        """Whether the 8-bit products are exact on this CPU: 127 · -128 in every pair, the sums that
        saturate a `vpmaddubsw` (int16) and fit a `vpdpbusd` (int32)."""
        weight = torch.full((8, 64), -128, dtype=torch.int8)
        values = torch.full((1, 64), 127.0)
        return bool((self._gemm(values, 128, self.pack(weight)) == 127 * -128 * 64).all())


class CudaInt8(Int8Ops):
    name = "torch._int_mm (cuBLASLt)"
    gathers_rows = True  # the packed weight is the int8 weight itself

    def pack(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
        if weight.shape[0] % 8 or weight.shape[1] % 8:
            raise ValueError(f"torch._int_mm needs dimensions that are multiples of 8, not {tuple(weight.shape)}")
        return weight.contiguous()

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        a = to_int8(values).to(torch.int8)
        # Always padded, never a branch on the row count: in the compiled decode step it is unbacked
        # (models/compile.py). A few more rows cost a decode's weight-bound product nothing.
        return torch.cat([a, a.new_zeros(CUDA_MIN_ROWS, a.shape[1])])

    def int_mm(self, quantized: torch.Tensor, packed: Any, rows: int) -> torch.Tensor:
        return torch._int_mm(quantized, packed.t())[:rows].float()

    def rows(self, packed: Any, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, packed)


class NpuInt8(Int8Ops):
    """torch_npu's quantized matmuls take the weight as [K, N] and apply the scales themselves, in a
    float16 or bfloat16 model (their documented types), with K and N up to NPU_MAX_DIM: a weight with
    more outputs (a large vocabulary's LM head) is held as column pieces [K, ≤ NPU_MAX_DIM], one product
    each (as vllm-ascend splits it)."""

    name = "torch_npu.npu_quant_matmul"
    weight_only = True
    gathers_rows = True
    dtypes = (torch.float16, torch.bfloat16)

    def __init__(self) -> None:
        super().__init__()
        import torch_npu

        self.npu = torch_npu

    def pack(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
        outputs, inputs = weight.shape
        if inputs > NPU_MAX_DIM:
            raise ValueError(f"torch_npu's quantized matmuls take up to {NPU_MAX_DIM} inputs, not {inputs}")
        if outputs <= NPU_MAX_DIM:
            return weight.t().contiguous()
        return [weight[start : start + NPU_MAX_DIM].t().contiguous() for start in range(0, outputs, NPU_MAX_DIM)]

    def rows(self, packed: Any, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(packed, list):
            return columns_as_rows(packed, ids)
        rows, start = None, 0
        for piece in packed:
            width = piece.shape[1]
            got = columns_as_rows(piece, (ids - start).clamp(0, width - 1))
            inside = ((ids >= start) & (ids < start + width)).unsqueeze(-1)
            rows, start = (got if rows is None else torch.where(inside, got, rows)), start + width
        return rows  # type: ignore[return-value]

    @staticmethod
    def _by_piece(packed: Any, product: Any, *columns: torch.Tensor | None) -> torch.Tensor:
        """`product(weight, *columns)` over the packed weight, piece by piece where it is in pieces
        (each with its slice of the per-output tensors `columns`), the outputs side by side."""
        if not isinstance(packed, list):
            return product(packed, *columns)
        outputs, start = [], 0
        for piece in packed:
            end = start + piece.shape[1]
            outputs.append(product(piece, *(None if c is None else c[start:end] for c in columns)))
            start = end
        return torch.cat(outputs, -1)

    def dynamic_quantize(self, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
        return self.npu.npu_dynamic_quant(x)

    def dynamic(self, x: torch.Tensor, layer: Int8Linear | Siblings) -> torch.Tensor:
        xq, scale = self.dynamic_quantize(x)

        def product(weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return self.npu.npu_quant_matmul(
                xq, weight, weight_scale, pertoken_scale=scale, bias=bias, output_dtype=x.dtype
            )

        return self._by_piece(layer.packed, product, layer.weight_scale, layer.bias)

    def prepare(self, layer: Int8Linear, dtype: torch.dtype) -> None:
        """The operators' forms of a layer's constants, made once (as vllm-ascend does after loading),
        not converted at every call: for W8A8 the input's scale and offset in the model's dtype, one per
        input, the int32 quant_bias and, for float16 output, deq_scale as npu_trans_quant_param's int64;
        for W8A16 the scale and offset in the model's dtype and the bias in float32 for bfloat16, float16
        for float16 (what npu_weight_quant_batchmatmul takes)."""
        if layer.scheme == STATIC:
            deq_scale = layer.deq_scale
            layer.constants = {
                "reciprocal": layer.input_reciprocal.expand(layer.in_features).to(dtype).contiguous(),
                "offset": layer.input_offset.expand(layer.in_features).to(dtype).contiguous(),
                "deq_scale": self.npu.npu_trans_quant_param(deq_scale) if dtype == torch.float16 else deq_scale,
                "quant_bias": layer.quant_bias.to(torch.int32),
            }
        elif layer.scheme == WEIGHT_ONLY:
            layer.constants = {
                "scale": layer.weight_scale.to(dtype),
                "offset": layer.weight_offset.to(dtype),
            }
            if layer.bias is not None:
                layer.constants["bias"] = layer.bias.to(torch.float16 if dtype == torch.float16 else torch.float32)

    def static(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        constants = layer.constants
        xq = self.npu.npu_quantize(x, constants["reciprocal"], constants["offset"], torch.qint8, -1, False)

        def product(weight: torch.Tensor, deq_scale: torch.Tensor, quant_bias: torch.Tensor) -> torch.Tensor:
            return self.npu.npu_quant_matmul(xq, weight, deq_scale, bias=quant_bias, output_dtype=x.dtype)

        return self._by_piece(layer.packed, product, constants["deq_scale"], constants["quant_bias"])

    def weight_only_product(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        constants = layer.constants

        def product(
            weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None
        ) -> torch.Tensor:
            return self.npu.npu_weight_quant_batchmatmul(x, weight, scale, antiquant_offset=offset, bias=bias)

        return self._by_piece(layer.packed, product, constants["scale"], constants["offset"], constants.get("bias"))


def columns_as_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a weight [N, K] held transposed [K, N]: its columns gathered (the only copy
    made is of the rows), as rows [*ids.shape, K]."""
    return packed.index_select(1, ids.reshape(-1)).t().reshape(*ids.shape, packed.shape[0])


def ops_for(device: torch.device) -> Int8Ops | None:
    """The device's int8 products, or None where it has no int8 path (weights are then dequantized)."""
    if device.type == "npu":
        return NpuInt8()
    if device.type == "cuda":
        return CudaInt8()
    if device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines:
        return CpuInt8()
    return None
