"""`make bench`: the full stack against the in-process ceiling and a peer, side by side in one run.

The stack runs as `make run` starts it (the worker chooses its own thread counts). In each of
`--rounds` rounds (default 5), back to back:
1. In-process ceiling: tokenline's own engine core in this process (bench/ceiling.py) at batch
   1/4/16 (tokens/s) and its time to first token.
2. The full stack (Redis, one worker with maxBatchSize 64, gunicorn) at concurrency 1/4/16/64.
3. In 9 turns: a short request on a quiet server, then the same request right after 16 clients hang up
   mid-stream (medians of the 9 of each).
4. Sampling: a second stack on a 32,000-token random Llama, 16 streams greedy, then 16 streams with
   temperature 0.8, top_p 0.9, top_k 50 and a repetition penalty of 1.1.
5. The peer, `transformers serve --continuous-batching`, on the same model directory at 1/4/16, with
   the worker's torch thread count and OpenMP spin.
6. Real weights: a third stack on SmolLM2-135M-Instruct (scripts/real_models.py) at concurrency 1 and
   16, beside the engine in-process at batch 1 on the same weights.
All requests but (4)'s sampled ones: the same chat prompt, greedy, `max_tokens` output tokens with EOS
ignored. The report gives medians over the rounds. Then, once, the KV-memory workloads (bench/kv.py:
prefix reuse, a long prompt entering beside 8 streams, 12 long requests under a small pool, and the
pool's waste). Writes bench/results/latest.{md,json,png}; `--kv-only` runs only the KV workloads.

`--ab REV` instead measures this checkout against commit REV side by side (bench/sidebyside.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from bench import ceiling, kv
from bench.load import LevelResult, disconnect_then_probe, run_level
from scripts import localstack, real_models
from scripts.run_local import START_SECONDS

RESULTS = localstack.ROOT / "bench" / "results"
# A single turn's ratio (after / idle) ranged 0.77-1.71 in 24 turns on the shared 2-core machine, and a
# round's median of 5 turns 0.87-1.27 in two runs of `make bench`.
DISCONNECT_TURNS = 9
PROMPT = "Tell me about the Ascend NPU and how batching helps an inference server."


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
VOCAB_MODEL = localstack.ROOT / "models" / "bench-v32000"


def write_results(directory: Path, name: str, report: dict[str, Any], table: str) -> None:
    """`report` as <name>.json and its table as <name>.md in `directory`; the table printed."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(report, indent=2))
    (directory / f"{name}.md").write_text(table + "\n")
    print(table)


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


def vocab_model() -> Path:
    """A demo-like random Llama with a 32,000-token vocabulary (built once)."""
    if not (VOCAB_MODEL / "config.json").is_file():
        from scripts.build_demo_model import main as build

        build([str(VOCAB_MODEL), "--model-vocab-size", "32000"])
    return VOCAB_MODEL


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
    model_dir: Path,
    levels: list[int],
    logs: Path,
    threads: int = 0,
    prefill_threads: int = 0,
    api_workers: int = 2,
    env: dict[str, str] | None = None,
    workers: int = 1,
    procs: list[Any] | None = None,
) -> Iterator[tuple[str, str]]:
    """Redis, one worker (maxBatchSize = the highest level; `workers` of them, started as extra workers
    are started by hand, each `python -m workers`) and gunicorn; yields the chat URL and Redis' URL.
    Thread counts of 0 leave them to the worker, as `make run` does; `env` adds settings; the worker
    processes are added to `procs`."""
    logs.mkdir(parents=True, exist_ok=True)
    redis_port, port = localstack.free_port(), localstack.free_port()
    redis_proc = localstack.start_redis(redis_port, log=logs / "redis.log")
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    threads_env = {"TOKENLINE_TORCH_THREADS": str(threads)} if threads else {}
    threads_env |= {"TOKENLINE_PREFILL_THREADS": str(prefill_threads)} if prefill_threads else {}
    extra = env or {}
    env = localstack.environment(
        MODEL_PATH=str(model_dir),
        MODEL_NAME="bench",
        REDIS_URL=redis_url,
        TOKENLINE_MAX_BATCH_SIZE=str(max(levels)),
        TOKENLINE_MAX_LINK_NUM="1000",
        TOKENLINE_LOG_LEVEL="WARNING",
        TOKENLINE_DEVICE="cpu",
        WEB_CONCURRENCY=str(api_workers),
        GUNICORN_ACCESS_LOG="/dev/null",
        **threads_env,
        **extra,
    )
    started = [localstack.start_worker(env, "bench", log=logs / f"worker{i or ''}.log") for i in range(workers)]
    if procs is not None:
        procs.extend(started)
    api = localstack.start_api(env, port, log=logs / "api.log")
    try:
        localstack.wait_for_api(port, api)
        # As long as `make run` gives a worker to start: a compiled one's first start fills the cache.
        localstack.wait_for(
            lambda: localstack.worker_count(redis_url, "bench") >= workers, START_SECONDS, "the workers"
        )
        yield f"http://127.0.0.1:{port}/v1/chat/completions", redis_url
    finally:
        localstack.stop(api, *started, redis_proc)


