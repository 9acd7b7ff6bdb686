"""`make bench`: the full stack against the in-process ceiling and a peer, side by side in one run.

In each of `--rounds` rounds (default 5), back to back:
1. In-process ceiling: `generate()` on the model at batch 1/4/16 (tokens/s) and its time to first token.
2. The full stack (Redis, one worker with maxBatchSize 64, gunicorn) at concurrency 1/4/16/64.
3. In 9 turns: a short request on a quiet server, then the same request right after 16 clients hang up
   mid-stream (medians of the 9 of each).
4. The peer, `transformers serve --continuous-batching`, on the same model directory at 1/4/16.
All requests: the same chat prompt, greedy, `max_tokens` output tokens with EOS ignored. The report
gives medians over the rounds.
Writes bench/results/latest.{md,json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import ceiling
from bench.load import LevelResult, disconnect_then_probe, run_level
from scripts import localstack

RESULTS = localstack.ROOT / "bench" / "results"
# A single turn's ratio (after / idle) ranged 0.77-1.71 in 24 turns on the shared 2-core machine, and a
# round's median of 5 turns 0.87-1.27 in two runs of `make bench`.
DISCONNECT_TURNS = 9
PROMPT = "Tell me about the Ascend NPU and how batching helps an inference server."


def chat_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def requests_per_client(concurrency: int) -> int:
    return max(2, 32 // concurrency)


def run_levels(url: str, body: dict[str, Any], levels: list[int]) -> list[LevelResult]:
    asyncio.run(run_level(url, {**body, "max_tokens": 4}, 1, 2))  # warm-up
    out = []
    for concurrency in levels:
        result = asyncio.run(run_level(url, body, concurrency, requests_per_client(concurrency)))
        print(
            f"  c={concurrency:<3} {result.tokens_per_s:8.1f} tok/s  ttft {result.ttft_ms_median:7.2f} ms  "
            f"tpot {result.tpot_ms_median:6.2f} ms  errors {result.errors}",
            flush=True,
        )
        out.append(result)
    return out


@contextmanager
def running_stack(
    model_dir: Path, levels: list[int], logs: Path, threads: int, prefill_threads: int, api_workers: int
) -> Iterator[tuple[str, str]]:
    """Redis, one worker (maxBatchSize = the highest level) and gunicorn; yields the chat URL and Redis' URL."""
    redis_port, port = localstack.free_port(), localstack.free_port()
    redis_proc = localstack.start_redis(redis_port, log=logs / "redis.log")
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = localstack.environment(
        MODEL_PATH=str(model_dir),
        MODEL_NAME="bench",
        REDIS_URL=redis_url,
        TOKENLINE_MAX_BATCH_SIZE=str(max(levels)),
        TOKENLINE_MAX_LINK_NUM="1000",
        TOKENLINE_LOG_LEVEL="WARNING",
        TOKENLINE_TORCH_THREADS=str(threads),
        TOKENLINE_PREFILL_THREADS=str(prefill_threads),
        TOKENLINE_DEVICE="cpu",
        WEB_CONCURRENCY=str(api_workers),
        GUNICORN_ACCESS_LOG="/dev/null",
    )
    worker = localstack.start_worker(env, "bench", log=logs / "worker.log")
    api = localstack.start_api(env, port, log=logs / "api.log")
    try:
        localstack.wait_for_api(port, api)
        localstack.wait_for(lambda: localstack.worker_count(redis_url, "bench") > 0, 120, "the worker")
        yield f"http://127.0.0.1:{port}/v1/chat/completions", redis_url
    finally:
        localstack.stop(api, worker, redis_proc)


def wait_quiet(redis_url: str, model: str = "bench") -> None:
    """Until no job of the model is queued or running, and every RQ slot of its workers is idle: the
    requests before have ended on the worker, RQ's bookkeeping of their jobs included (a cancelled
    request's job ends a second after the engine dropped it, workers/runtime.py)."""
    import redis
    from rq import Queue, Worker
    from rq.registry import StartedJobRegistry

    from schemas.keys import queue_name

    connection = redis.Redis.from_url(redis_url)
    try:
        queue = Queue(queue_name(model), connection=connection)
        started = StartedJobRegistry(queue=queue)

        def quiet() -> bool:
            if queue.count or started.get_job_count(cleanup=False):
                return False
            return all(w.get_state() != "busy" for w in Worker.all(connection=connection, queue=queue))

        localstack.wait_for(quiet, 60, "the worker to be idle")
    finally:
        connection.close()


