"""Side by side: one stack per checkout, all started at once, measured in alternation.

    .venv/bin/python bench/sidebyside.py --stack /tmp/before --stack . [--stack .:GOMP_SPINCOUNT=100000]

Each `--stack` is a checkout of tokenline (a `git worktree` of another commit, say), optionally followed
by `:NAME=VALUE,...` for its processes' environment (BENCH_THREADS and BENCH_PREFILL_THREADS set that
stack's worker threads; 0, the default, leaves them to a worker that chooses its own). Every stack
(Redis, one worker, the API, as `make bench` starts them) is started first; then each round measures
every stack in turn, at each level, with the stacks not being measured idle. Alternating short
measurements spreads the shared machine's drift over all stacks alike. The report gives, per level,
each stack's medians over the rounds, their ratio to the first stack's, and in how many rounds it beat
the first stack.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import LevelResult, run_level
from bench.run import chat_body, requests_per_client
from scripts import localstack

# Run in each checkout, so that the stack is that checkout's code: start it, print its URLs, then wait
# for the quiet checks the parent asks for, until stdin closes.
CHILD = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, ".")
from bench.run import running_stack, wait_quiet
model, logs = Path(sys.argv[1]), Path(sys.argv[2])
threads = int(os.environ.get("BENCH_THREADS", sys.argv[3]))
prefill_threads = int(os.environ.get("BENCH_PREFILL_THREADS", sys.argv[4]))
logs.mkdir(parents=True, exist_ok=True)
with running_stack(model, [64], logs, threads, prefill_threads, 2) as (url, redis_url):
    print("URLS " + json.dumps([url, redis_url]), flush=True)
    for line in sys.stdin:
        wait_quiet(redis_url)
        print("QUIET", flush=True)
"""


class Stack:
    def __init__(self, spec: str, index: int, args: argparse.Namespace) -> None:
        tree, _, env = spec.partition(":")
        self.label = spec
        self.env = dict(item.split("=", 1) for item in env.split(",") if item)
        command = [sys.executable, "-c", CHILD, str(args.model.resolve()), str(args.logs / f"stack-{index}")]
        command += [str(args.worker_threads), str(args.worker_prefill_threads)]
        self.proc = subprocess.Popen(
            command,
            cwd=tree,
            env={**os.environ, **self.env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = ""

    def wait_started(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("URLS "):
                self.url = json.loads(line[5:])[0]
                return
        raise RuntimeError(f"the stack of {self.label} did not start (exit {self.proc.wait()})")

    def wait_quiet(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("quiet\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "QUIET":
            raise RuntimeError(f"the stack of {self.label} stopped")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            localstack.stop(self.proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="append", required=True, help="CHECKOUT[:NAME=VALUE,...]; twice or more")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, default=localstack.ROOT / "models" / "demo")
    parser.add_argument("--worker-threads", type=int, default=0)
    parser.add_argument("--worker-prefill-threads", type=int, default=0)
    parser.add_argument("--logs", type=Path, default=localstack.ROOT / "bench" / "results" / "logs" / "sidebyside")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    stacks = [Stack(spec, i, args) for i, spec in enumerate(args.stack)]
    results: dict[tuple[int, int], list[LevelResult]] = {(i, c): [] for i in range(len(stacks)) for c in levels}
    body = chat_body("bench", args.max_tokens)
    try:
        for stack in stacks:
            stack.wait_started()
            asyncio.run(run_level(stack.url, {**body, "max_tokens": 4}, 1, 4))  # warm-up
        for number in range(args.rounds):
            order = range(len(stacks)) if number % 2 == 0 else reversed(range(len(stacks)))
            for index in list(order):
                for concurrency in levels:
                    stacks[index].wait_quiet()
                    result = asyncio.run(
                        run_level(stacks[index].url, body, concurrency, requests_per_client(concurrency))
                    )
                    results[(index, concurrency)].append(result)
            print(f"round {number + 1}/{args.rounds} done", flush=True)
    finally:
        for stack in stacks:
            stack.stop()
    print(report(stacks, levels, results))
    return 0


def report(stacks: list[Stack], levels: list[int], results: dict[tuple[int, int], list[LevelResult]]) -> str:
    lines = [
        "| stack | concurrency | tok/s median | / first | TTFT median ms | rounds with more tok/s than the first "
        "| rounds with a lower TTFT than the first | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for concurrency in levels:
        first = results[(0, concurrency)]
        for index, stack in enumerate(stacks):
            runs = results[(index, concurrency)]
            faster = sum(r.tokens_per_s > f.tokens_per_s for r, f in zip(runs, first, strict=True))
            sooner = sum(r.ttft_ms_median < f.ttft_ms_median for r, f in zip(runs, first, strict=True))
            wins = ("", "") if index == 0 else (f"{faster}/{len(runs)}", f"{sooner}/{len(runs)}")
            rate = statistics.median(r.tokens_per_s for r in runs)
            base = statistics.median(r.tokens_per_s for r in first)
            lines.append(
                f"| {stack.label} | {concurrency} | {rate:.1f} | {rate / base:.2f} "
                f"| {statistics.median(r.ttft_ms_median for r in runs):.2f} | {wins[0]} | {wins[1]} "
                f"| {sum(r.errors for r in runs)} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
