"""An asyncio streaming load generator for OpenAI-compatible chat endpoints.

Each of `concurrency` clients sends requests one after another (a closed loop) and records, per
request: time to first token (first content delta), the gaps between content deltas, end-to-end
latency, and the completion tokens reported in the final usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp


@dataclass
class RequestResult:
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    ttft_ms_median: float
    ttft_ms_p90: float
    tpot_ms_median: float
    itl_ms_median: float
    itl_ms_p90: float
    e2e_ms_median: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Refused(Exception):
    """The server answered a streamed request with an HTTP error."""


async def data_lines(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """The raw `data: {...}` lines of a streamed request, as they come; Refused on an HTTP error."""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise Refused(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            if raw.startswith(b"data: {"):
                yield raw


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream_one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], abort_after: int | None = None
) -> RequestResult:
    """One streamed request; with `abort_after`, hang up after that many content deltas."""
    result = RequestResult()
    started = last = time.perf_counter()
    deltas = 0
    try:
        # aclosing: a hang-up (`break`) closes the connection at once, as a client that leaves does.
        async with aclosing(data_lines(session, url, body)) as lines:
            async for raw in lines:
                # Parse only what is needed, so that the client disturbs the measurement little.
                if b'"content":"' in raw and b'"content":""' not in raw:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                    deltas += 1
                elif b'"error"' in raw or b'"usage":{' in raw:
                    chunk = json.loads(raw[6:])
                    if "error" in chunk:
                        result.error = str(chunk["error"])
                        break
                    result.tokens = chunk["usage"]["completion_tokens"]
                if abort_after is not None and deltas >= abort_after:
                    break
    except Refused as exc:
        result.error = str(exc)
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - started
    return result


async def run_level(url: str, body: dict[str, Any], concurrency: int, requests_per_client: int) -> LevelResult:
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> list[RequestResult]:
            return [await stream_one(session, url, body) for _ in range(requests_per_client)]

        started = time.perf_counter()
        per_client = await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    results = [r for rs in per_client for r in rs]
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itl = [gap * 1000 for r in ok for gap in r.itl]
    tpot = [(r.e2e - r.ttft) * 1000 / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(ok),
        wall_s=wall,
        output_tokens=tokens,
        tokens_per_s=tokens / wall if wall else 0.0,
        ttft_ms_median=statistics.median(ttft) if ttft else float("nan"),
        ttft_ms_p90=_percentile(ttft, 0.9),
        tpot_ms_median=statistics.median(tpot) if tpot else float("nan"),
        itl_ms_median=statistics.median(itl) if itl else float("nan"),
        itl_ms_p90=_percentile(itl, 0.9),
        e2e_ms_median=statistics.median([r.e2e * 1000 for r in ok]) if ok else float("nan"),
    )


async def disconnect_then_probe(
    url: str, body: dict[str, Any], probe: dict[str, Any], clients: int, after_deltas: int
) -> tuple[float, list[str]]:
    """`clients` streams hang up mid-way; then the latency of one short request, in ms."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        aborted = await asyncio.gather(
            *(stream_one(session, url, body, abort_after=after_deltas) for _ in range(clients))
        )
        result = await stream_one(session, url, probe)
    errors = [r.error for r in aborted if r.error] + ([result.error] if result.error else [])
    return result.e2e * 1000, errors
