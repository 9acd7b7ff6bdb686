"""The attention backends behind one interface (workers/models/attention/): each one the engine can be
given serves every architecture it supports with transformers' own greedy output, prompts spanning
several blocks, chunked, joining a running batch. The portable and flex backends run as they are; the NPU and
FlashInfer backends run their own metadata and calls through CPU stand-ins of their kernels
(tests/fake_kernels.py), which check that the operators are called as documented."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import fake_kernels
from tests.engine_runs import NEW_TOKENS, build, payload, serve
from workers.engine.core import CacheConfig, EngineCore
from workers.models.attention import select_backend
from workers.models.attention.flex import FlexBackend
from workers.models.attention.portable import PortableBackend
from workers.models.loader import load_model
from workers.models.step import StepBatch

PROMPT_LENGTHS = (5, 140, 300)  # past two 128-token blocks
SUPPORTED = {
    "portable": ("llama", "qwen2", "mistral", "gemma2", "phi3", "deepseek_v3"),
    "flex": ("llama", "qwen2", "mistral", "gemma2", "phi3", "deepseek_v3"),  # keys and values of 16 and 8 (MLA)
    "npu": ("llama", "qwen2", "mistral", "phi3"),  # no soft-capping in its kernels (Gemma 2)
    "flashinfer": ("llama", "qwen2", "mistral", "gemma2", "phi3"),
}


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", fake_kernels.torch_npu())
    monkeypatch.setitem(sys.modules, "flashinfer", fake_kernels.flashinfer())


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 4000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize(("backend", "architecture"), [(b, a) for b, archs in SUPPORTED.items() for a in archs])
def test_each_backend_gives_generates_greedy_output(
    backend: str, architecture: str, kernels: None, demo_model: Path, tmp_path: Path
) -> None:
    loaded = load_model(build(architecture, tmp_path / architecture, demo_model), torch.device("cpu"))
    expected = {}
    for i, prompt in enumerate(prompts()):
        out = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        expected[f"p{i}"] = out[0, len(prompt) :].tolist()
    cache = CacheConfig(block_size=16, max_prefill_tokens=64, attention=backend)
    engine = EngineCore.build(loaded, 512, 4, cache=cache)
    assert engine.runner.backend.name == backend
    runs = [payload(f"p{i}", p) for i, p in enumerate(prompts())]
    assert serve(engine, {0: runs[:1], 2: runs[1:2], 5: runs[2:]}) == expected


def test_the_npu_backend_takes_128_token_blocks_and_keeps_sliding_layers_in_them(
    kernels: None, demo_model: Path, tmp_path: Path
) -> None:
    loaded = load_model(build("mistral", tmp_path / "mistral", demo_model), torch.device("cpu"))
    engine = EngineCore.build(loaded, 512, 4, cache=CacheConfig(block_size=16, attention="npu"))
    assert engine.runner.kv.block_size == 128 and engine.runner.layout.rings == 0
    assert engine.kv.prefix_caching  # blocks, not rings: a prefix is kept whole


def test_auto_picks_the_devices_backend_and_a_model_the_kernels_cannot_serve_is_refused() -> None:
    assert select_backend(torch.device("cpu")).name == "portable"
    with pytest.raises(ValueError, match="attentionBackend npu: the model's logit soft-capping"):
        select_backend(torch.device("cpu"), "npu", softcap=True)
    with pytest.raises(ValueError, match="attentionBackend 'tpu'"):
        select_backend(torch.device("cpu"), "tpu")


def test_an_npu_takes_its_fused_attention_only_for_the_models_it_takes(caplog: pytest.LogCaptureFixture) -> None:
    """npu_fused_infer_attention_score (TND) takes float16 and bfloat16 heads of 64, 128 or 192
    dimensions: Gemma 3's 256, Phi-3-mini's 96 or a float32 checkpoint get the portable backend
    rather than the kernel's error at their first prefill (an NPU is not needed to choose)."""
    npu = types.SimpleNamespace(type="npu")  # torch names no such device without torch_npu
    assert select_backend(npu, head_dim=128, dtype=torch.bfloat16).name == "npu"
    assert select_backend(npu, head_dim=64, dtype=torch.float16).name == "npu"
    assert select_backend(npu, head_dim=256, dtype=torch.bfloat16).name == "portable"
    assert select_backend(npu, head_dim=96, dtype=torch.bfloat16).name == "portable"
    assert select_backend(npu, head_dim=128, dtype=torch.float32).name == "portable"
    with caplog.at_level(logging.WARNING, logger="workers.models.attention"):
        assert select_backend(npu, "npu", head_dim=256, dtype=torch.bfloat16).name == "npu"
    assert (
        "attentionBackend npu: the NPU's fused attention kernels take heads of 64, 128 or 192 dimensions, not 256"
        in (caplog.text)
    )


