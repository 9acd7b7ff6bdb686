"""The KV-memory workloads of `make bench`, over HTTP on the full stack as `make run` starts it:

1. Prefix reuse: sequential chat requests that share a ~1,400-token system prompt; time to first token
   of a warm request (its prefix cached) against a cold one (a `cache_salt` of its own, so nothing is
   shared), alternating, medians.
2. No stall: 8 streams decoding while a ~1,600-token prompt arrives; the largest gap between two
   steps of the streams while that prompt is prefilled, against their median gap before it (the
   median of 5 trials).
3. Budget: a worker whose pool (`npuMemSize`) holds 4 sequences of 1,000 tokens; 12 concurrent greedy
   requests of ~900 prompt tokens and 100 new tokens; all must complete, each with the text it gets
   when served alone. Then the same with a host tier (`cpuMemSize`): the preempted sequences' blocks
   go to host memory and back, so no token is computed twice (the worker's metrics, both ways).
4. Host tier: on a pool that holds ~2,000 tokens, a ~1,400-token prompt, then three others that evict
   it, then the first again: its time to first token when its prefix comes back from the host tier
   against a worker without one, which computes it again (alternating, medians).
And in-process: the pool's waste on a mixed-length batch (KV held ÷ KV the batch's tokens need).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
import urllib.request
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.load import Refused, data_lines

PREFIX_TOKENS = 1400
PREFIX_TURNS = 5
STALL_STREAMS = 8
STALL_PROMPT_TOKENS = 1600
STALL_TRIALS = 5
STEP_SPREAD = 0.002  # seconds: the events of one step reach the client closer together than this
BUDGET_SEQUENCES = 4
BUDGET_SEQUENCE_TOKENS = 1000
BUDGET_REQUESTS = 12
BUDGET_PROMPT_TOKENS = 900
BUDGET_NEW_TOKENS = 100
HOST_GIB = 1.0  # cpuMemSize for the host-tier workloads
EVICT_POOL_TOKENS = 2000
EVICT_PROMPTS = 3
EVICT_ROUNDS = 5
WASTE_PROMPTS = (37, 120, 260, 415, 640, 777, 901, 1230)


@dataclass
class Streamed:
    """One streamed chat request: when it was sent, when each content delta came, its text."""

    sent: float = 0.0
    times: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None
    request_id: str = ""  # the chunks' id: the request's, its RQ job's

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent


def text_of(tokenizer: Any, tokens: int, seed: int) -> str:
    """Text that the model's tokenizer reads as about `tokens` tokens: random vocabulary words."""
    rng = random.Random(seed)
    vocab = [w for w, i in tokenizer.get_vocab().items() if w.isalpha() and len(w) > 2]
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words)).ids) < tokens:
        words += rng.sample(vocab, 16)
    while len(tokenizer.encode(" ".join(words)).ids) > tokens:
        words.pop()
    return " ".join(words)


def chat(system: str, user: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], started: asyncio.Event | None = None
) -> Streamed:
    result = Streamed(sent=time.perf_counter())
    try:
        async with aclosing(data_lines(session, url, body)) as lines:
            async for raw in lines:
                chunk = json.loads(raw[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    break
                result.request_id = chunk.get("id", result.request_id)
                for choice in chunk.get("choices", ()):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        result.times.append(time.perf_counter())
                        result.text += content
                        if started is not None and len(result.times) >= 5:
                            started.set()
    except Refused as exc:
        result.error = str(exc)
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))


async def prefix_reuse(url: str, tokenizer: Any) -> dict[str, Any]:
    system = text_of(tokenizer, PREFIX_TOKENS, 1)
    cold, warm, errors = [], [], []
    async with _session() as session:
        await stream(session, url, chat(system, "warm-up", 1, cache_salt="bench-warm"))
        for turn in range(PREFIX_TURNS):
            for salt, into in ((f"bench-cold-{turn}-{time.time_ns()}", cold), ("bench-warm", warm)):
                result = await stream(session, url, chat(system, f"question {turn}", 1, cache_salt=salt))
                if result.error or not result.times:
                    errors.append(result.error)
                else:
                    into.append(result.ttft * 1000)
    cold_ms, warm_ms = statistics.median(cold), statistics.median(warm)
    return {"cold_ttft_ms": cold_ms, "warm_ttft_ms": warm_ms, "ratio": warm_ms / cold_ms, "errors": errors}