def wait_quiet(redis_url: str, model: str = "bench") -> None:
    """Until no job of the model is queued or running and its RQ workers are idle: the requests before
    have ended on the worker, RQ's bookkeeping of their jobs included."""
    import redis
    from rq import Queue, Worker
    from rq.registry import StartedJobRegistry

    from schemas.keys import queue_name, queue_owner

    connection = redis.Redis.from_url(redis_url)
    try:
        shared = queue_name(model)

        def quiet() -> bool:
            # The shared queue and the workers' own (app/routing.py).
            queues = [q for q in Queue.all(connection=connection) if queue_owner(q.name)[0] == shared]
            if any(q.count or StartedJobRegistry(queue=q).get_job_count(cleanup=False) for q in queues):
                return False
            workers = Worker.all(connection=connection)
            return all(w.get_state() != "busy" for w in workers if shared in w.queue_names())

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
    import torch

    from workers.models.runner import default_threads
    from workers.serving.main import GOMP_SPIN_COUNT

    # The worker's decode thread count and OpenMP spin, as the worker chooses them on this machine.
    threads = default_threads(torch.device("cpu"))[0]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads), "GOMP_SPINCOUNT": GOMP_SPIN_COUNT}
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


def measure_inprocess(loaded: Any, prompt_ids: list[int], max_tokens: int) -> tuple[dict[int, float], float]:
    print("in-process engine:", flush=True)
    rates = {b: ceiling.tokens_per_second(loaded, prompt_ids, b, max_tokens) for b in (1, 4, 16)}
    ttft = ceiling.first_token_ms(loaded, prompt_ids)
    print(f"  {rates}  first token {ttft:.2f} ms", flush=True)
    return rates, ttft


def measure_sampling(url: str, redis_url: str, max_tokens: int) -> dict[str, float]:
    """16 streams greedy, then 16 with SAMPLED parameters, on the 32,000-token model's stack."""
    print("sampling (vocabulary 32,000, 16 streams):", flush=True)
    greedy = chat_body("bench", max_tokens)
    out = {}
    for name, body in (("greedy", greedy), ("sampled", {**greedy, **SAMPLED})):
        wait_quiet(redis_url)
        out[name] = asyncio.run(run_level(url, body, 16, requests_per_client(16))).tokens_per_s
    out["ratio"] = out["sampled"] / out["greedy"]
    print(f"  greedy {out['greedy']:.1f} tok/s, sampled {out['sampled']:.1f} tok/s", flush=True)
    return out


def measure_real(loaded: Any, prompt_ids: list[int], url: str, max_tokens: int) -> dict[str, Any]:
    """SmolLM2's real weights: the engine in-process at batch 1 and the stack at concurrency 1 and 16."""
    print("real weights (SmolLM2-135M-Instruct):", flush=True)
    inproc = ceiling.tokens_per_second(loaded, prompt_ids, 1, max_tokens, repeats=1)
    print(f"  in-process batch 1: {inproc:.1f} tok/s", flush=True)
    levels = run_levels(url, chat_body("bench", max_tokens), [1, 16])
    return {"inprocess_b1": inproc, "stack": [r.to_dict() for r in levels]}


