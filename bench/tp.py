"""What tensor parallelism costs and gives per decode step: the engine core at TP=1 and TP=2 (two
ranks joined by torch.distributed), decoding at batch 1 and 16, alternating configurations, medians.

`python bench/tp.py` (`make bench-tp`). Configurations, each its own processes, in turn every round:
- tp1x1: one process, one thread: one "device" of the host;
- tp2:   two ranks, one thread each: two "devices", the step messages and the collectives between them;
- tp1x2: one process, two threads: the same two cores without a group (torch's own parallelism).
With `--compile`, two more, their decode steps compiled (`compile: on`; each rank compiles its own,
the collectives in its graph): tp1c (one process, one thread) and tp2c (two ranks).
Models: the demo model (6M parameters: a step is mostly overhead, so the collectives' cost shows
plainly) and a wider one (hidden 1024, 8 layers, ~110M parameters: a step is mostly matrix products).
On an accelerator (`--device cuda` / `npu`), tp2 runs on two devices and tp1 on one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from workers.engine.core import CacheConfig, EngineCore
from workers.models.loader import LoadedModel, load_model
from workers.models.parallel import Collective, GroupSpec, follow, join_group
from workers.models.runner import make_runner

ROOT = Path(__file__).resolve().parent.parent
PROMPT = tuple(range(10, 42))
BATCHES = (1, 16)
STEPS = 40
# name: (ranks, threads per rank, `compile`)
CONFIGS = {"tp1x1": (1, 1, "off"), "tp2": (2, 1, "off"), "tp1x2": (1, 2, "off")}


def measure(loaded: LoadedModel, threads: int, collective: Collective | None, cache: CacheConfig) -> dict[str, float]:
    """Rank 0: the median decode step (ms) at each batch size."""
    engine = EngineCore.build(loaded, 2048, max(BATCHES), threads, threads, cache=cache, collective=collective)
    ids = itertools.count()
    medians = {}
    for batch in BATCHES:
        for _ in range(batch):
            sampling = SamplingParams(max_tokens=STEPS * 3, temperature=0.0, ignore_eos=True)
            engine.add_request(JobPayload(f"r{next(ids)}", "bench", PROMPT, sampling, "ch"))
        while engine.scheduler.waiting or any(not r.sequences[0].output_ids for r in engine.requests.values()):
            engine.step()
        times = []
        for _ in range(STEPS):
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        medians[f"b{batch}"] = statistics.median(times) * 1000
        for request_id in list(engine.requests):
            engine.cancel(request_id)
    if engine.runner.group is not None:
        engine.runner.group.stop()  # type: ignore[attr-defined]
    return medians


def rank_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device == "cpu" else f"{args.device}:{args.rank}")
    cache = CacheConfig(compile=args.compile)
    if args.world == 1:
        print(json.dumps(measure(load_model(args.model, device, "float32"), args.threads, None, cache)), flush=True)
        return 0
    spec = GroupSpec(args.rank, args.world, args.address, timeout=120)
    collective, loaded = join_group(spec, device, args.model, "float32")
    if args.rank:
        runner = make_runner(loaded, 2048, max(BATCHES), cache.pool, args.threads, args.threads, collective)
        follow(runner, collective)
    else:
        print(json.dumps(measure(loaded, args.threads, collective, cache)), flush=True)
    return 0


def run_config(model: Path, ranks: int, threads: int, compile: str, device: str) -> dict[str, float]:
    address = f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, __file__, "--rank-of", str(model), "--world", str(ranks), "--threads", str(threads)]
    command += ["--address", address, "--device", device, "--compile", compile]
    procs = [
        subprocess.Popen([*command, "--rank", str(r)], stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL)
        for r in range(ranks)
    ]
    out, _ = procs[0].communicate(timeout=600)
    for proc in procs[1:]:
        proc.wait(60)
    return json.loads(out.decode().strip().splitlines()[-1])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu (tp2 takes devices 0 and 1)")
    parser.add_argument("--rank-of", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compile", nargs="?", const="on", default="off", help="also the compiled steps (tp1c, tp2c)")
    args = parser.parse_args()
    if args.rank_of is not None:
        args.model = args.rank_of
        return rank_main(args)
    configs = CONFIGS if args.device == "cpu" else {"tp1": (1, 0, "off"), "tp2": (2, 0, "off")}
    if args.compile == "on":
        threads = 1 if args.device == "cpu" else 0
        configs = configs | {"tp1c": (1, threads, "on"), "tp2c": (2, threads, "on")}
    with tempfile.TemporaryDirectory() as scratch:
        wide = Path(scratch) / "wide"
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts/build_demo_model.py"),
                str(wide),
                "--hidden-size",
                "1024",
                "--layers",
                "8",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for name, model in (("demo", ROOT / "models/demo"), ("wide", wide)):
            results: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
            for _ in range(args.rounds):
                for config, (ranks, threads, compile) in configs.items():
                    results[config].append(run_config(model, ranks, threads, compile, args.device))
            report(name, results)
    return 0


def report(model: str, results: dict[str, list[dict[str, float]]]) -> None:
    base = "tp1x1" if "tp1x1" in results else "tp1"
    print(f"\n{model}: median decode step, ms (range over rounds)")
    compiled = "tp2c" in results
    print(
        "| batch | " + " | ".join(results) + " | tp2 / " + base + " |" + (f" tp1c / {base} | tp2c / tp2 |" * compiled)
    )
    print("| --- " * (len(results) + 2 + 2 * compiled) + "|")
    for batch in (f"b{b}" for b in BATCHES):
        cells = []
        medians = {}
        for config, rounds in results.items():
            values = [r[batch] for r in rounds]
            medians[config] = statistics.median(values)
            cells.append(f"{medians[config]:.2f} ({min(values):.2f}–{max(values):.2f})")
        ratios = [medians["tp2"] / medians[base]]
        if compiled:
            ratios += [medians["tp1c"] / medians[base], medians["tp2c"] / medians["tp2"]]
        print(f"| {batch[1:]} | " + " | ".join(cells) + "".join(f" | {r:.2f}" for r in ratios) + " |")


if __name__ == "__main__":
    sys.exit(main())