async def no_stall(url: str, tokenizer: Any) -> dict[str, Any]:
    """STALL_TRIALS trials; the median one (by ratio), with every trial's ratio."""
    trials = [await stall_trial(url, tokenizer, trial) for trial in range(STALL_TRIALS)]
    ordered = sorted(trials, key=lambda t: t["ratio"])
    return ordered[len(ordered) // 2] | {
        "ratios": [t["ratio"] for t in trials],
        "errors": [e for t in trials for e in t["errors"]],
    }


async def stall_trial(url: str, tokenizer: Any, trial: int) -> dict[str, Any]:
    long_prompt = text_of(tokenizer, STALL_PROMPT_TOKENS, 2 + trial)
    async with _session() as session:
        flowing = [asyncio.Event() for _ in range(STALL_STREAMS)]
        streams = [
            asyncio.create_task(stream(session, url, chat("", f"stream {i}", 400), flowing[i]))
            for i in range(STALL_STREAMS)
        ]
        await asyncio.gather(*(e.wait() for e in flowing))
        await asyncio.sleep(0.3)  # a steady state to take the median gap from
        long = await stream(session, url, chat("", long_prompt, 1))
        results = await asyncio.gather(*streams)
    errors = [r.error for r in [*results, long] if r.error]
    entered, first = long.sent, long.times[0] if long.times else long.sent
    # Every stream draws a token each step, but a token that ends mid-character sends no text: a stream's
    # own gaps would count such steps twice. The steps are read from the union of the streams' events
    # instead (one step's events arrive within STEP_SPREAD of each other).
    arrivals = sorted(t for r in results for t in r.times)
    steps = [(b - a, b) for a, b in itertools.pairwise(arrivals) if b - a > STEP_SPREAD]  # (gap, its end)
    before = [gap for gap, end in steps if end <= entered]
    during = [gap for gap, end in steps if entered < end and end - gap < first]
    median_ms, worst_ms = statistics.median(before) * 1000, max(during) * 1000
    return {
        "median_gap_ms": median_ms,
        "max_gap_during_prefill_ms": worst_ms,
        "max_gap_before_ms": max(before) * 1000,
        "long_prompt_ttft_ms": (first - entered) * 1000,
        "ratio": worst_ms / median_ms,
        "errors": errors,
    }


async def budget(url: str, tokenizer: Any) -> dict[str, Any]:
    prompts = [text_of(tokenizer, BUDGET_PROMPT_TOKENS, 100 + i) for i in range(BUDGET_REQUESTS)]
    async with _session() as session:
        started = time.perf_counter()
        together = await asyncio.gather(*(stream(session, url, chat("", p, BUDGET_NEW_TOKENS)) for p in prompts))
        wall = time.perf_counter() - started
        alone = [await stream(session, url, chat("", p, BUDGET_NEW_TOKENS)) for p in prompts]
    errors = [r.error for r in [*together, *alone] if r.error]
    same = sum(1 for a, b in zip(together, alone, strict=True) if a.text == b.text and not a.error)
    return {"requests": BUDGET_REQUESTS, "identical_to_alone": same, "wall_s": wall, "errors": errors}


def counters(url: str, *names: str) -> dict[str, float]:
    """The workers' counters as the API's /metrics sums them (`url`: the chat URL)."""
    import re

    base = url.split("/v1/", 1)[0]
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return {
        name: sum(float(v) for v in re.findall(rf"^tokenline:{name}_total{{[^}}]*}} (\S+)$", text, re.M))
        for name in names
    }


