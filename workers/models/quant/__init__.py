"""Quantized weights served with int8 arithmetic: the checkpoint formats (checkpoint.py), the
`quantization: int8` setting (convert.py), the modules (linear.py) and each device's int8 products
(kernels.py). What a model directory ships is read by schemas/quantization.py."""

from __future__ import annotations

from workers.models.quant.checkpoint import load_quantized
from workers.models.quant.convert import bind, float_dtype, quantize_float, weight_bytes

__all__ = ["bind", "float_dtype", "load_quantized", "quantize_float", "weight_bytes"]
