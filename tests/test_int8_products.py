"""The int8 products of the device the engine tests run on (the CPU, or the accelerator `make
device-check` names): each scheme's layer, bound as the loader binds it, equals the scheme's int8 math
computed exactly on the CPU; and fbgemm's products on the CPU are the exact int32 sums, on the path
start-up chose for this CPU and on the 7-bit halves a CPU without VNNI takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.decorators import mark_unbacked

from tests.engine_runs import COMPILES, DEVICE, POOL_GIB, build, payload, steps
from workers.engine.core import CacheConfig, EngineCore
from workers.models.loader import load_model
from workers.models.quant.convert import bind, join_siblings
from workers.models.quant.kernels import CpuInt8, CudaInt8, columns_as_rows, ops_for, to_int8
from workers.models.quant.linear import DYNAMIC, STATIC, WEIGHT_ONLY, Int8Linear, Siblings

# float32 on the CPU, float16 where an accelerator serves.
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.float16
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5} if torch.float32 == DTYPE else {"rtol": 2e-2, "atol": 2e-2}
OUT, IN = 96, 256  # multiples of 8 (cuBLASLt's int8 GEMM) and of 16 (the NPU's)


def layer_of(scheme: str, generator: torch.Generator) -> tuple[Int8Linear, dict[str, torch.Tensor]]:
    weight = torch.randint(-128, 128, (OUT, IN), generator=generator, dtype=torch.int8)
    values = {"weight": weight, "weight_scale": torch.rand(OUT, generator=generator) / 50 + 1e-3}
    if scheme in (DYNAMIC, WEIGHT_ONLY):
        values["bias"] = torch.randn(OUT, generator=generator)
    if scheme == WEIGHT_ONLY:
        values["weight_offset"] = torch.randint(-3, 4, (OUT,), generator=generator).float()
    if scheme == STATIC:
        values["input_scale"] = torch.tensor([0.02])
        values["input_offset"] = torch.tensor([3.0])
        values["quant_bias"] = torch.randint(-5000, 5000, (OUT,), generator=generator).float()
        values["deq_scale"] = values["input_scale"] * values["weight_scale"]
    return Int8Linear(scheme, **values), values


def exact(scheme: str, x: torch.Tensor, v: dict[str, torch.Tensor]) -> torch.Tensor:
    """The scheme's math (models/quant/kernels.py): activations quantized in float32, as the kernels
    do, and the products and scaling in float64, on the CPU."""
    x, w = x.float().cpu(), v["weight"].double()
    if scheme == WEIGHT_ONLY:
        dequantized = (w + v["weight_offset"].double()[:, None]) * v["weight_scale"].double()[:, None]
        return x.double() @ dequantized.t() + v["bias"].double()
    if scheme == DYNAMIC:
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        xq = to_int8(x / scale).double()
        return (xq @ w.t()) * scale.double() * v["weight_scale"].double() + v["bias"].double()
    xq = to_int8(x * (1 / v["input_scale"]) + v["input_offset"]).double()
    return (xq @ w.t() + v["quant_bias"].double()) * v["deq_scale"].double()


@pytest.mark.parametrize("scheme", [DYNAMIC, STATIC, WEIGHT_ONLY])
def test_each_schemes_layer_equals_its_int8_math_on_the_device(scheme: str) -> None:
    generator = torch.Generator().manual_seed(1)
    layer, values = layer_of(scheme, generator)
    model = nn.Sequential(layer).to(DEVICE)
    bind(model, DEVICE, DTYPE)
    x = torch.randn(5, IN, generator=generator) * 2
    x[1] = 0  # a row of zeros: no scale, products of 0
    with torch.inference_mode():
        got = model(x.to(DEVICE, DTYPE)).float().cpu()
    torch.testing.assert_close(got, exact(scheme, x.to(DTYPE), values).float(), **TOLERANCE)


def rows_to_round(generator: torch.Generator) -> torch.Tensor:
    """Rows as the products receive them: the worst case for 8-bit pairs (127 · -128 throughout),
    values a float ulp either side of a half, and values past int8's range (clamped)."""
    halves = torch.randint(-127, 127, (6, IN), generator=generator).float() + 0.5
    return torch.cat(
        [
            torch.full((1, IN), 127.0),
            halves,
            torch.nextafter(halves, torch.tensor(1e9)),
            torch.nextafter(halves, torch.tensor(-1e9)),
            torch.randn(4, IN, generator=generator) * 90,
        ]
    )


