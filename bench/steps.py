"""The engine's decode step in-process: what sampling and host work add to the forward pass.

`python bench/steps.py` builds 1-layer random Llamas (vocabulary 2,048 and 32,000, cached under
models/), drives tokenline's engine core on one torch thread at batch 1, 16, 64 and 128, and times
decode steps with greedy requests and with sampled ones (temperature 0.8, top_p 0.9, top_k 50,
repetition penalty 1.1), alternating between the two, as medians per step:
- forward: the model runner's pass (its inputs built, the forward run); sample: the batched
  sampler; host: the rest of the step (scheduling, output processing, events), step by step;
- the ratio of a sampled step to a greedy one.

`python bench/steps.py --deep` measures the compiled decode step against the eager one instead, on a
Qwen2-shaped model with Qwen2.5-7B's depth (28 layers) and tiny widths (hidden 64, 4 heads, 2 KV
heads, vocabulary 2,048): what remains of its step is the host's work, as on an accelerator. Batch 1
and 32, the two engines alternating (`--rounds`), medians; and the ATen operations one step
dispatches, eager and compiled. `--device` runs it on an accelerator (make device-check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from scripts.build_demo_model import main as build_model
from workers.engine.core import CacheConfig, EngineCore
from workers.models.compile import device_recorder, generates_code
from workers.models.loader import LoadedModel, load_model

ROOT = Path(__file__).resolve().parent.parent
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}


def model_dir(vocab: int) -> Path:
    path = ROOT / "models" / f"bench-1layer-v{vocab}"
    if not (path / "config.json").is_file():
        build_model([str(path), "--layers", "1", "--model-vocab-size", str(vocab)])
    return path


class Timed:
    """Wraps a callable and records the seconds of each call."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.seconds: list[float] = []

    def __call__(self, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.function(*args)
        finally:
            self.seconds.append(time.perf_counter() - started)


def deep_model_dir() -> Path:
    """The 28-layer, 64-wide Qwen2 (built once, with the demo model's tokenizer)."""
    path = ROOT / "models" / "bench-deep-qwen2-28"
    if not (path / "config.json").is_file():
        import transformers

        from tests.engine_runs import saved

        demo = ROOT / "models" / "demo"
        if not (demo / "config.json").is_file():
            build_model([str(demo)])
        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=28,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            pad_token_id=0,
        )
        saved(transformers.Qwen2ForCausalLM(config), path, demo)
        (path / "chat_template.jinja").write_text((demo / "chat_template.jinja").read_text())  # to serve chat
    return path


