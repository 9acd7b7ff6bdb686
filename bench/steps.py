"""The engine's decode step in-process: what sampling and host work add to the forward pass.

`python bench/steps.py` builds 1-layer random Llamas (vocabulary 2,048 and 32,000, cached under
models/), drives tokenline's engine core on one torch thread at batch 1, 16, 64 and 128, and times
decode steps with greedy requests and with sampled ones (temperature 0.8, top_p 0.9, top_k 50,
repetition penalty 1.1), alternating between the two, as medians per step:
- forward: the model runner's pass (its inputs built, the forward run); sample: the batched
  sampler; host: the rest of the step (scheduling, output processing, events), step by step;
- the ratio of a sampled step to a greedy one.
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
from workers.engine.core import EngineCore
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


def engine_at(loaded: LoadedModel, batch: int, params: dict[str, float]) -> EngineCore:
    """An engine with `batch` requests prefilled and decoding."""
    engine = EngineCore.build(loaded, 4096, batch, threads=1, prefill_threads=1)
    for i in range(batch):
        sampling = SamplingParams(max_tokens=4000, ignore_eos=True, seed=i + 1, **params)  # type: ignore[arg-type]
        engine.add_request(JobPayload(f"r{i}", "bench", tuple(range(10, 26)), sampling, "ch"))
    while engine.scheduler.waiting or not engine.scheduler.running:
        engine.step()
    return engine


def measure(engine: EngineCore, steps: int) -> dict[str, float]:
    forward = engine.runner.execute = Timed(engine.runner.execute)  # type: ignore[method-assign]
    sample = engine.sampler.draw = Timed(engine.sampler.draw)  # type: ignore[method-assign]
    totals = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - started)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[2048, 32000])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for vocab in args.vocab for row in run(vocab, args.batch, args.rounds, args.steps)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