@pytest.mark.parametrize("mode", ["as this CPU runs them", "7-bit halves"])
def test_the_cpu_products_are_the_exact_int32_sums_of_the_rounded_rows(mode: str) -> None:
    """The rows are rounded half to even and clamped to int8, then multiplied exactly: on the path
    start-up chose for this CPU (8-bit rows where its products cannot saturate) and on the 7-bit halves
    a CPU without VNNI takes."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-128, 128, (OUT, IN), generator=generator, dtype=torch.int8)
    weight[:8] = -128
    ops = CpuInt8()
    if mode == "7-bit halves":
        ops.exact_8bit = False
    values = rows_to_round(generator)
    got = ops.int_mm(ops.quantize(values), ops.pack(weight), len(values))
    assert torch.equal(got.double(), to_int8(values).double() @ weight.double().t())


@pytest.mark.parametrize("mode", ["as this CPU runs them", "7-bit halves"])
def test_a_dynamic_layer_on_the_cpu_scales_its_sums_as_the_reference_does_to_the_bit(mode: str) -> None:
    """float32's ((x_q · Wᵀ) · s_w) · s_x + bias, to the bit, the order scripts/quantize.py's reference
    computes: with 8-bit rows fbgemm applies the weight scales it was packed with, on the 7-bit halves
    they are applied after the halves' sums are added."""
    generator = torch.Generator().manual_seed(6)
    layer, values = layer_of(DYNAMIC, generator)
    ops = CpuInt8()
    if mode == "7-bit halves":
        ops.exact_8bit = False
    bind(nn.Sequential(layer), torch.device("cpu"), torch.float32, ops)
    assert layer.packed.scaled is ops.exact_8bit
    x = torch.randn(9, IN, generator=generator) * 3
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    sums = to_int8(x / scale) @ values["weight"].float().t()  # exact: under 2**24
    expected = sums * values["weight_scale"] * scale + values["bias"]
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)


def test_a_packed_weight_is_known_to_the_compiled_op_while_its_layer_lives() -> None:
    """fbgemm's packed weights are held by number for `tokenline::fbgemm_int8_mm` only as long as a
    layer holds them: a worker that loads models again does not keep the old ones."""
    weight = torch.randint(-128, 128, (OUT, IN), generator=torch.Generator().manual_seed(5), dtype=torch.int8)
    packed = CpuInt8().pack(weight)
    values = to_int8(torch.randn(3, IN) * 40).clamp_(-64, 63)  # 7 bits: exact with or without VNNI
    got = torch.ops.tokenline.fbgemm_int8_mm(values, packed.number, 64)
    assert torch.equal(got.double(), values.double() @ weight.double().t())
    number = packed.number
    del packed
    with pytest.raises(KeyError):
        torch.ops.tokenline.fbgemm_int8_mm(values, number, 64)


