"""The in-process ceiling: tokenline's own engine core driven in this process, no Redis, no HTTP.

The same forward pass, sampler and torch thread policy as the worker (`EngineCore.build` with the
worker's defaults), so the stack's ratio to it measures what the serving layer costs.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from schemas.job import JobPayload
from schemas.sampling import SamplingParams
from workers.engine.core import EngineCore
from workers.models.loader import LoadedModel, load_model


def load(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, torch.device("cpu"))


def engine(loaded: LoadedModel, batch: int) -> EngineCore:
    return EngineCore.build(loaded, 4096, batch)


def _payloads(prompt_ids: list[int], batch: int, new_tokens: int) -> list[JobPayload]:
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [JobPayload(f"r{i}", "bench", tuple(prompt_ids), sampling, "ch") for i in range(batch)]


def tokens_per_second(
    loaded: LoadedModel, prompt_ids: list[int], batch: int, new_tokens: int, repeats: int = 3
) -> float:
    """Median over `repeats` of batch × new_tokens / seconds for a batch that arrives at once."""
    core = engine(loaded, batch)
    rates = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for payload in _payloads(prompt_ids, batch, new_tokens):
            core.add_request(payload)
        while core.has_work:
            core.step()
        rates.append(batch * new_tokens / (time.perf_counter() - started))
    return statistics.median(rates[1:])  # the first run warms up


def first_token_ms(loaded: LoadedModel, prompt_ids: list[int], repeats: int = 21) -> float:
    """Median time from a lone request's arrival to its first token (its prefill and first draw)."""
    core = engine(loaded, 1)
    times = []
    for _ in range(repeats):
        (payload,) = _payloads(prompt_ids, 1, 2)
        started = time.perf_counter()
        core.add_request(payload)
        core.step()
        times.append((time.perf_counter() - started) * 1000)
        while core.has_work:
            core.step()
    return statistics.median(times[1:])
