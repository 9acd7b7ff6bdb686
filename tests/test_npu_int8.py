"""The NPU's int8 products (quant/kernels.py NpuInt8) on the CPU, through stand-ins for torch_npu's int8
operators written from their documents, with each operator's type rules asserted
(tests/fake_kernels.py): a pure seam that proves NpuInt8 calls the operators as documented (types,
shapes, layouts) and computes each scheme's math, in the two model dtypes the operators take. `make
device-check` runs the real operators on an NPU (tests/test_int8_products.py)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch import nn

from tests import fake_kernels
from tests.test_int8_products import IN, OUT, exact, layer_of
from workers.models.quant import kernels
from workers.models.quant.convert import bind
from workers.models.quant.linear import DYNAMIC, STATIC, WEIGHT_ONLY, Int8Linear, Siblings

CPU = torch.device("cpu")


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> kernels.NpuInt8:
    monkeypatch.setitem(sys.modules, "torch_npu", fake_kernels.torch_npu())
    return kernels.NpuInt8()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", [DYNAMIC, STATIC, WEIGHT_ONLY])
def test_each_schemes_npu_layer_computes_its_int8_math(npu: kernels.NpuInt8, scheme: str, dtype: torch.dtype) -> None:
    """Each scheme's layer, bound as the loader binds it in a bfloat16 or float16 model, calls the
    operators with the types and shapes their documents allow (else the stand-ins fail), with its
    constants converted once at bind, and gives the scheme's math (W8A16's offset added, as the
    operator adds it: checkpoint.py negates msModelSlim's)."""
    generator = torch.Generator().manual_seed(11)
    layer, values = layer_of(scheme, generator)
    model = nn.Sequential(layer)
    assert bind(model, CPU, dtype, npu) == npu.name
    assert model[0] is layer and layer.packed.shape == (IN, OUT)  # [K, N]
    x = (torch.randn(5, IN, generator=generator) * 2).to(dtype)
    npu.npu.npu_trans_quant_param = None  # made once, at bind (W8A8 in float16): never again per call
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), exact(scheme, x, values), rtol=2e-2, atol=2e-2)


def test_an_npu_weight_with_more_outputs_than_the_operators_take_runs_in_pieces(
    npu: kernels.NpuInt8, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operators take at most 65,535 outputs (a 128,256- or 151,936-token LM head has more): such a
    weight is held as column pieces, one product each, and gives what the whole weight gives; its rows,
    for a tied embedding, are read across the pieces. A weight with more inputs than the operators take
    is dequantized (logged by bind). Here the limit is lowered to 40."""
    generator = torch.Generator().manual_seed(12)
    for scheme in (DYNAMIC, STATIC, WEIGHT_ONLY):
        _, values = layer_of(scheme, generator)
        narrow = {k: v[:, :32] if k == "weight" else v for k, v in values.items()}  # 32 inputs, 96 outputs
        whole, split = Int8Linear(scheme, **narrow), Int8Linear(scheme, **narrow)
        whole.bind(npu, torch.bfloat16)
        monkeypatch.setattr(kernels, "NPU_MAX_DIM", 40)
        split.bind(npu, torch.bfloat16)
        monkeypatch.setattr(kernels, "NPU_MAX_DIM", 65535)
        assert [piece.shape for piece in split.packed] == [(32, 40), (32, 40), (32, 16)]
        x = torch.randn(3, 32, generator=generator).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(split(x), whole(x)), scheme
    ids = torch.tensor([[0, 39, 40, 95], [81, 7, 80, 41]])
    assert torch.equal(npu.rows(split.packed, ids), narrow["weight"][ids])
    monkeypatch.setattr(kernels, "NPU_MAX_DIM", 40)
    wide = nn.Sequential(layer_of(DYNAMIC, generator)[0])  # 256 inputs
    bind(wide, CPU, torch.bfloat16, npu)
    assert type(wide[0]) is nn.Linear


def test_q_k_and_v_on_the_npu_are_one_product_of_their_stacked_weights(npu: kernels.NpuInt8) -> None:
    """The siblings' stacked weight is packed [K, 3N] for npu_quant_matmul, and each layer's output is
    the one it gives alone."""
    generator = torch.Generator().manual_seed(13)
    names = ("q_proj", "k_proj", "v_proj")
    model = nn.Module()
    for name in names:
        setattr(model, name, layer_of(DYNAMIC, generator)[0])
    alone = {
        n: Int8Linear(DYNAMIC, m.qweight.clone(), m.weight_scale.clone(), m.bias.clone())
        for n, m in model.named_children()
    }
    bind(model, CPU, torch.bfloat16, npu)
    bind(nn.Sequential(*alone.values()), CPU, torch.bfloat16, npu)
    siblings = model.q_proj.siblings
    assert isinstance(siblings, Siblings) and siblings.packed.shape == (IN, 3 * OUT)
    x = torch.randn(4, IN, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        for name in names:
            assert torch.equal(getattr(model, name)(x), alone[name](x))


def test_a_float32_model_on_the_npu_is_dequantized_and_says_why(
    npu: kernels.NpuInt8, caplog: pytest.LogCaptureFixture
) -> None:
    """torch_npu's int8 operators take float16 and bfloat16 activations only: a float32 model's int8
    layers are dequantized at load, and the log says so."""
    model = nn.Sequential(layer_of(DYNAMIC, torch.Generator().manual_seed(14))[0])
    with caplog.at_level(logging.WARNING):
        assert bind(model, CPU, torch.float32, npu) == "dequantized at load"
    assert type(model[0]) is nn.Linear and model[0].weight.dtype == torch.float32
    assert "torch_npu.npu_quant_matmul takes torch.float16 or torch.bfloat16 models, not torch.float32" in caplog.text