def ops_per_step(engine: EngineCore) -> int:
    """The ATen operations one step calls (outermost ones: not those an ATen operation calls itself),
    as the profiler records them; compiled kernels are not ATen operations."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()

    def top(event) -> bool:  # type: ignore[no-untyped-def]
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in prof.events() if e.name.startswith("aten::") and top(e))


def engine_at(
    loaded: LoadedModel,
    batch: int,
    params: dict[str, float],
    compile: str = "off",
    prompt: int = 16,
    attention: str = "auto",
    capture: bool = True,
) -> EngineCore:
    """An engine with `batch` requests prefilled and decoding (on an accelerator, in a 4 GiB pool)."""
    mem_gib = -1.0 if loaded.device.type == "cpu" else 4.0
    cache = CacheConfig(compile=compile, attention=attention, capture=capture, mem_gib=mem_gib)
    engine = EngineCore.build(loaded, 4096, batch, threads=1, prefill_threads=1, cache=cache)
    for i in range(batch):
        sampling = SamplingParams(max_tokens=4000, ignore_eos=True, seed=i + 1, **params)  # type: ignore[arg-type]
        engine.add_request(JobPayload(f"r{i}", "bench", tuple(range(10, 10 + prompt)), sampling, "ch"))
    while engine.scheduler.waiting or not engine.scheduler.running:
        engine.step()
    return engine


def measure(engine: EngineCore, steps: int) -> dict[str, float]:
    forward = engine.runner.execute = Timed(engine.runner.execute)  # type: ignore[method-assign]
    sample = engine.sampler.draw = Timed(engine.sampler.draw)  # type: ignore[method-assign]
    totals = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - started)
    finally:
        engine.runner.execute, engine.sampler.draw = forward.function, sample.function  # type: ignore[method-assign]
    host = [t - f - s for t, f, s in zip(totals, forward.seconds, sample.seconds, strict=True)]
    return {
        "step_ms": statistics.median(totals) * 1000,
        "forward_ms": statistics.median(forward.seconds) * 1000,
        "sample_ms": statistics.median(sample.seconds) * 1000,
        "host_ms": statistics.median(host) * 1000,
    }


def run(vocab: int, batches: list[int], rounds: int, steps: int) -> list[dict[str, Any]]:
    loaded = load_model(model_dir(vocab), torch.device("cpu"))
    rows = []
    for batch in batches:
        greedy, sampled = engine_at(loaded, batch, GREEDY), engine_at(loaded, batch, SAMPLED)
        measure(greedy, 3), measure(sampled, 3)  # warm-up
        results: dict[str, list[dict[str, float]]] = {"greedy": [], "sampled": []}
        for _ in range(rounds):  # alternating, so both see the same machine
            results["greedy"].append(measure(greedy, steps))
            results["sampled"].append(measure(sampled, steps))
        row: dict[str, Any] = {"vocab": vocab, "batch": batch}
        for kind, runs in results.items():
            for key in runs[0]:
                row[f"{kind}_{key}"] = statistics.median(r[key] for r in runs)
        row["ratio"] = row["sampled_step_ms"] / row["greedy_step_ms"]
        rows.append(row)
        print(
            f"vocab {vocab:>6} batch {batch:>3}: greedy {row['greedy_step_ms']:.2f} ms "
            f"(forward {row['greedy_forward_ms']:.2f}, sample {row['greedy_sample_ms']:.2f}, "
            f"host {row['greedy_host_ms']:.2f}); sampled {row['sampled_step_ms']:.2f} ms "
            f"(forward {row['sampled_forward_ms']:.2f}, sample {row['sampled_sample_ms']:.2f}, "
            f"host {row['sampled_host_ms']:.2f}); ratio {row['ratio']:.2f}",
            flush=True,
        )
    return rows


def compare_compiled(
    device: torch.device, batches: list[int], rounds: int, steps: int, attention: str = "auto", prompt: int = 16
) -> list[dict[str, Any]]:
    """The deep model's decode step, eager against compiled (and, where the device and the attention
    backend can, against the compiled step captured as device graphs), alternating; medians."""
    loaded = load_model(deep_model_dir(), device)
    # Inductor has a code generator here (a CPU's C++ compiler, Triton); where it has none (an NPU
    # without triton-ascend) the eager step is what is captured (`compile: auto`).
    compiles = generates_code(device)
    rows = []
    for batch in batches:
        started = time.monotonic()
        options = {"prompt": prompt, "attention": attention}
        engines = {}
        if compiles:
            engines["compiled"] = engine_at(loaded, batch, GREEDY, compile="on", capture=False, **options)
        compile_s = time.monotonic() - started
        engines["eager"] = engine_at(loaded, batch, GREEDY, **options)
        if device_recorder(device) is not None:  # a device with graphs
            captured = engine_at(loaded, batch, GREEDY, compile="on" if compiles else "auto", **options)
            if captured.runner.captured is not None:  # and an attention backend they can capture
                engines["captured"] = captured
        for engine in engines.values():
            measure(engine, 3)  # warm-up
        runs: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, engine in engines.items():
                runs[name].append(measure(engine, steps)["step_ms"])
        eager = engines["eager"]
        graphs = next((e.runner.graphs for e in engines.values() if e.runner.graphs is not None), None)
        row: dict[str, Any] = {"device": str(device), "backend": eager.runner.backend.name, "batch": batch}
        row["bucket"] = graphs.bucket(batch) if graphs is not None else None
        row |= {f"{k}_ms": statistics.median(v) for k, v in runs.items()}
        if "compiled" in engines:
            row["ratio"] = row["compiled_ms"] / row["eager_ms"]
        row["tokens_per_s"] = batch * 1000 / min(row[f"{name}_ms"] for name in engines)
        row |= {f"{name}_ops": ops_per_step(engine) for name, engine in engines.items()}
        row["compile_s"] = compile_s
        rows.append(row)
        print(table([row]).splitlines()[-1], f"(compiled in {compile_s:.0f} s)", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| device | backend | batch | bucket | eager ms | compiled ms | compiled / eager | captured ms "
        "| captured / eager | tok/s | ATen ops eager / compiled / captured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        compiled = captured = "— | —"
        if "compiled_ms" in r:
            compiled = f"{r['compiled_ms']:.2f} | {r['ratio']:.2f}"
        if "captured_ms" in r:
            captured = f"{r['captured_ms']:.2f} | {r['captured_ms'] / r['eager_ms']:.2f}"
        lines.append(
            f"| {r['device']} | {r['backend']} | {r['batch']} | {r['bucket']} | {r['eager_ms']:.2f} | "
            f"{compiled} | {captured} | {r['tokens_per_s']:.0f} | "
            f"{r['eager_ops']} / {r.get('compiled_ops', '—')} / {r.get('captured_ops', '—')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[2048, 32000])
    parser.add_argument("--batch", type=int, nargs="+", help="default: 1 16 64 128; with --deep, 1 32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--deep", action="store_true", help="the compiled decode step against the eager one")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu (with --deep)")
    parser.add_argument("--attention", default="auto", help="attentionBackend (with --deep)")
    parser.add_argument("--prompt", type=int, default=16, help="each request's prompt tokens (with --deep)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.deep:
        rows = compare_compiled(
            torch.device(args.device), args.batch or [1, 32], args.rounds, args.steps, args.attention, args.prompt
        )
        print(table(rows))
    else:
        batches = args.batch or [1, 16, 64, 128]
        rows = [row for vocab in args.vocab for row in run(vocab, batches, args.rounds, args.steps)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
