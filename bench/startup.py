"""`python bench/startup.py`: how much later a compiled worker starts serving than an eager one, with the
compile cache warm (issue 31's start-up target: within 15 s).

The deep model of `bench/steps.py --deep` (28 layers, Qwen2.5-7B's depth) served by worker processes as
`make run` starts them, on a Redis of its own: first one start with `compile: on`, which fills the
compile cache (its time is reported as the first start; it compiles from nothing only where the cache
was empty). Then in each of `--rounds` rounds, alternating, a worker with `TOKENLINE_COMPILE=off` and
one with `on`: seconds from the process's start until it has registered with RQ (the engine built, the
decode step compiled and warmed, the worker listening). The report gives the medians and their
difference. Writes bench/results/startup.{md,json}. `--model smollm2` serves SmolLM2-135M-Instruct
instead, and `--env NAME=VALUE` adds a setting to every worker (`TOKENLINE_QUANTIZATION=int8`;
`TORCHINDUCTOR_CACHE_DIR=<an empty folder>` for a first start from nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import RESULTS, write_results
from bench.steps import deep_model_dir
from scripts import localstack, real_models

MODEL = "deep"


def start_seconds(env: dict[str, str], compile_mode: str, log: Path) -> float:
    """Seconds until a worker with `compile_mode` has registered; the worker is stopped after."""
    started = time.monotonic()
    worker = localstack.start_worker({**env, "TOKENLINE_COMPILE": compile_mode}, MODEL, log=log)
    try:
        localstack.wait_for(
            lambda: localstack.worker_count(env["REDIS_URL"], MODEL) > 0 or worker.poll() is not None,
            600,
            f"the worker (compile {compile_mode})",
        )
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited: {log.read_text()[-2000:]}")
        return time.monotonic() - started
    finally:
        localstack.stop(worker)
        localstack.wait_for(lambda: localstack.worker_count(env["REDIS_URL"], MODEL) == 0, 30, "the worker to go")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=("deep", "smollm2"), default="deep")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="a worker setting")
    args = parser.parse_args(argv)
    model = deep_model_dir() if args.model == "deep" else real_models.smollm2()
    extra = dict(item.split("=", 1) for item in args.env)
    logs = Path(tempfile.mkdtemp(prefix="tokenline-startup-"))
    port = localstack.free_port()
    redis = localstack.start_redis(port, log=logs / "redis.log")
    redis_url = f"redis://127.0.0.1:{port}/0"
    env = localstack.environment(MODEL_PATH=str(model), MODEL_NAME=MODEL, REDIS_URL=redis_url, **extra)
    try:
        first = start_seconds(env, "on", logs / "first.log")
        print(f"first start, compile on: {first:.1f} s", flush=True)
        runs: dict[str, list[float]] = {"off": [], "on": []}
        for round_ in range(args.rounds):
            for mode in runs:
                runs[mode].append(start_seconds(env, mode, logs / f"{mode}-{round_}.log"))
            print(f"round {round_ + 1}: off {runs['off'][-1]:.1f} s, on {runs['on'][-1]:.1f} s", flush=True)
    finally:
        localstack.stop(redis)
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    describe = " ".join(["28-layer model" if args.model == "deep" else "SmolLM2-135M", *args.env])
    report: dict[str, Any] = {"first_on_s": first, "runs": runs, "off_s": off, "on_s": on, "difference_s": on - off}
    table = "\n".join(
        [
            f"| worker start ({describe}, CPU) | compile off | compile on | on − off | target |",
            "| --- | --- | --- | --- | --- |",
            f"| seconds to serving, warm cache (median of {args.rounds}) "
            f"| {off:.1f} | {on:.1f} | {on - off:.1f} | ≤ 15 |",
            f"| first start (fills the cache) | | {first:.1f} | | |",
        ]
    )
    write_results(RESULTS, "startup", report, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
