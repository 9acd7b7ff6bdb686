"""The compiled decode step (workers/models/compile.py) against the eager one: the same greedy tokens,
and logits within float tolerance at every step, for the architectures people serve; alone, batched,
with prompts in chunks, joining a running batch, after preemption and from the prefix cache, at batch
1, at a bucket size and one past it. The forward compiles with `fullgraph=True` but for the attention
op: the proof that the step can be captured whole on a device.

On a CPU the suite compiles a few architectures (each compile takes seconds to a minute on 2 cores);
`make device-check` runs every one on the device it is given (TOKENLINE_TEST_DEVICE)."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from scripts.localstack import ROOT
from tests import fake_kernels
from tests.engine_runs import ARCHITECTURES, COMPILES, DEVICE, POOL_GIB, build, payload, steps
from workers.engine.core import CacheConfig, EngineCore
from workers.models.compile import CapturedDecode, buckets, grouped_buckets, replay_on_host, wanted
from workers.models.kv_pool import KVShape
from workers.models.loader import LoadedModel, load_model

# On a CPU: a plain Llama, a model with a sliding-window layer (Qwen2) and one with soft-capping
# (Gemma 2); on a device, every architecture with attention of its own (GPT-2 has learned positions).
SUITE = ("llama", "qwen2", "gemma2") if DEVICE.type == "cpu" else tuple(sorted(ARCHITECTURES))
# The captured step: on a CPU, a plain Llama (what the CPU checks is the bookkeeping of the buffers: its
# flex kernels compile for each batch size, slowly); on a device, every architecture, but on an NPU those
# its fused attention captures: no soft-capping (Gemma 2) and no sliding-window layers, which it
# attends with other kernels past their window. Nowhere DeepSeek's latent attention: values of 8
# dimensions, which neither the NPU's kernels nor flex's GPU ones take (the portable backend serves it).
NPU_UNCAPTURED = {"gemma2", "qwen2", "mistral", "gemma3"}
UNCAPTURED = {"deepseek_v2", "deepseek_v3"}
CAPTURED = (
    ("llama",)
    if DEVICE.type == "cpu"
    else tuple(
        a for a in sorted(ARCHITECTURES) if a not in UNCAPTURED and (DEVICE.type != "npu" or a not in NPU_UNCAPTURED)
    )
)
# Its attention backend and `compile`: flex, compiled (and on the CPU its replay stood in for); on an
# NPU the fused operator under `auto`, which captures the compiled step where triton-ascend is
# installed, else the eager one.
CAPTURE_BACKEND, CAPTURE_COMPILE = ("npu", "auto") if DEVICE.type == "npu" else ("flex", "on")
# transformers' MoE experts in float32 (its grouped-mm fallback) read the routing on the host mid-step:
# on a device such a step cannot be captured and stays compiled (in bfloat16 they take torch's
# grouped_mm, which reads nothing back).
UNCAPTURABLE = () if DEVICE.type == "cpu" else ("mixtral", "qwen2_moe")
MAX_BATCH = 9  # buckets 1, 2, 4, 8, 16: 8 is a bucket, 9 one past it
CAPTURE_BATCH = 3 if DEVICE.type == "cpu" else MAX_BATCH  # on a CPU buckets 1, 2, 4: 2 is one, 3 past it
# Heads of 16 dimensions, in both tests: flex_attention's GPU kernels take no fewer, and the two tests'
# forward graphs are then the same, compiled once where an architecture is in both; on an NPU 128,
# the size the fused attention's TND layout documents.
HEAD_DIM = 128 if DEVICE.type == "npu" else 16


@pytest.fixture(scope="module", params=SUITE)
def model(request: pytest.FixtureRequest, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(build(request.param, tmp_path_factory.mktemp(request.param), demo_model, HEAD_DIM), DEVICE)


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 4000, (5 + 7 * i,), generator=generator).tolist() for i in range(count)]


def test_bucket_sizes_are_vllms() -> None:
    assert buckets(1) == [1]
    assert buckets(9) == [1, 2, 4, 8, 16]
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_a_tensor_parallel_ranks_buckets_start_at_the_groups_size() -> None:
    """Its DTensor layers guard on whether the batch is smaller than the group, and 1 would be a graph
    of its own: one graph serves the buckets from the group's size (and 2) up."""
    assert grouped_buckets(9, 2) == [2, 4, 8, 16]
    assert grouped_buckets(9, 3) == [4, 8, 16]
    assert grouped_buckets(64, 8) == [8, 16, 24, 32, 40, 48, 56, 64]
    assert grouped_buckets(1, 2) == [2]
    assert grouped_buckets(2, 3) == [4]