SWAP_COUNTERS = ("num_preemptions", "recomputed_tokens", "kv_swapped_out_blocks", "kv_swapped_in_blocks")


async def evicted_prefix(url: str, tokenizer: Any, round_: int) -> float:
    """The TTFT (ms) of a prompt whose prefix was evicted from the pool by three others."""
    prompt = text_of(tokenizer, PREFIX_TOKENS, 900 + round_)
    others = [text_of(tokenizer, PREFIX_TOKENS, 950 + 10 * round_ + i) for i in range(EVICT_PROMPTS)]
    async with _session() as session:
        await stream(session, url, chat(prompt, "first", 1))
        for other in others:
            await stream(session, url, chat(other, "evict", 1))
        again = await stream(session, url, chat(prompt, "again", 1))
    if again.error or not again.times:
        raise RuntimeError(f"the evicted prompt failed: {again.error}")
    return again.ttft * 1000


def budget_gib(loaded: Any) -> float:
    """npuMemSize for a pool of BUDGET_SEQUENCES sequences of BUDGET_SEQUENCE_TOKENS tokens."""
    from workers.models.kv_pool import KVShape

    shape = KVShape.of(loaded.model)
    return BUDGET_SEQUENCES * BUDGET_SEQUENCE_TOKENS * shape.bytes_per_token / 2**30