def test_a_gpu_without_flashinfer_takes_flex_where_its_kernels_take_the_models_heads() -> None:
    """flex_attention's GPU kernels take heads of 16 dimensions and up (a GPU is not needed to choose)."""
    assert importlib.util.find_spec("flashinfer") is None
    gpu = torch.device("cuda")
    assert select_backend(gpu, head_dim=16).name == "flex"
    assert select_backend(gpu, head_dim=8).name == "portable"
    with pytest.raises(
        ValueError, match="flex_attention's GPU kernels take heads of 16 dimensions and up; the model's have 8"
    ):
        select_backend(gpu, "flex", head_dim=8)
    assert select_backend(torch.device("cpu"), "flex", head_dim=8).name == "flex"


def test_the_portable_backend_reads_a_lone_decodes_run_of_blocks_in_place_with_the_gathered_result() -> None:
    """A decoding sequence alone in its step whose blocks follow one another in the pool is attended
    over the pool itself, not over a gathered copy, and gets what the same context in scattered
    blocks gets."""
    heads, kv_heads, dim, block, context = 4, 2, 8, 4, 10
    generator = torch.Generator().manual_seed(6)
    keys, values = (torch.randn(context, kv_heads, dim, generator=generator) for _ in range(2))
    query = torch.randn(1, heads, dim, generator=generator)

    def decode(blocks: list[int]) -> tuple[torch.Tensor, PortableBackend, object]:
        pool = SimpleNamespace(
            keys=[torch.zeros(16 * block, kv_heads, dim)],
            values=[torch.zeros(16 * block, kv_heads, dim)],
            windows=(0,),
            block_size=block,
            ring_tokens=0,
        )
        slots = [blocks[p // block] * block + p % block for p in range(context - 1)]
        pool.keys[0][slots], pool.values[0][slots] = keys[:-1], values[:-1]
        batch = StepBatch()
        batch.add([7], context - 1, context - 1, blocks, -1, True)
        backend = PortableBackend()
        meta = backend.load(backend.prepare(batch, pool), torch.device("cpu"))
        out = torch.empty(1, heads, dim)
        backend.forward(pool, 0, query, keys[-1:], values[-1:], out, meta, 0, dim**-0.5, 0.0)
        return out, backend, meta.groups[0]

    in_run, backend, group = decode([3, 4, 5])
    assert (group.span, backend.scratch) == (12, {})  # nothing gathered
    scattered, backend, group = decode([5, 0, 3])
    assert group.span is None and set(backend.scratch) == {"keys", "values"}
    assert torch.equal(in_run, scattered)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=dim**-0.5, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(in_run, expected)


@dataclass
class Decodes:
    """Two rows decoding over scattered 128-token blocks of a one-layer pool (tables [5, 0, 3] and
    [2, 6]), their queries and the keys and values the step writes."""

    pool: SimpleNamespace
    query: torch.Tensor
    new_keys: torch.Tensor
    new_values: torch.Tensor
    batch: StepBatch
    contexts: tuple[int, int]
    tables: tuple[list[int], list[int]] = ([5, 0, 3], [2, 6])
    block: int = 128

    @classmethod
    def of(cls, heads: int, kv_heads: int, contexts: tuple[int, int], seed: int, dim: int = 16) -> Decodes:
        generator = torch.Generator().manual_seed(seed)
        pool = SimpleNamespace(
            keys=[torch.randn(8 * cls.block, kv_heads, dim, generator=generator)],
            values=[torch.randn(8 * cls.block, kv_heads, dim, generator=generator)],
            windows=(0,),
            block_size=cls.block,
            ring_tokens=0,
        )
        query = torch.randn(2, heads, dim, generator=generator)
        new_keys, new_values = (torch.randn(2, kv_heads, dim, generator=generator) for _ in range(2))
        batch = StepBatch()
        for context, blocks in zip(contexts, cls.tables, strict=True):
            batch.add([7], context - 1, context - 1, blocks, -1, True)
        return cls(pool, query, new_keys, new_values, batch, contexts)

    def attend(self, backend: FlexBackend, window: int, query: torch.Tensor | None = None) -> torch.Tensor:
        meta = backend.load(backend.prepare(self.batch, self.pool), torch.device("cpu"))
        out = torch.empty_like(self.query)
        scale = self.query.shape[-1] ** -0.5
        query = self.query if query is None else query
        backend.forward(self.pool, 0, query, self.new_keys, self.new_values, out, meta, window, scale, 0.0)
        return out

    def expected(self, row: int, window: int) -> torch.Tensor:
        """SDPA of the row's query over its context (its last `window` keys), the step's keys written."""
        size = self.block
        slots = [self.tables[row][p // size] * size + p % size for p in range(self.contexts[row])]
        keep = slots[-window:] if window else slots
        k, v = self.pool.keys[0][keep].transpose(0, 1), self.pool.values[0][keep].transpose(0, 1)
        scale = self.query.shape[-1] ** -0.5
        query = self.query[row, :, None]
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=True)[:, 0]


def test_flex_on_a_gpu_lists_every_block_as_masked_and_attends_each_rows_context() -> None:
    """Given full blocks, flex's GPU decoding kernel splits a row's keys by the pool's length (every
    context fell to one program per row); a GPU's steps list every block as masked instead. The same
    tables on the CPU attend each row's context, windowed or not, and on a device other than the CPU
    the mask has no full-block tables at all."""
    case = Decodes.of(4, 2, (300, 256), seed=8)  # a partial last block, and none
    split, whole = FlexBackend(split_kv=True), FlexBackend()
    meta = split.prepare(case.batch, case.pool)
    assert meta.partial_count.flatten().tolist() == [3, 2] and not meta.full_count.any()
    assert meta.partial_blocks[:2, 0, 0, :3].tolist() == [[5, 0, 3], [2, 6, 0]]
    assert whole.prepare(case.batch, case.pool).full_count.flatten().tolist() == [2, 2]
    for window in (0, 100):
        got = case.attend(split, window)
        for row in range(2):
            torch.testing.assert_close(got[row], case.expected(row, window))
    on_device = split.load(meta, torch.device("meta"))
    for window in (0, 100):
        mask = split._mask(on_device, case.block, window, 8 * case.block)
        assert mask.full_kv_num_blocks is None and mask.full_kv_indices is None
        assert mask.kv_num_blocks.shape == (2, 1, 1)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (7, 1)])
def test_flex_on_a_gpu_pads_each_kv_heads_query_heads_to_a_power_of_two(heads: int, kv_heads: int) -> None:
    """Flex's GPU decoding kernel takes only a power-of-two number of query heads per KV head (else
    flex falls back to its general kernel); with 3 or 7 (Qwen2.5-1.5B's 6/2 heads, Qwen2.5-0.5B's
    14/2) a GPU's steps give it zero heads up to the next power of two, and each real head's output is
    its attention over its row's context, as SDPA gives it."""
    case = Decodes.of(heads, kv_heads, (300, 129), seed=9)
    backend = FlexBackend(split_kv=True, pad_groups=True)
    ratios = []
    attend = backend._attend
    backend._attend = lambda q, k, v, **options: ratios.append(q.shape[1] // k.shape[1]) or attend(q, k, v, **options)
    # The queries as the attention op gets them: [tokens, heads, dim] transposed from [heads, tokens, dim].
    got = case.attend(backend, 0, case.query.transpose(0, 1).contiguous().transpose(0, 1))
    assert ratios == [1 << (heads // kv_heads - 1).bit_length()]
    for row in range(2):
        torch.testing.assert_close(got[row], case.expected(row, 0))


@pytest.mark.parametrize("torch_npu_has", ["scatter", "no scatter", "scatter without cache_mode"])
def test_the_npu_backend_writes_with_torch_npus_scatter_and_with_the_atb_operator_where_it_lacks_it(
    torch_npu_has: str, demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_npu's `npu_scatter_pa_kv_cache` writes the step's keys and values where torch_npu has it
    with `cache_mode` (vllm-ascend's writer on A2/A3, no NNAL package needed), else the ATB
    `_npu_reshape_and_cache`; either way the engine's greedy output is transformers'."""
    npu = fake_kernels.torch_npu()
    writer = "npu_scatter_pa_kv_cache" if torch_npu_has == "scatter" else "_npu_reshape_and_cache"
    if torch_npu_has == "no scatter":
        del npu.npu_scatter_pa_kv_cache
    elif torch_npu_has == "scatter without cache_mode":
        npu.npu_scatter_pa_kv_cache = lambda key, value, key_cache, value_cache, slot_mapping: None
    calls: list[str] = []
    write = getattr(npu, writer)
    setattr(npu, writer, lambda *args, **kwargs: calls.append(writer) or write(*args, **kwargs))
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    loaded = load_model(build("llama", tmp_path / "llama", demo_model), torch.device("cpu"))
    prompt = prompts()[1]
    tokens = NEW_TOKENS  # what payload() asks for
    out = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    engine = EngineCore.build(loaded, 512, 2, cache=CacheConfig(attention="npu"))
    assert serve(engine, {0: [payload("p", prompt)]}) == {"p": out[0, len(prompt) :].tolist()}
    layers = loaded.model.config.num_hidden_layers
    assert len(calls) >= 2 * layers and set(calls) == {writer}


def test_the_npu_backend_attends_a_sliding_window_past_its_edge_with_the_portable_kernels(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_npu's fused infer-attention ignores pre_tokens and sparse_mode where a sequence has one
    query (its document): a sliding-window layer (Mistral's here, 8 tokens) is attended by it, causal,
    only in steps whose contexts fit the window, and by the portable kernels once one exceeds it; the
    output is transformers' either way. A 5-token prompt and 10 new tokens: contexts 5, 6, 7 and 8 fit
    (the prompt's step and three decodes), 9 to 14 do not."""
    npu = fake_kernels.torch_npu()
    calls: list[int] = []
    attend = npu.npu_fused_infer_attention_score
    npu.npu_fused_infer_attention_score = lambda **kw: calls.append(max(kw["actual_seq_lengths_kv"])) or attend(**kw)
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    loaded = load_model(build("mistral", tmp_path / "mistral", demo_model), torch.device("cpu"))
    layers = loaded.model.config.num_hidden_layers
    assert loaded.model.config.sliding_window == 8
    prompt = prompts()[0]
    assert len(prompt) == 5
    out = loaded.model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    engine = EngineCore.build(loaded, 512, 2, cache=CacheConfig(attention="npu"))
    assert serve(engine, {0: [payload("p", prompt)]}) == {"p": out[0, len(prompt) :].tolist()}
    # The build's probe (a padding row of context 1), then the request's steps.
    assert calls == [c for c in (1, 5, 6, 7, 8) for _ in range(layers)]


def test_latent_attentions_keys_and_values_of_two_sizes_go_to_the_backends_that_take_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSeek-V2/V3's heads (keys of 192 dimensions, values of 128): the NPU's and FlashInfer's paged
    kernels read keys and values of one size, so `auto` takes the portable backend on an NPU and flex
    on a GPU, and asking for either kernel is refused by name; flex's GPU kernels need both sizes at 16
    and up."""
    npu, gpu = types.SimpleNamespace(type="npu"), torch.device("cuda")
    assert select_backend(npu, head_dim=192, dtype=torch.bfloat16, value_dim=128).name == "portable"
    assert select_backend(npu, head_dim=192, dtype=torch.bfloat16, value_dim=192).name == "npu"
    with pytest.raises(
        ValueError, match="attentionBackend npu: its kernels take keys and values of one head size, not 192 and 128"
    ):
        select_backend(npu, "npu", head_dim=192, dtype=torch.bfloat16, value_dim=128)
    monkeypatch.setitem(sys.modules, "flashinfer", fake_kernels.flashinfer("0.6.18"))
    assert select_backend(gpu, head_dim=192, dtype=torch.bfloat16, value_dim=128).name == "flex"
    with pytest.raises(ValueError, match="attentionBackend flashinfer: its kernels take keys and values of one"):
        select_backend(gpu, "flashinfer", head_dim=128, dtype=torch.bfloat16, value_dim=64)
    assert select_backend(gpu, head_dim=16, value_dim=8).name == "portable"
    with pytest.raises(ValueError, match="take heads of 16 dimensions and up; the model's have 8"):
        select_backend(gpu, "flex", head_dim=16, value_dim=8)


def test_a_gpu_takes_flashinfer_only_for_the_models_its_kernels_take(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With FlashInfer installed, `auto` on a GPU takes it for float16 and bfloat16 models with heads of
    64, 128 or 256 dimensions from release 0.2.1.post2 (its paged prefill `run(out=)`), and flex
    otherwise; a model FlashInfer cannot serve that asks for it is warned of."""
    gpu = torch.device("cuda")
    monkeypatch.setitem(sys.modules, "flashinfer", fake_kernels.flashinfer("0.6.18"))
    assert select_backend(gpu, head_dim=128, dtype=torch.bfloat16).name == "flashinfer"
    assert select_backend(gpu, head_dim=64, dtype=torch.float16).name == "flashinfer"
    assert select_backend(gpu, head_dim=128, dtype=torch.float32).name == "flex"
    assert select_backend(gpu, head_dim=96, dtype=torch.bfloat16).name == "flex"  # Phi-3-mini's heads
    with caplog.at_level(logging.WARNING, logger="workers.models.attention"):
        assert select_backend(gpu, "flashinfer", head_dim=96, dtype=torch.bfloat16).name == "flashinfer"
    assert (
        "attentionBackend flashinfer: FlashInfer's kernels take heads of 64, 128 or 256 dimensions, not 96"
        in caplog.text
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake_kernels.flashinfer("0.2.1.post1"))
    assert select_backend(gpu, head_dim=128, dtype=torch.bfloat16).name == "flex"