@pytest.mark.skipif(not COMPILES, reason="no Inductor code generator for the device (an NPU without triton-ascend)")
def test_the_compiled_decode_step_gives_the_eager_steps_tokens_and_logits(model: LoadedModel) -> None:
    """Nine requests: one alone first, then eight joining in chunks of 16 prompt tokens (the batch
    reaches 8, a bucket, and 9, one past it), in a pool small enough to preempt, then all again
    from the prefix cache."""
    batch = [payload(f"p{i}", p) for i, p in enumerate(prompts(MAX_BATCH))]
    arrivals = {0: batch[:1], 3: batch[1:5], 6: batch[5:]}
    again = {0: [payload(f"again-{p.request_id}", list(p.prompt_token_ids)) for p in batch]}
    results = {}
    for mode in ("off", "on"):
        # The portable backend on every device, for its 4-token blocks: sequences outgrow their blocks and
        # the pool runs out (a GPU's flex takes 128-token blocks, which these sequences never fill; the
        # captured-step test below runs it).
        cache = CacheConfig(
            block_size=4, max_prefill_tokens=16, mem_gib=_pool_gib(model, 30 * 4), compile=mode, attention="portable"
        )
        engine = EngineCore.build(model, 512, MAX_BATCH, cache=cache)
        assert (engine.runner.graphs is not None) == (mode == "on")
        first = steps(engine, arrivals)
        results[mode] = (first, steps(engine, again), engine.scheduler.preemptions)
    (eager_ids, eager_logits), (eager_again, _), preempted = results["off"]
    (ids, logits), (again_ids, _), compiled_preempted = results["on"]
    assert ids == eager_ids and again_ids == eager_again
    # Every layer of a Mistral or Gemma 3 this small attends a window: its pool is rings, which never
    # run out, so nothing is preempted; a model with a full-attention layer runs out of blocks.
    assert preempted == compiled_preempted
    assert (preempted > 0) == (KVShape.of(model.model).full_layers > 0)
    assert len(logits) == len(eager_logits)
    for compiled, eager in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("architecture", CAPTURED)
