"""`make bench-routing`: routing by cache over three workers (app/routing.py), over HTTP, on stacks
started as `make run` starts them with the extra workers started as by hand (`python -m workers`).

1. Multi-turn: 8 conversations of 4 turns, each with its own ~1,000-token system prompt, the turns
   interleaved (every conversation's first turn, then every second turn, ...), one request at a time;
   follow-up TTFT / first-turn TTFT (medians) on one worker, on three with `routing: cache` and on three
   with `routing: round-robin` (the shared queue alone), in each of `--rounds` rounds, alternating.
2. No hot spot (three workers, routing by cache): 24 distinct prompts at concurrency 6, and one shared
   ~1,400-token system prompt with 12 concurrent clients (4 requests each); the requests each worker
   served against the mean.
3. Failover: 12 clients on the shared-prompt workload; the worker that served most so far is SIGKILLed
   mid-run; every request sent afterwards must be answered, none lost.
Writes bench/results/routing.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench import kv
from bench.run import RESULTS, running_stack, write_results
from scripts import localstack

CONVERSATIONS = 8
TURNS = 4
SYSTEM_TOKENS = 1000
REPLY_TOKENS = 24
DISTINCT_PROMPTS = 24
DISTINCT_CONCURRENCY = 6
SHARED_TOKENS = 1400
SHARED_CLIENTS = 12
SHARED_REQUESTS = 4  # per client


def served_by(redis_url: str, request_ids: list[str]) -> list[str]:
    import redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    connection = redis.Redis.from_url(redis_url)
    try:
        names = []
        for request_id in request_ids:
            job = Job.fetch(request_id, connection=connection, serializer=JSONSerializer)
            names.append((job.worker_name or "?").rsplit(".r", 1)[0])
        return names
    finally:
        connection.close()


def turn_body(system: str, history: list[dict[str, str]], user: str) -> dict[str, Any]:
    body = kv.chat(system, user, REPLY_TOKENS)
    body["messages"] = [body["messages"][0], *history, {"role": "user", "content": user}]
    return body


async def multi_turn(url: str, tokenizer: Any, seed: int) -> dict[str, Any]:
    systems = [kv.text_of(tokenizer, SYSTEM_TOKENS, seed + i) for i in range(CONVERSATIONS)]
    histories: list[list[dict[str, str]]] = [[] for _ in range(CONVERSATIONS)]
    first, follow, errors = [], [], []
    async with kv._session() as session:
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                user = f"Question {turn} of conversation {c}?"
                result = await kv.stream(session, url, turn_body(systems[c], histories[c], user))
                if result.error or not result.times:
                    errors.append(result.error or "no content")
                    continue
                (first if turn == 0 else follow).append(result.ttft)
                histories[c] += [{"role": "user", "content": user}, {"role": "assistant", "content": result.text}]
    first_s, follow_s = statistics.median(first), statistics.median(follow)
    return {
        "first_ttft_ms": first_s * 1000,
        "follow_ttft_ms": follow_s * 1000,
        "ratio": follow_s / first_s,
        "errors": errors,
    }


async def spread(url: str, redis_url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """`bodies` sent by `concurrency` clients; the requests each worker served."""
    pending = collections.deque(bodies)
    ids: list[str] = []
    errors: list[str] = []
    async with kv._session() as session:

        async def client() -> None:
            while pending:
                result = await kv.stream(session, url, pending.popleft())
                if result.error:
                    errors.append(result.error)
                elif result.request_id:
                    ids.append(result.request_id)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    counts = collections.Counter(served_by(redis_url, ids))
    mean = len(bodies) / 3
    return {"served": dict(counts), "max_over_mean": max(counts.values()) / mean, "errors": errors}


async def failover(url: str, redis_url: str, system: str, procs: list[Any]) -> dict[str, Any]:
    """SHARED_CLIENTS clients, 6 requests each; after the first third, the busiest worker is killed."""
    total = SHARED_CLIENTS * 6
    sent = 0
    before: list[str] = []
    after: list[kv.Streamed] = []
    killed: dict[str, Any] = {}
    lock = asyncio.Lock()
    async with kv._session() as session:

        async def client(number: int) -> None:
            nonlocal sent
            while True:
                async with lock:
                    if sent >= total:
                        return
                    sent += 1
                    index = sent
                    if index == total // 3 and not killed:
                        killed.update(kill_busiest(redis_url, before, procs))
                late = bool(killed)
                result = await kv.stream(session, url, kv.chat(system, f"client {number} {index}", 16))
                if late:
                    after.append(result)
                elif result.request_id and not result.error:
                    before.append(result.request_id)

        await asyncio.gather(*(client(i) for i in range(SHARED_CLIENTS)))
    lost = [r.error for r in after if r.error or not r.times]
    return {
        "killed": killed.get("name"),
        "sent_after_kill": len(after),
        "answered_after_kill": len(after) - len(lost),
        "errors_after_kill": lost,
        "slowest_after_kill_s": max((r.times[-1] - r.sent for r in after if r.times), default=0.0),
    }


def kill_busiest(redis_url: str, served: list[str], procs: list[Any]) -> dict[str, Any]:
    counts = collections.Counter(served_by(redis_url, served))
    name = counts.most_common(1)[0][0]
    proc = next(p for p in procs if name.endswith(f".{p.pid}"))
    proc.send_signal(signal.SIGKILL)
    return {"name": name, "at": time.perf_counter()}


def markdown(report: dict[str, Any]) -> str:
    rows = report["multi_turn"]
    one, cache, rr = (statistics.median(r[k]["ratio"] for r in rows) for k in ("one", "cache", "round_robin"))
    d, s, f = report["distinct"], report["shared"], report["failover"]
    return "\n".join(
        [
            "| workload | result | target |",
            "| --- | --- | --- |",
            f"| multi-turn, follow-up / first-turn TTFT: 1 worker | {one:.2f} | – |",
            f"| same, 3 workers, routing: cache | {cache:.2f} ({cache / one:.2f}× one worker) | ≤ 0.35, ≤ 1.3× |",
            f"| same, 3 workers, routing: round-robin | {rr:.2f} ({rr / one:.2f}× one worker) | – |",
            f"| 24 distinct prompts, c=6: most served by one worker / mean | {d['max_over_mean']:.2f} "
            f"({d['served']}) | ≤ 1.5 |",
            f"| shared {SHARED_TOKENS}-token prompt, 12 clients: most / mean | {s['max_over_mean']:.2f} "
            f"({s['served']}) | ≤ 2 |",
            f"| failover: busiest worker SIGKILLed; answered / sent after | {f['answered_after_kill']}/"
            f"{f['sent_after_kill']} (slowest {f['slowest_after_kill_s']:.1f} s) | all |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=localstack.ROOT / "models" / "demo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    logs = args.results / "logs" / "routing"
    report: dict[str, Any] = {"multi_turn": []}
    stacks = {
        "one": ({"TOKENLINE_ROUTING": "cache"}, 1),
        "cache": ({"TOKENLINE_ROUTING": "cache"}, 3),
        "round_robin": ({"TOKENLINE_ROUTING": "round-robin"}, 3),
    }
    for number in range(args.rounds):
        row = {}
        for name, (env, workers) in stacks.items():
            with running_stack(args.model, [16], logs / name, env=env, workers=workers) as (url, _):
                row[name] = asyncio.run(multi_turn(url, tokenizer, seed=1000 * number))
            print(f"round {number + 1} {name}: {row[name]}", flush=True)
        report["multi_turn"].append(row)
    procs: list[Any] = []
    with running_stack(args.model, [16], logs / "spread", workers=3, procs=procs) as (url, redis_url):
        distinct = [kv.chat("", kv.text_of(tokenizer, 300, 5000 + i), 16) for i in range(DISTINCT_PROMPTS)]
        report["distinct"] = asyncio.run(spread(url, redis_url, distinct, DISTINCT_CONCURRENCY))
        print(f"distinct: {report['distinct']}", flush=True)
        system = kv.text_of(tokenizer, SHARED_TOKENS, 7000)
        shared = [kv.chat(system, f"client question {i}", 16) for i in range(SHARED_CLIENTS * SHARED_REQUESTS)]
        report["shared"] = asyncio.run(spread(url, redis_url, shared, SHARED_CLIENTS))
        print(f"shared: {report['shared']}", flush=True)
        report["failover"] = asyncio.run(failover(url, redis_url, system, procs))
        print(f"failover: {report['failover']}", flush=True)
    write_results(args.results, "routing", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