def ab(args: argparse.Namespace) -> int:
    """This checkout against commit `args.ab`, side by side (bench/sidebyside.py), in a git worktree."""
    from bench import sidebyside

    tree = localstack.ROOT / ".run" / f"ab-{args.ab}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.ab], cwd=localstack.ROOT, check=True)
    baseline = f"{tree}:{args.ab_env}" if args.ab_env else str(tree)
    return sidebyside.main(
        [
            *("--stack", baseline, "--stack", str(localstack.ROOT), "--rounds", str(args.ab_rounds)),
            *("--levels", args.levels, "--max-tokens", str(args.max_tokens), "--model", str(args.model)),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=localstack.ROOT / "models" / "demo")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--peer-levels", default="1,4,16")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--no-real", action="store_true", help="skip the real-weights (SmolLM2) stack")
    # Five: in four runs of three rounds on the shared 2-core machine, one round in four fell on a slow
    # phase (c=16 against batch 16 at 0.63-0.75 where the others gave 0.80-1.07).
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the report gives medians")
    parser.add_argument("--api-workers", type=int, default=2, help="gunicorn processes (deploy default: 2)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where latest.{md,json,png} go")
    parser.add_argument("--ab", metavar="REV", help="measure this checkout against commit REV instead")
    parser.add_argument("--kv-only", action="store_true", help="only the KV-memory workloads (bench/kv.py)")
    parser.add_argument("--ab-rounds", type=int, default=3)
    parser.add_argument(
        "--ab-env",
        default="",
        help="NAME=VALUE,... for the baseline's processes (BENCH_THREADS and BENCH_PREFILL_THREADS: its "
        "worker's torch threads)",
    )
    args = parser.parse_args(argv)
    if args.ab:
        return ab(args)
    levels = [int(x) for x in args.levels.split(",")]
    peer_levels = [int(x) for x in args.peer_levels.split(",")]
    args.results.mkdir(parents=True, exist_ok=True)
    logs = args.results / "logs"
    logs.mkdir(exist_ok=True)

    loaded = ceiling.load(args.model)
    if args.kv_only:
        report = kv.measure(args.model, logs, running_stack, loaded)
        (args.results / "kv.json").write_text(json.dumps(report, indent=2))
        print("\n".join(kv.rows(report)))
        return 0
    prompt_ids = chat_prompt_ids(args.model)
    real_model = None if args.no_real else real_models.smollm2()
    real_loaded = ceiling.load(real_model) if real_model else None
    real_ids = chat_prompt_ids(real_model) if real_model else []

    # Each round measures every system back to back, so that a ratio compares measurements minutes
    # apart at most; the machine is shared and its speed drifts. The report takes medians over rounds.
    rounds = []
    with (
        running_stack(args.model, levels, logs, api_workers=args.api_workers) as (url, redis_url),
        running_stack(vocab_model(), [16], logs / "v32000", api_workers=args.api_workers) as (vocab_url, vocab_redis),
        running_stack(real_model, [16], logs / "smollm2", api_workers=args.api_workers)
        if real_model
        else contextlib.nullcontext(("", "")) as (real_url, _),
    ):
        for number in range(1, args.rounds + 1):
            print(f"=== round {number}/{args.rounds}", flush=True)
            inproc, inproc_ttft = measure_inprocess(loaded, prompt_ids, args.max_tokens)
            stack = measure_stack(url, redis_url, args.max_tokens, levels)
            sampling = measure_sampling(vocab_url, vocab_redis, args.max_tokens)
            peer = [] if args.no_peer else measure_peer(args.model, args.max_tokens, peer_levels, logs)
            real = measure_real(real_loaded, real_ids, real_url, args.max_tokens) if real_model else None
            rounds.append(round_report(inproc, inproc_ttft, stack, peer, sampling, real))
    report = build_report(args, len(prompt_ids), rounds)
    report["kv"] = kv.measure(args.model, logs, running_stack, loaded)
    (args.results / "latest.json").write_text(json.dumps(report, indent=2))
    (args.results / "latest.md").write_text(markdown(report))
    plot(report, args.results / "latest.png")
    print(markdown(report))
    return 0


def chat_prompt_ids(model: Path) -> list[int]:
    """PROMPT as the API renders and encodes it for `model`."""
    from app.prompt import PromptBuilder
    from schemas.chat import Message
    from schemas.model_files import ModelFiles

    prompts = PromptBuilder(ModelFiles.of(model))
    return prompts.encode(prompts.chat_prompt((Message("user", PROMPT),)), add_special_tokens=False)


