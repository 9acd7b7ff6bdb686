"""What constrained decoding adds per token: the engine core on the demo model, decoding at batch 1
and 16, with and without a JSON-schema constraint (llguidance), alternating, medians per step.

`python bench/grammar.py` (or `make bench`, after the rounds). Every request decodes inside one long
JSON string (`{"text": "…"}`), where a grammar allows most of the vocabulary and the mask is as
costly as it gets; a request that ends is replaced, so the batch stays full. Per token it reports
the decode step's median with and without the constraint, their ratio, and the added milliseconds
per step and per token (filling the mask on the host, applying it, feeding the matcher).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from schemas import guided
from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from workers.engine.core import EngineCore
from workers.models.loader import LoadedModel, load_model

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
PROMPT = tuple(range(10, 42))


class Engine:
    """An engine kept at `batch` decoding requests, each constrained by `grammar` or not."""

    def __init__(self, loaded: LoadedModel, batch: int, grammar: str | None) -> None:
        self.core = EngineCore.build(loaded, 2048, batch, threads=1, prefill_threads=1)
        self.grammar = grammar
        self.ids = itertools.count()
        for _ in range(batch):
            self.add()
        while self.core.scheduler.waiting:
            self.step()

    def add(self) -> None:
        sampling = SamplingParams(max_tokens=1500, temperature=1.0, seed=next(self.ids) + 1, grammar=self.grammar)
        self.core.add_request(JobPayload(f"r{next(self.ids)}", "bench", PROMPT, sampling, "ch"))

    def step(self) -> float:
        started = time.perf_counter()
        result = self.core.step()
        seconds = time.perf_counter() - started
        for _ in result.ended:
            self.add()
        return seconds


def measure(loaded: LoadedModel, batch: int, rounds: int, steps: int) -> dict[str, Any]:
    engines = {"free": Engine(loaded, batch, None), "json": Engine(loaded, batch, guided.json_schema(SCHEMA))}
    timings: dict[str, list[float]] = {"free": [], "json": []}
    for _ in range(rounds):
        for name, engine in engines.items():
            timings[name] += [engine.step() for _ in range(steps)]
    free, constrained = statistics.median(timings["free"]), statistics.median(timings["json"])
    return {
        "batch": batch,
        "free_ms": round(free * 1e3, 3),
        "json_ms": round(constrained * 1e3, 3),
        "ratio": round(constrained / free, 3),
        "added_ms_per_step": round((constrained - free) * 1e3, 3),
        "added_ms_per_token": round((constrained - free) * 1e3 / batch, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "demo"))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    loaded = load_model(Path(args.model), torch.device("cpu"), "float32")
    rows = [measure(loaded, int(b), args.rounds, args.steps) for b in args.batches.split(",")]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
