"""Attention over the paged pool against SDPA over a contiguous cache: what reading the blocks costs.

`python bench/attention.py`: batch 32 decoding over 2,048-token contexts whose blocks are scattered in
the pool, the demo model's attention shape (4 heads, 2 KV heads, dim 64), 4 layers, one torch thread.
Per step (the 4 layers' attention, the pool's writes included), medians of `--rounds` rounds
alternating: each backend that runs here (`portable`, `flex`) and SDPA over a contiguous
[batch, KV heads, context, dim] cache of the same keys; and the memory each backend allocates in a
step (the profiler's count of bytes allocated by its operators).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from workers.models.attention import AttentionBackend, select_backend
from workers.models.step import StepBatch

HEADS, KV_HEADS, DIM, LAYERS = 4, 2, 64, 4


@dataclass
class Pool:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    windows: tuple[int, ...]
    block_size: int
    ring_tokens: int = 0
    context: int = 0


def decode_batch(batch: int, context: int, block_size: int, pool_blocks: int) -> StepBatch:
    """`batch` sequences of `context` tokens, each decoding its last one, their blocks scattered."""
    order = torch.randperm(pool_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    per = -(-context // block_size)
    step = StepBatch()
    for row in range(batch):
        step.add([1], context - 1, context - 1, order[row * per : (row + 1) * per], -1, True)
        step.keep.append(row)
    return step


def run(backend: AttentionBackend, pool: Pool, batch: StepBatch, query: torch.Tensor, kv: torch.Tensor) -> None:
    meta = backend.load(backend.prepare(batch, pool), torch.device("cpu"))
    out = torch.empty_like(query)
    for layer in range(LAYERS):
        backend.forward(pool, layer, query, kv, kv, out, meta, 0, DIM**-0.5, 0.0)


def allocated(step: callable) -> int:  # type: ignore[valid-type]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    query = torch.randn(args.batch, HEADS, DIM)
    kv = torch.randn(args.batch, KV_HEADS, DIM)
    contiguous = [torch.randn(args.batch, KV_HEADS, args.context, DIM) for _ in range(2)]

    def sdpa() -> None:
        q = query.unsqueeze(2)
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(q, *contiguous, scale=DIM**-0.5, enable_gqa=True)

    systems = {"sdpa, contiguous cache": sdpa}
    for name in ("portable", "flex"):
        backend = select_backend(torch.device("cpu"), name)
        size = backend.block_size or 16
        blocks = args.batch * -(-args.context // size) + 1
        pool = Pool(
            [torch.randn(blocks * size, KV_HEADS, DIM) for _ in range(LAYERS)],
            [torch.randn(blocks * size, KV_HEADS, DIM) for _ in range(LAYERS)],
            (0,) * LAYERS,
            size,
        )
        batch = decode_batch(args.batch, args.context, size, blocks - 1)
        systems[f"{name} ({size}-token blocks)"] = lambda b=backend, p=pool, s=batch: run(b, p, s, query, kv)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for step in systems.values():
        step()  # compile, warm up
    for _ in range(args.rounds):
        for name, step in systems.items():
            started = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - started) * 1000)
    base = statistics.median(times["sdpa, contiguous cache"])
    print(f"batch {args.batch}, {args.context}-token contexts, {LAYERS} layers, one thread; medians of {args.rounds}")
    print("| attention | ms per step | / contiguous SDPA | bytes allocated per step |")
    print("| --- | --- | --- | --- |")
    for name, step in systems.items():
        ms = statistics.median(times[name])
        print(f"| {name} | {ms:.2f} | {ms / base:.2f} | {allocated(step):,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