def round_report(
    inproc: dict[int, float],
    inproc_ttft: float,
    stack: dict[str, Any],
    peer: list[LevelResult],
    sampling: dict[str, float],
    real: dict[str, Any] | None = None,
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
        "sampled_vs_greedy_v32000_c16": sampling["ratio"],
        "real_c1_vs_inprocess_b1": real["stack"][0]["tokens_per_s"] / real["inprocess_b1"] if real else None,
    }
    return {
        "real_weights": real,
        "inprocess_tokens_per_s": inproc,
        "inprocess_ttft_ms": inproc_ttft,
        "sampling_v32000_c16": sampling,
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
        "worker_threads": "the worker's own (make run's defaults)",
        "api_workers": args.api_workers,
        "inprocess_tokens_per_s": {
            b: _median([r["inprocess_tokens_per_s"][b] for r in rounds]) for b in rounds[0]["inprocess_tokens_per_s"]
        },
        "inprocess_ttft_ms": _median([r["inprocess_ttft_ms"] for r in rounds]),
        "sampling_v32000_c16": {
            key: _median([r["sampling_v32000_c16"][key] for r in rounds]) for key in ("greedy", "sampled", "ratio")
        },
        "stack": _median_rows([r["stack"] for r in rounds]),
        "peer": _median_rows([r["peer"] for r in rounds]) if rounds[0]["peer"] else [],
        "short_idle_ms": _median([r["short_idle_ms"] for r in rounds]),
        "short_after_disconnects_ms": _median([r["short_after_disconnects_ms"] for r in rounds]),
        "disconnect_errors": [e for r in rounds for e in r["disconnect_errors"]],
        "ratios": ratios,
        "per_round_ratios": [r["ratios"] for r in rounds],
        "real_weights": {
            "inprocess_b1": _median([r["real_weights"]["inprocess_b1"] for r in rounds]),
            "stack": _median_rows([r["real_weights"]["stack"] for r in rounds]),
        }
        if rounds[0]["real_weights"]
        else None,
    }


def markdown(report: dict[str, Any]) -> str:
    r = report["ratios"]

    def fmt(value: float | None, spec: str = ".2f") -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"Benchmark of {report['when']} on {report['machine']}; model `{report['model']}`, "
        f"{report['prompt_tokens']} prompt tokens, {report['max_tokens']} output tokens, greedy; "
        f"the worker's own thread counts (make run's defaults), {report['api_workers']} API processes. "
        f"Medians over {report['rounds']} rounds; "
        "in each round every system ran back to back, and each ratio is the median of its per-round ratios.",
        "",
        "| system | concurrency / batch | output tok/s | TTFT median ms | TPOT median ms | ITL p90 ms "
        "| e2e median ms | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch, rate in report["inprocess_tokens_per_s"].items():
        ttft = fmt(report["inprocess_ttft_ms"]) if int(batch) == 1 else ""
        lines.append(f"| in-process engine | {batch} | {rate:.1f} | {ttft} | | | | |")
    real = report.get("real_weights")
    if real:
        lines.append(f"| SmolLM2-135M real weights, in-process engine | 1 | {real['inprocess_b1']:.1f} | | | | | |")
    for name, rows in (
        ("tokenline (full stack)", report["stack"]),
        ("transformers serve --cb", report["peer"]),
        ("SmolLM2-135M real weights, full stack", real["stack"] if real else []),
    ):
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
        f"| vocabulary 32,000, c=16: sampled / greedy tokens/s | {fmt(r['sampled_vs_greedy_v32000_c16'])} "
        f"({report['sampling_v32000_c16']['sampled']:.1f} / {report['sampling_v32000_c16']['greedy']:.1f}) "
        "| ≥ 0.80 |",
        f"| SmolLM2 real weights: stack c=1 / in-process batch 1 tokens/s | {fmt(r.get('real_c1_vs_inprocess_b1'))} "
        "| ≥ 0.85 |",
    ]
    if "kv" in report:
        lines += kv.rows(report["kv"])
    lines += [
        "",
        "| round | c1 / b1 | c16 / b16 | c16 / peer | added TTFT ms | short after disconnects / idle "
        "| sampled / greedy | SmolLM2 c1 / b1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for number, q in enumerate(report["per_round_ratios"], 1):
        lines.append(
            f"| {number} | {fmt(q['c1_vs_inprocess_b1'])} | {fmt(q['c16_vs_inprocess_b16'])} | "
            f"{fmt(q['c16_vs_peer_c16'])} | {fmt(q['added_ttft_ms_c1'])} | "
            f"{fmt(q['short_after_disconnects_vs_idle'])} | {fmt(q['sampled_vs_greedy_v32000_c16'])} | "
            f"{fmt(q.get('real_c1_vs_inprocess_b1'))} |"
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
    ax.plot([int(b) for b in inproc], list(inproc.values()), marker="s", linestyle="--", label="in-process engine")
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