def test_the_captured_decode_step_gives_the_eager_steps_tokens_and_logits(
    architecture: str, demo_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode step captured per bucket, flex's (on an NPU the fused attention's), as a device
    graph on a GPU or an NPU (on the CPU, the replay re-runs the recorded step over the same buffers):
    each step copied into its bucket's buffers and replayed gives the eager (portable) step's tokens
    and logits. The same nine requests as above (three on a CPU), each prompt in one step, so that 8
    and 9 sequences (2 and 3) decode together; no preemption (128-token blocks); then again from the
    prefix cache. Then a recording that fails (as a CUDA graph's does where the step reads the device
    from the host) leaves the compiled step serving the same tokens, and the log says why."""
    model = load_model(build(architecture, tmp_path / architecture, demo_model, HEAD_DIM), DEVICE)
    batch = [payload(f"p{i}", p) for i, p in enumerate(prompts(CAPTURE_BATCH))]
    half = CAPTURE_BATCH // 2 + 1
    arrivals = {0: batch[:1], 3: batch[1:half], 6: batch[half:]}
    again = {0: [payload(f"again-{p.request_id}", list(p.prompt_token_ids)) for p in batch]}
    results = {}
    for mode in ("off", "on"):
        # The eager reference attends through the portable backend (in 128-token blocks too): flex's
        # kernels compile for each batch size, so an eager flex engine would compile them all again.
        attention, compile = (CAPTURE_BACKEND, CAPTURE_COMPILE) if mode == "on" else ("portable", "off")
        cache = CacheConfig(128, POOL_GIB, 512, prefill_chunk=512, attention=attention, compile=compile)
        engine = EngineCore.build(model, 512, CAPTURE_BATCH, cache=cache)
        if mode == "on" and DEVICE.type == "cpu":  # no device graphs: captured by the test
            engine.runner.capture_decode(replay_on_host)
        captured = engine.runner.captured
        expected = mode == "on" and architecture not in UNCAPTURABLE
        assert (captured is not None and sorted(captured.buckets) == buckets(CAPTURE_BATCH)) == expected
        replays = _count_replays(captured) if captured is not None else []
        results[mode] = (steps(engine, arrivals), steps(engine, again), replays)
    (eager_ids, eager_logits), (eager_again, _), _ = results["off"]
    (ids, logits), (again_ids, _), replays = results["on"]
    assert ids == eager_ids and again_ids == eager_again
    if architecture not in UNCAPTURABLE:
        assert {1, *buckets(CAPTURE_BATCH)[-2:]} <= set(replays)  # alone, at a bucket and one past it
    assert len(logits) == len(eager_logits)
    for compiled, eager in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)

    engine.runner.capture_decode(_refused)
    assert engine.runner.captured is None
    assert "the decode step cannot be captured (Cannot copy between CPU and CUDA tensors" in caplog.text
    third, _ = steps(engine, {0: [payload(f"third-{p.request_id}", list(p.prompt_token_ids)) for p in batch]})
    assert {name.replace("third", "again"): ids for name, ids in third.items()} == eager_again


def _refused(step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")


def _count_replays(captured: CapturedDecode) -> list[int]:
    """The bucket of every replay from now on."""
    replayed: list[int] = []
    for size, bucket in captured.buckets.items():
        replay = bucket.replay
        bucket.replay = lambda size=size, replay=replay: (replayed.append(size), replay())[1]
    return replayed


def _pool_gib(model: LoadedModel, tokens: int) -> float:
    """npuMemSize for `tokens` tokens in every layer (rings included, where a model has them)."""
    shape = KVShape.of(model.model)
    rings = MAX_BATCH * (max(shape.windows) - 1 + 16) * shape.sliding_bytes_per_token if max(shape.windows) else 0
    return (tokens * shape.full_bytes_per_token + rings + 0.5) / 2**30


@pytest.mark.skipif(DEVICE.type != "cpu", reason="breaks the CPU's C++ compiler to make compiling fail")
def test_compile_auto_serves_eagerly_where_the_step_cannot_compile_and_on_stops_the_start(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Inductor needs a code generator for the device: Triton on a GPU or an NPU (triton-ascend is a
    package of its own), a C++ compiler on a CPU. `compile: auto` on an accelerator without Triton keeps
    the decode step eager, said in the log; where compiling fails all the same (here the C++ compiler
    named does not exist and the compile cache is empty), `auto` serves eagerly with a warning, while
    `on`, asked for, stops the start."""
    assert importlib.util.find_spec("triton") is None  # the CPU build of torch brings none
    with caplog.at_level(logging.INFO, logger="workers.models.compile"):
        assert not wanted("auto", torch.device("cuda")) and wanted("on", torch.device("cuda"))
    assert "no Triton for Inductor's cuda kernels here: the decode step runs eagerly" in caplog.text
    assert not wanted("auto", torch.device("cpu"))
    # The tests' 2-layer model: compiled twice from an empty cache, a smaller graph is a shorter test.
    loaded = load_model(build("llama", tmp_path / "llama", demo_model), torch.device("cpu"))
    engine = EngineCore.build(loaded, 256, 2, cache=CacheConfig(mem_gib=POOL_GIB))
    expected = steps(engine, {0: [payload("p", prompts(1)[0])]})[0]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # Inductor's own patch, not monkeypatch's: pytest 9's undo deletes what it finds in no instance
    # `__dict__`, which hides an Inductor option from every later test in the process.
    compilers = torch._inductor.config.cpp.cxx
    with torch._inductor.config.patch({"cpp.cxx": (str(tmp_path / "no-such-compiler"),)}):
        with caplog.at_level(logging.WARNING, logger="workers.models.runner"):
            engine.runner.compile_decode(2, required=False)
        assert engine.runner.graphs is None
        assert "compile auto: the decode step did not compile" in caplog.text
        assert steps(engine, {0: [payload("again", prompts(1)[0])]})[0] == {"again": expected["p"]}
        with pytest.raises(Exception, match="no-such-compiler"):
            engine.runner.compile_decode(2, required=True)
    assert torch._inductor.config.cpp.cxx == compilers