class Attention(nn.Module):
    """Projections named as transformers names them, called in turn on one input (o_proj too, which is
    no sibling of theirs)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, layer_of(DYNAMIC, generator)[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) + self.k_proj(x) + self.v_proj(x) + self.o_proj(x)


def test_q_k_and_v_are_one_product_and_give_what_they_give_alone() -> None:
    """The siblings' weights are stacked into one product, computed once for their one input (the
    activations quantized once) and held only until the last sibling has taken its columns; each
    layer's output is what its own weight gives, exactly, also when it is called alone."""
    generator = torch.Generator().manual_seed(2)
    model = Attention(generator).to(DEVICE)
    layers = {name: getattr(model, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    alone = {
        name: Int8Linear(DYNAMIC, layer.qweight.clone(), layer.weight_scale.clone(), layer.bias.clone())
        for name, layer in layers.items()
    }
    bind(model, DEVICE, DTYPE)
    bind(nn.Sequential(*alone.values()).to(DEVICE), DEVICE, DTYPE)
    siblings = model.q_proj.siblings
    assert isinstance(siblings, Siblings) and siblings.out_features == 3 * OUT
    assert model.k_proj.siblings is siblings and model.v_proj.siblings is siblings
    assert [layers[n].columns for n in ("q_proj", "k_proj", "v_proj")] == [(0, OUT), (OUT, 2 * OUT), (2 * OUT, 3 * OUT)]
    assert model.o_proj.siblings is None and model.q_proj.qweight is None and model.q_proj.packed is None
    x = (torch.randn(3, IN, generator=generator) * 2).to(DEVICE, DTYPE)
    products: list[int] = []
    original = siblings.ops.dynamic
    siblings.ops.dynamic = lambda rows, layer: products.append(layer.out_features) or original(rows, layer)  # type: ignore[method-assign]
    with torch.inference_mode():
        together = model(x)
        assert products == [3 * OUT, OUT]  # q, k and v as one product; o_proj
        assert siblings.held is None  # nothing held between calls
        for name in ("k_proj", "q_proj"):  # alone, on another tensor: the product computed again
            torch.testing.assert_close(layers[name](x.clone()), alone[name](x), rtol=0, atol=0)
            assert siblings.held is not None  # held for the siblings that follow, on that tensor
        assert products == [3 * OUT, OUT, 3 * OUT, 3 * OUT]
        expected = sum(layer(x) for layer in alone.values())
    torch.testing.assert_close(together, expected, rtol=0, atol=0)


@pytest.mark.skipif(not COMPILES, reason="no Inductor code generator for the device (an NPU without triton-ascend)")
def test_int8_layers_run_inside_the_compiled_decode_step_with_the_eager_steps_tokens_and_logits(
    demo_model: Path, tmp_path: Path
) -> None:
    """compile: on with int8 weights: the products run inside the compiled forward (on the CPU
    fbgemm's, through `tokenline::fbgemm_int8_mm`, an op opaque to the compiler; its packed weights
    cannot be traced) and give the eager steps' tokens and logits, alone and at batch 3 (one past the
    bucket of 2)."""
    loaded = load_model(build("llama", tmp_path / "llama", demo_model, 16), DEVICE, quantization="int8")
    generator = torch.Generator().manual_seed(4)
    prompt = [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in (6, 13, 20)]
    arrivals = {0: [payload("alone", prompt[0])], 11: [payload(f"p{i}", p) for i, p in enumerate(prompt)]}
    results = {}
    for mode in ("off", "on"):
        engine = EngineCore.build(loaded, 256, 4, cache=CacheConfig(mem_gib=POOL_GIB, compile=mode))
        assert (engine.runner.graphs is not None) == (mode == "on")
        results[mode] = steps(engine, arrivals)
    (eager_ids, eager_logits), (ids, logits) = results["off"], results["on"]
    assert ids == eager_ids and len(logits) == len(eager_logits)
    for compiled, eager in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_the_cuda_products_trace_as_one_graph_with_q_k_and_v_as_one_product() -> None:
    """torch.compile (compile: auto on a GPU) takes CUDA's int8 layers whole, q, k and v's one product
    included: Dynamo traces them with fullgraph=True, and the traced forward equals the eager one (run
    here on the CPU, where torch._int_mm runs the same operator)."""
    generator = torch.Generator().manual_seed(3)
    model = Attention(generator)
    ops = CudaInt8()
    join_siblings(model, ops)
    model.o_proj.bind(ops, DTYPE)
    assert model.v_proj.siblings is not None
    x = torch.randn(5, IN, generator=generator)  # padded to torch._int_mm's 17 rows, as a decode batch is
    mark_unbacked(x, 0)  # the row count, as the compiled decode step leaves it (models/compile.py)
    with torch.inference_mode():
        eager = model(x)
        traced = torch.compile(model, fullgraph=True, dynamic=False, backend="eager")(x)
    assert torch.equal(traced, eager)


def test_a_tied_head_and_its_embedding_keep_one_int8_copy_where_the_products_can_read_it(
    demo_model: Path, tmp_path: Path
) -> None:
    """`quantization: int8` of a model whose LM head is its input embedding (Qwen3 here; Qwen2.5's small
    models, Llama 3.2 and Gemma too): one int8 tensor for both. Bound to products that can read a packed
    weight's rows (CUDA's, run here on the CPU, where torch._int_mm is the same operator), the embedding
    gathers the head's and keeps no copy: the weights are one [vocabulary, hidden] int8 copy smaller, and
    the logits are exactly those of the model bound to fbgemm, whose packed layout cannot be read back
    (it keeps both copies)."""
    from transformers import AutoModelForCausalLM

    from schemas.quantization import QuantSpec
    from workers.models.quant.convert import quantize_float, weight_bytes
    from workers.models.quant.linear import Int8Embedding

    path = build("qwen3", tmp_path / "qwen3", demo_model, 16)
    models = {}
    for name, ops in (("fbgemm", CpuInt8()), ("cuda", CudaInt8())):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        quantize_float(model, QuantSpec("load", DYNAMIC))
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(embedding, Int8Embedding) and embedding.tied and embedding.qweight is head.qweight
        bind(model, torch.device("cpu"), torch.float32, ops)
        models[name] = model.eval()
    fbgemm, cuda = (models[n].get_input_embeddings() for n in ("fbgemm", "cuda"))
    assert fbgemm.qweight is not None and fbgemm.weight_bytes == fbgemm.num_embeddings * fbgemm.embedding_dim
    assert cuda.qweight is None and cuda.weight_bytes == 0
    assert cuda.packed is models["cuda"].get_output_embeddings().packed
    one_copy = fbgemm.num_embeddings * fbgemm.embedding_dim
    assert weight_bytes(models["fbgemm"]) - weight_bytes(models["cuda"]) == one_copy
    ids = torch.tensor([[5, 17, 300, 4000, 17, 2]])
    with torch.inference_mode():
        assert torch.equal(cuda(ids), fbgemm(ids))
        # As the compiled decode step takes it on a GPU: one graph.
        assert torch.equal(torch.compile(cuda, fullgraph=True, backend="eager")(ids), fbgemm(ids))
        logits = {name: model(ids).logits for name, model in models.items()}
    assert torch.equal(logits["cuda"], logits["fbgemm"])


def test_the_npu_reads_a_tied_heads_rows_from_its_transposed_weight() -> None:
    """The NPU's products hold a weight [N, K] as [K, N]; a tied head's rows are its columns, gathered
    (kernels.columns_as_rows, what NpuInt8.rows returns), in the shape of the ids."""
    weight = torch.randint(-128, 128, (50, 24), generator=torch.Generator().manual_seed(6), dtype=torch.int8)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    rows = columns_as_rows(weight.t().contiguous(), ids)
    assert rows.shape == (2, 3, 24) and torch.equal(rows, weight[ids])


def test_a_tied_int8_model_on_the_device_keeps_one_copy_where_its_products_read_rows(
    demo_model: Path, tmp_path: Path
) -> None:
    """Loaded with `quantization: int8` on the engine tests' device: the embedding reads the tied
    head's packed weight where the device's products can (a GPU, an NPU) and keeps its own int8 rows
    where they cannot (fbgemm on a CPU); its rows are the same either way."""
    path = build("qwen3", tmp_path / "qwen3", demo_model, 16)
    loaded = load_model(path, DEVICE, quantization="int8")
    embedding = loaded.model.get_input_embeddings()
    assert (embedding.qweight is None) == ops_for(DEVICE).gathers_rows  # type: ignore[union-attr]
    reference = load_model(path, torch.device("cpu"), quantization="int8").model.get_input_embeddings()
    ids = torch.tensor([[5, 17, 300, 4000, 2]])
    with torch.inference_mode():
        assert torch.equal(embedding(ids.to(DEVICE)).float().cpu(), reference(ids).float())