def waste(loaded: Any) -> dict[str, Any]:
    """In-process: blocks held ÷ blocks the tokens of a mixed-length batch fill, once all are decoding."""
    from schemas.job import JobPayload
    from schemas.sampling import SamplingParams
    from workers.engine.core import EngineCore

    engine = EngineCore.build(loaded, 2560, len(WASTE_PROMPTS))
    rng = random.Random(3)
    for i, n in enumerate(WASTE_PROMPTS):
        prompt = tuple(rng.randrange(3, loaded.vocab_size) for _ in range(n))
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        engine.add_request(JobPayload(f"w{i}", "bench", prompt, params, "ch"))
    while any(s.table.computed < len(s.prompt_ids) for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(7):
        engine.step()
    running = engine.scheduler.running
    held = engine.kv.used * engine.kv.block_size
    needed = sum(s.table.computed for s in running)
    return {"held_tokens": held, "needed_tokens": needed, "ratio": held / needed, "block_size": engine.kv.block_size}


def measure(model_dir: Path, logs: Path, running_stack: Any, loaded: Any) -> dict[str, Any]:
    """The three workloads on stacks started as `make run` starts them (the budget one with its pool
    set), and the in-process waste."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    report: dict[str, Any] = {}
    with running_stack(model_dir, [16], logs / "kv") as (url, _redis_url):
        print("prefix reuse:", flush=True)
        report["prefix"] = asyncio.run(prefix_reuse(url, tokenizer))
        print(f"  {report['prefix']}", flush=True)
        print("no stall:", flush=True)
        report["stall"] = asyncio.run(no_stall(url, tokenizer))
        print(f"  {report['stall']}", flush=True)
    gib = budget_gib(loaded)
    with running_stack(model_dir, [16], logs / "kv-budget", env={"TOKENLINE_NPU_MEM_SIZE": f"{gib:.9f}"}) as (
        url,
        _redis_url,
    ):
        print(f"budget (npuMemSize {gib:.6f} GiB):", flush=True)
        report["budget"] = asyncio.run(budget(url, tokenizer)) | {"npu_mem_size_gib": gib}
        report["budget"] |= counters(url, *SWAP_COUNTERS)
        print(f"  {report['budget']}", flush=True)
    host_env = {"TOKENLINE_NPU_MEM_SIZE": f"{gib:.9f}", "TOKENLINE_CPU_MEM_SIZE": str(HOST_GIB)}
    with running_stack(model_dir, [16], logs / "kv-budget-host", env=host_env) as (url, _redis_url):
        print(f"budget with a host tier (cpuMemSize {HOST_GIB} GiB):", flush=True)
        report["budget_host"] = asyncio.run(budget(url, tokenizer)) | counters(url, *SWAP_COUNTERS)
        print(f"  {report['budget_host']}", flush=True)
    small = f"{EVICT_POOL_TOKENS * gib / (BUDGET_SEQUENCES * BUDGET_SEQUENCE_TOKENS):.9f}"
    with (
        running_stack(model_dir, [16], logs / "kv-evict", env={"TOKENLINE_NPU_MEM_SIZE": small}) as (plain, _),
        running_stack(
            model_dir,
            [16],
            logs / "kv-evict-host",
            env={"TOKENLINE_NPU_MEM_SIZE": small, "TOKENLINE_CPU_MEM_SIZE": str(HOST_GIB)},
        ) as (tiered, _),
    ):
        print("evicted prefix: recomputed / from the host tier:", flush=True)
        recomputed, restored = [], []
        for round_ in range(EVICT_ROUNDS):
            recomputed.append(asyncio.run(evicted_prefix(plain, tokenizer, round_)))
            restored.append(asyncio.run(evicted_prefix(tiered, tokenizer, round_)))
        report["evicted"] = {
            "recomputed_ttft_ms": statistics.median(recomputed),
            "host_tier_ttft_ms": statistics.median(restored),
            "ratio": statistics.median(restored) / statistics.median(recomputed),
        } | {f"host_{k}": v for k, v in counters(tiered, "host_cache_hits").items()}
        print(f"  {report['evicted']}", flush=True)
    report["waste"] = waste(loaded)
    print(f"waste: {report['waste']}", flush=True)
    return report


def rows(kv: dict[str, Any]) -> list[str]:
    """The KV targets' rows of the report's table."""
    p, s, b, w = kv["prefix"], kv["stall"], kv["budget"], kv["waste"]
    h, e = kv["budget_host"], kv["evicted"]
    return [
        f"| prefix reuse: warm / cold TTFT, ~{PREFIX_TOKENS}-token system prompt | {p['ratio']:.3f} "
        f"({p['warm_ttft_ms']:.1f} / {p['cold_ttft_ms']:.1f} ms) | ≤ 0.25 |",
        f"| no stall: largest gap while a ~{STALL_PROMPT_TOKENS}-token prompt enters / median gap, "
        f"{STALL_STREAMS} streams | {s['ratio']:.2f} ({s['max_gap_during_prefill_ms']:.1f} / "
        f"{s['median_gap_ms']:.1f} ms) | ≤ 3 |",
        f"| budget: {BUDGET_REQUESTS} × ~{BUDGET_PROMPT_TOKENS}+{BUDGET_NEW_TOKENS} tokens, pool of "
        f"{BUDGET_SEQUENCES} × {BUDGET_SEQUENCE_TOKENS}: identical to alone, errors | "
        f"{b['identical_to_alone']}/{b['requests']}, {len(b['errors'])} (recomputed tokens: "
        f"{b['recomputed_tokens']:.0f}) | {b['requests']}/{b['requests']}, 0 |",
        f"| budget with a host tier (cpuMemSize {HOST_GIB:g} GiB): identical to alone, recomputed tokens, "
        f"blocks swapped out | {h['identical_to_alone']}/{h['requests']}, {h['recomputed_tokens']:.0f}, "
        f"{h['kv_swapped_out_blocks']:.0f} | {h['requests']}/{h['requests']}, 0 |",
        f"| evicted ~{PREFIX_TOKENS}-token prefix: TTFT from the host tier / recomputed | {e['ratio']:.3f} "
        f"({e['host_tier_ttft_ms']:.1f} / {e['recomputed_ttft_ms']:.1f} ms) | ≤ 0.5 |",
        f"| waste: KV held / needed, mixed-length batch (in-process, blocks of {w['block_size']}) | "
        f"{w['ratio']:.3f} | ≤ 1.05 |",
    ]