def measure_stack(url: str, redis_url: str, max_tokens: int, levels: list[int]) -> dict[str, Any]:
    body = chat_body("bench", max_tokens)
    print("full stack:", flush=True)
    levels_out = run_levels(url, body, levels)
    # A short request on a quiet server, then right after 16 clients hang up mid-stream, in turns:
    # medians of DISCONNECT_TURNS of each.
    probe = chat_body("bench", 8)
    long_body = {**body, "max_tokens": 512}
    idle, after, errors = [], [], []
    for _ in range(DISCONNECT_TURNS):
        wait_quiet(redis_url)
        idle.append(asyncio.run(disconnect_then_probe(url, body, probe, 0, 0))[0])
        wait_quiet(redis_url)
        latency, turn_errors = asyncio.run(disconnect_then_probe(url, long_body, probe, 16, 4))
        after.append(latency)
        errors += turn_errors
    idle_ms, after_ms = statistics.median(idle), statistics.median(after)
    print(f"  short request: idle {idle_ms:.1f} ms, after 16 disconnects {after_ms:.1f} ms", flush=True)
    return {
        "levels": levels_out,
        "short_idle_ms": idle_ms,
        "short_after_disconnects_ms": after_ms,
        "disconnect_errors": errors,
    }


def measure_peer(model_dir: Path, max_tokens: int, levels: list[int], logs: Path) -> list[LevelResult]:
    """`transformers serve --continuous-batching`, started for its measurement and stopped after it."""
    port = localstack.free_port()
    cmd = [
        str(Path(sys.executable).parent / "transformers"),
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(logs / "peer.log", "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:

        def up() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        localstack.wait_for(up, 180, "transformers serve", interval=0.5)
        print("peer (transformers serve --continuous-batching):", flush=True)
        body = chat_body(str(model_dir), max_tokens)
        del body["ignore_eos"]  # the peer refuses the field; its usage counts what it generated
        return run_levels(f"http://127.0.0.1:{port}/v1/chat/completions", body, levels)
    finally:
        localstack.stop(proc)


def measure_inprocess(
    model: Any, prompt_ids: list[int], max_tokens: int, label: str = "in-process generate()"
) -> tuple[dict[int, float], float]:
    print(f"{label}:", flush=True)
    rates = {b: ceiling.tokens_per_second(model, prompt_ids, b, max_tokens) for b in (1, 4, 16)}
    ttft = ceiling.first_token_ms(model, prompt_ids)
    print(f"  {rates}  first token {ttft:.2f} ms", flush=True)
    return rates, ttft


def measure_inprocess_at(threads: int, model: Any, prompt_ids: list[int], max_tokens: int) -> dict[str, Any] | None:
    """The ceiling again with the worker's torch thread count, where that differs from the default: a
    diagnostic that separates the stack's own overhead from the cores the worker leaves to the others."""
    import torch

    default = torch.get_num_threads()
    if threads <= 0 or threads == default:
        return None
    torch.set_num_threads(threads)
    try:
        label = f"in-process generate(), {threads} torch thread(s)"
        rates, ttft = measure_inprocess(model, prompt_ids, max_tokens, label)
    finally:
        torch.set_num_threads(default)
    return {"threads": threads, "tokens_per_s": rates, "ttft_ms": ttft}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=localstack.ROOT / "models" / "demo")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--peer-levels", default="1,4,16")
    parser.add_argument("--no-peer", action="store_true")
    # Five: in four runs of three rounds on the shared 2-core machine, one round in four fell on a slow
    # phase (c=16 against batch 16 at 0.63-0.75 where the others gave 0.80-1.07).
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the report gives medians")
    parser.add_argument("--worker-threads", type=int, default=0, help="torch threads in the worker (0: default)")
    parser.add_argument(
        "--worker-prefill-threads",
        type=int,
        default=0,
        help="torch threads for the worker's prefills on an idle engine or of >= 64 tokens (0: as decode)",
    )
    parser.add_argument("--api-workers", type=int, default=2, help="gunicorn processes (deploy default: 2)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where latest.{md,json,png} go")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    peer_levels = [int(x) for x in args.peer_levels.split(",")]
    args.results.mkdir(parents=True, exist_ok=True)
    logs = args.results / "logs"
    logs.mkdir(exist_ok=True)

    model, _ = ceiling.load(args.model)
    from app.prompt import PromptBuilder
    from schemas.model_files import ModelFiles  # the same prompt ids the API builds
    from schemas.requests import Message

    prompts = PromptBuilder(ModelFiles(args.model))
    prompt_ids = prompts.encode(prompts.chat_prompt((Message("user", PROMPT),)), add_special_tokens=False)

    # Each round measures every system back to back, so that a ratio compares measurements minutes
    # apart at most; the machine is shared and its speed drifts. The report takes medians over rounds.
    rounds = []
    with running_stack(
        args.model, levels, logs, args.worker_threads, args.worker_prefill_threads, args.api_workers
    ) as (url, redis_url):
        for number in range(1, args.rounds + 1):
            print(f"=== round {number}/{args.rounds}", flush=True)
            inproc, inproc_ttft = measure_inprocess(model, prompt_ids, args.max_tokens)
            same = measure_inprocess_at(args.worker_threads, model, prompt_ids, args.max_tokens)
            stack = measure_stack(url, redis_url, args.max_tokens, levels)
            peer = [] if args.no_peer else measure_peer(args.model, args.max_tokens, peer_levels, logs)
            rounds.append(round_report(inproc, inproc_ttft, stack, peer, same))
    report = build_report(args, len(prompt_ids), rounds)
    (args.results / "latest.json").write_text(json.dumps(report, indent=2))
    (args.results / "latest.md").write_text(markdown(report))
    plot(report, args.results / "latest.png")
    print(markdown(report))
    return 0


def round_report(
    inproc: dict[int, float],
    inproc_ttft: float,
    stack: dict[str, Any],
    peer: list[LevelResult],
    same: dict[str, Any] | None = None,
) -> dict[str, Any]:
    by_c = {r.concurrency: r for r in stack["levels"]}
    peer_by_c = {r.concurrency: r for r in peer}
    ratios = {
        "c1_vs_inprocess_b1": by_c[1].tokens_per_s / inproc[1] if 1 in by_c else None,
        "c16_vs_inprocess_b16": by_c[16].tokens_per_s / inproc[16] if 16 in by_c else None,
        "c16_vs_peer_c16": (by_c[16].tokens_per_s / peer_by_c[16].tokens_per_s)
        if 16 in by_c and 16 in peer_by_c
        else None,
        "added_ttft_ms_c1": by_c[1].ttft_ms_median - inproc_ttft if 1 in by_c else None,
        "c64_errors": by_c[64].errors if 64 in by_c else None,
        "short_after_disconnects_vs_idle": stack["short_after_disconnects_ms"] / stack["short_idle_ms"],
    }
    if same is not None:  # diagnostics against the ceiling at the worker's own thread count
        rates = same["tokens_per_s"]
        ratios["c1_vs_inprocess_b1_same_threads"] = by_c[1].tokens_per_s / rates[1] if 1 in by_c else None
        ratios["c16_vs_inprocess_b16_same_threads"] = by_c[16].tokens_per_s / rates[16] if 16 in by_c else None
        ratios["added_ttft_ms_c1_same_threads"] = by_c[1].ttft_ms_median - same["ttft_ms"] if 1 in by_c else None
    return {
        "inprocess_tokens_per_s": inproc,
        "inprocess_ttft_ms": inproc_ttft,
        "inprocess_same_threads": same,
        "stack": [r.to_dict() for r in stack["levels"]],
        "peer": [r.to_dict() for r in peer],
        "short_idle_ms": stack["short_idle_ms"],
        "short_after_disconnects_ms": stack["short_after_disconnects_ms"],
        "disconnect_errors": stack["disconnect_errors"],
        "ratios": ratios,
    }


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _median_same_threads(rounds: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [r for r in rounds if r is not None]
    if not present:
        return None
    return {
        "threads": present[0]["threads"],
        "tokens_per_s": {b: _median([r["tokens_per_s"][b] for r in present]) for b in present[0]["tokens_per_s"]},
        "ttft_ms": _median([r["ttft_ms"] for r in present]),
    }


def _median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per concurrency level, the median of each field over the rounds (errors: the sum)."""
    rows = []
    for level_rows in zip(*rounds, strict=True):
        row = {key: _median([r[key] for r in level_rows]) for key in level_rows[0]}
        row["errors"] = sum(r["errors"] for r in level_rows)
        row["concurrency"] = level_rows[0]["concurrency"]
        rows.append(row)
    return rows


def build_report(args: argparse.Namespace, prompt_tokens: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds; each ratio is the median of the per-round ratios (pairs measured together)."""
    ratios = {key: _median([r["ratios"][key] for r in rounds]) for key in rounds[0]["ratios"]}
    ratios["c64_errors"] = sum(r["ratios"]["c64_errors"] or 0 for r in rounds)
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "model": str(args.model.name),
        "prompt_tokens": prompt_tokens,
        "max_tokens": args.max_tokens,
        "rounds": len(rounds),
        "worker_threads": args.worker_threads,
        "worker_prefill_threads": args.worker_prefill_threads,
        "api_workers": args.api_workers,
        "inprocess_tokens_per_s": {
            b: _median([r["inprocess_tokens_per_s"][b] for r in rounds]) for b in rounds[0]["inprocess_tokens_per_s"]
        },
        "inprocess_ttft_ms": _median([r["inprocess_ttft_ms"] for r in rounds]),
        "inprocess_same_threads": _median_same_threads([r["inprocess_same_threads"] for r in rounds]),
        "stack": _median_rows([r["stack"] for r in rounds]),
        "peer": _median_rows([r["peer"] for r in rounds]) if rounds[0]["peer"] else [],
        "short_idle_ms": _median([r["short_idle_ms"] for r in rounds]),
        "short_after_disconnects_ms": _median([r["short_after_disconnects_ms"] for r in rounds]),
        "disconnect_errors": [e for r in rounds for e in r["disconnect_errors"]],
        "ratios": ratios,
        "per_round_ratios": [r["ratios"] for r in rounds],
    }


def markdown(report: dict[str, Any]) -> str:
    r = report["ratios"]

    def fmt(value: float | None, spec: str = ".2f") -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"Benchmark of {report['when']} on {report['machine']}; model `{report['model']}`, "
        f"{report['prompt_tokens']} prompt tokens, {report['max_tokens']} output tokens, greedy; "
        f"worker torch threads {report['worker_threads'] or 'default'} "
        f"(prefills on an idle engine or of >= 64 tokens {report.get('worker_prefill_threads') or 'the same'}), "
        f"{report['api_workers']} API processes. "
        f"Medians over {report['rounds']} rounds; "
        "in each round every system ran back to back, and each ratio is the median of its per-round ratios.",
        "",
        "| system | concurrency / batch | output tok/s | TTFT median ms | TPOT median ms | ITL p90 ms "
        "| e2e median ms | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch, rate in report["inprocess_tokens_per_s"].items():
        ttft = fmt(report["inprocess_ttft_ms"]) if int(batch) == 1 else ""
        lines.append(f"| in-process generate() | {batch} | {rate:.1f} | {ttft} | | | | |")
    same = report.get("inprocess_same_threads")
    if same:
        for batch, rate in same["tokens_per_s"].items():
            ttft = fmt(same["ttft_ms"]) if int(batch) == 1 else ""
            name = f"in-process generate(), {same['threads']} thread(s)"
            lines.append(f"| {name} | {batch} | {rate:.1f} | {ttft} | | | | |")
    for name, rows in (("tokenline (full stack)", report["stack"]), ("transformers serve --cb", report["peer"])):
        for row in rows:
            lines.append(
                f"| {name} | {row['concurrency']} | {row['tokens_per_s']:.1f} | {row['ttft_ms_median']:.2f} | "
                f"{row['tpot_ms_median']:.2f} | {row['itl_ms_p90']:.2f} | {row['e2e_ms_median']:.1f} | "
                f"{row['errors']} |"
            )
    lines += [
        "",
        "| target | measured | goal |",
        "| --- | --- | --- |",
        f"| stack c=1 / in-process batch 1 tokens/s | {fmt(r['c1_vs_inprocess_b1'])} | ≥ 0.85 |",
        f"| stack c=16 / in-process batch 16 tokens/s | {fmt(r['c16_vs_inprocess_b16'])} | ≥ 0.80 |",
        f"| stack c=16 / peer c=16 tokens/s | {fmt(r['c16_vs_peer_c16'])} | ≥ 1.30 |",
        f"| added TTFT at c=1 (stack − in-process), ms | {fmt(r['added_ttft_ms_c1'])} | ≤ 3 |",
        f"| errors among 64 concurrent streams | {'n/a' if r['c64_errors'] is None else r['c64_errors']} | 0 |",
        f"| short request after 16 disconnects / idle | {fmt(r['short_after_disconnects_vs_idle'])} "
        f"({report['short_after_disconnects_ms']:.1f} / {report['short_idle_ms']:.1f} ms) | ≈ 1 |",
    ]
    if same:
        lines += [
            "",
            f"Diagnostic, not a target: against the in-process ceiling at the worker's {same['threads']} torch "
            f"thread(s), the stack reaches {fmt(r.get('c1_vs_inprocess_b1_same_threads'))} at c=1 and "
            f"{fmt(r.get('c16_vs_inprocess_b16_same_threads'))} at c=16, and adds "
            f"{fmt(r.get('added_ttft_ms_c1_same_threads'))} ms to the first token at c=1.",
        ]
    lines += [
        "",
        "| round | c1 / b1 | c16 / b16 | c16 / peer | added TTFT ms | short after disconnects / idle |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for number, q in enumerate(report["per_round_ratios"], 1):
        lines.append(
            f"| {number} | {fmt(q['c1_vs_inprocess_b1'])} | {fmt(q['c16_vs_inprocess_b16'])} | "
            f"{fmt(q['c16_vs_peer_c16'])} | {fmt(q['added_ttft_ms_c1'])} | "
            f"{fmt(q['short_after_disconnects_vs_idle'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in (("tokenline", report["stack"]), ("transformers serve --cb", report["peer"])):
        if rows:
            ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=name)
    inproc = report["inprocess_tokens_per_s"]
    ax.plot([int(b) for b in inproc], list(inproc.values()), marker="s", linestyle="--", label="in-process generate()")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams (batch size for in-process)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{report['model']}, {report['max_tokens']} output tokens, {report['machine']}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