def test_the_worker_keeps_its_compiled_code_where_a_restart_finds_it(tmp_path: Path) -> None:
    """The worker process points Inductor's cache at `~/.cache/tokenline/inductor` before torch loads:
    torch fixes the directory as Dynamo is imported (under /tmp by default, which a container or a
    reboot loses). Here the worker's entry point runs (to its `--help`), then Dynamo is imported, as
    the model's loading imports it; a TORCHINDUCTOR_CACHE_DIR in the environment wins."""
    script = (
        "import sys\n"
        "from workers.serving.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules\n"
        "import torch._dynamo\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "print(cache_dir())\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "TORCHINDUCTOR_CACHE_DIR"}
    for extra, expected in (
        ({"HOME": str(tmp_path)}, tmp_path / ".cache" / "tokenline" / "inductor"),
        ({"HOME": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")}, tmp_path / "mine"),
    ):
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.splitlines()[-1] == str(expected)


def test_the_npu_backends_eager_decode_step_is_recorded_with_its_attention_lengths_updated_before_each_replay(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`compile: auto` on an NPU without triton-ascend records the eager decode step of each bucket as
    an NPUGraph (here torch_npu's stand-in, tests/fake_kernels.py NpuGraphs, on the CPU). The fused
    operator takes the contexts' lengths on the host: each layer's call is a task group of its own,
    issued again with the step's lengths before every replay, and its replay runs with those. Three
    prompts of 120–126 tokens decoding together (buckets 1, 2 and 4) cross into their second 128-token
    block: the engine gives the tokens and logits of the same engine not recorded. A model with
    sliding-window layers is not recorded (which kernels attend it depends on the contexts), nor is a
    model under a torch_npu without the graph-task API: each serves eagerly, said in the log."""
    npu = fake_kernels.torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    monkeypatch.setattr("workers.models.runner.device_recorder", lambda device: npu.npu.record)
    model = load_model(build("llama", tmp_path / "llama", demo_model), torch.device("cpu"))
    generator = torch.Generator().manual_seed(8)
    sizes = (120, 124, 126)
    batch = [payload(f"p{i}", torch.randint(3, 4000, (n,), generator=generator).tolist()) for i, n in enumerate(sizes)]
    arrivals = {0: batch[:1], 2: batch[1:2], 4: batch[2:]}
    results = {}
    for mode in ("off", "auto"):
        engine = EngineCore.build(model, 512, 3, cache=CacheConfig(prefill_chunk=512, attention="npu", compile=mode))
        captured = engine.runner.captured
        assert (captured is not None) == (mode == "auto")
        replays = []
        if captured is not None:
            assert engine.runner.graphs is not None and not engine.runner.graphs.compiled
            assert sorted(captured.buckets) == [1, 2, 4]
            replays = _count_replays(captured)
        results[mode] = (steps(engine, arrivals), replays)
    ((eager_ids, eager_logits), _), ((ids, logits), replays) = results["off"], results["auto"]
    assert ids == eager_ids
    assert set(replays) == {1, 2, 4}  # alone, at a bucket and one past it
    layers = model.model.config.num_hidden_layers
    assert npu.npu.replays == [layers] * len(replays)  # every layer's call, in every replay
    assert len(logits) == len(eager_logits)
    for recorded, eager in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(recorded, eager, rtol=1e-4, atol=1e-4)

    windowed = load_model(build("mistral", tmp_path / "mistral", demo_model), torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="workers.models.runner"):
        engine = EngineCore.build(windowed, 512, 3, cache=CacheConfig(attention="npu", compile="auto"))
    assert engine.runner.captured is None and engine.runner.graphs is None
    assert "the decode step cannot be captured (the npu backend attends sliding-window layers" in caplog.text

    monkeypatch.delattr(fake_kernels.NpuGraphs, "graph_task_update_begin")  # an older torch_npu
    with caplog.at_level(logging.WARNING, logger="workers.models.runner"):
        engine = EngineCore.build(model, 512, 3, cache=CacheConfig(prefill_chunk=512, attention="npu", compile="auto"))
    assert engine.runner.captured is None and engine.runner.graphs is None
    assert "the decode step cannot be captured (this torch_npu lacks graph_task_update_begin)" in caplog.text
    assert steps(engine, arrivals)[0] == eager_ids


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_flashinfers_decode_step_is_captured_with_each_kernel_planned_again_before_every_replay(
    architecture: str,
    demo_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With FlashInfer (here its stand-in, tests/fake_kernels.py, on the CPU) each bucket's decode step
    is recorded over its decode wrappers in CUDA-graph mode, one per window, scale and soft-cap (Gemma 2
    has two), and every kernel of the bucket is planned again with the step's pages before each
    replay, outside the graph: the stand-in's graph kernels read only their buffers, and refuse a plan
    while a step is recorded or replayed. Three prompts of 9–11 tokens decoding together in 4-token
    blocks (buckets 1, 2 and 4) cross into new pages every few steps: the engine gives the tokens and
    logits of the same engine not captured (FlashInfer's prefill kernel). A FlashInfer whose decode
    wrapper lacks an argument the backend passes (an older release) leaves the step uncaptured, said in
    the log, and serving the same tokens."""
    flashinfer = fake_kernels.flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setattr("workers.models.runner.device_recorder", lambda device: flashinfer.graphs.record)
    model = load_model(build(architecture, tmp_path / architecture, demo_model), torch.device("cpu"))
    generator = torch.Generator().manual_seed(9)
    batch = [
        payload(f"p{i}", torch.randint(3, 4000, (n,), generator=generator).tolist()) for i, n in enumerate((9, 10, 11))
    ]
    arrivals = {0: batch[:1], 2: batch[1:2], 4: batch[2:]}
    results = {}
    for mode in ("off", "auto"):  # auto on a device with graphs and no Triton: the eager step is recorded
        cache = CacheConfig(4, prefill_chunk=512, attention="flashinfer", compile=mode)
        engine = EngineCore.build(model, 512, 3, cache=cache)
        captured = engine.runner.captured
        assert (captured is not None) == (mode == "auto")
        replays = []
        if captured is not None:
            assert sorted(captured.buckets) == [1, 2, 4]
            replays = _count_replays(captured)
        flashinfer.graphs.plans = flashinfer.graphs.runs = 0
        results[mode] = (steps(engine, arrivals), replays)
    ((eager_ids, eager_logits), _), ((ids, logits), replays) = results["off"], results["auto"]
    assert ids == eager_ids
    assert set(replays) == {1, 2, 4}  # alone, at a bucket and one past it
    kernels = 2 if architecture == "gemma2" else 1
    assert len(flashinfer.graphs.wrappers) == 3 * kernels  # per bucket, one per window, scale and soft-cap
    assert flashinfer.graphs.plans == kernels * len(replays)  # each of them before every replay
    assert flashinfer.graphs.runs == model.model.config.num_hidden_layers * len(replays)  # every layer's
    assert len(logits) == len(eager_logits)
    for recorded, eager in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(recorded, eager, rtol=1e-4, atol=1e-4)

    class Older(flashinfer.BatchDecodeWithPagedKVCacheWrapper):  # type: ignore[name-defined,misc]
        def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False) -> None:
            raise AssertionError("not reached: the backend passes the graph buffers")

    monkeypatch.setattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper", Older)
    with caplog.at_level(logging.WARNING, logger="workers.models.runner"):
        engine = EngineCore.build(
            model, 512, 3, cache=CacheConfig(4, prefill_chunk=512, attention="flashinfer", compile="auto")
        )
    assert engine.runner.captured is None and engine.runner.graphs is None
    assert "the decode step cannot be captured (" in caplog.text and "unexpected keyword argument" in caplog.text
    assert steps(engine, arrivals)[0] == eager_ids
