"""Attention over the paged pool against SDPA over a contiguous cache: what reading the blocks costs.

`python bench/attention.py`: batch 32 decoding over 2,048-token contexts whose blocks are scattered in
the pool, the demo model's attention shape (4 heads, 2 KV heads, dim 64), 4 layers, one torch thread.
Per step (the 4 layers' attention, the pool's writes included), medians of `--rounds` rounds
alternating: each backend that runs here (`portable`, `flex`) and SDPA over a contiguous
[batch, KV heads, context, dim] cache of the same keys; and the memory each backend allocates in a
step (the profiler's count of bytes allocated by its operators; on a GPU, the peak the step adds to
what was allocated before it). `--device cuda` (or `npu`) runs the same on an accelerator, timed
after the device's queue has drained; on CUDA each system is timed again captured as a CUDA graph
(the backends' metadata loaded before, as a captured decode step has it), against captured SDPA: the
device's time without the host's; there flex runs as `auto` gives it (every block masked, so that
its decoding kernel splits each row's keys) and beside it with full blocks, as on a CPU; where the query
heads per KV head are not a power of two (`--heads 28 --kv-heads 4 --dim 128`, Qwen2.5-7B's), also with
them unpadded (flex's general kernel; attention/flex.py). `--dtype` sets the cache's and the queries'
type.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from workers.models.attention import AttentionBackend, select_backend
from workers.models.attention.flex import FlexBackend
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
    meta = backend.load(backend.prepare(batch, pool), query.device)
    layers(backend, pool, meta, query, kv)


def layers(backend: AttentionBackend, pool: Pool, meta: object, query: torch.Tensor, kv: torch.Tensor) -> None:
    out = torch.empty_like(query)
    for layer in range(LAYERS):
        backend.forward(pool, layer, query, kv, kv, out, meta, 0, query.shape[-1] ** -0.5, 0.0)


def captured(step: Callable[[], None]) -> Callable[[], None] | None:
    """`step` captured as a CUDA graph (its replay), or None where it cannot be."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as exc:
        print(f"(not captured: {str(exc).splitlines()[0]})")
        torch.cuda.synchronize()
        return None
    return graph.replay


def allocated(step: Callable[[], None], device: torch.device) -> int:
    if device.type != "cpu":  # the peak above what the step found allocated
        module = getattr(torch, device.type)
        module.synchronize()
        module.reset_peak_memory_stats()
        before = module.memory_allocated()
        step()
        module.synchronize()
        return module.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    parser.add_argument("--dim", type=int, default=DIM)
    args = parser.parse_args(argv)
    heads, kv_heads, dim = args.heads, args.kv_heads, args.dim
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(args.device)
    if device.type == "npu":
        import torch_npu  # noqa: F401
    synchronize = getattr(torch, device.type).synchronize if device.type != "cpu" else lambda: None
    like = {"device": device, "dtype": getattr(torch, args.dtype)}
    query = torch.randn(args.batch, heads, dim, **like)
    kv = torch.randn(args.batch, kv_heads, dim, **like)
    contiguous = [torch.randn(args.batch, kv_heads, args.context, dim, **like) for _ in range(2)]

    def sdpa() -> None:
        q = query.unsqueeze(2)
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(q, *contiguous, scale=dim**-0.5, enable_gqa=True)

    systems = {"sdpa, contiguous cache": sdpa}
    backends = {name: select_backend(device, name) for name in ("portable", "flex")}
    if device.type != "cpu":  # the layout flex had on a GPU before split-KV (attention/flex.py), beside it
        backends["flex, full blocks"] = FlexBackend(split_kv=False, pad_groups=True)
        group = heads // kv_heads
        if group & (group - 1):  # and flex's general kernel, where the heads are not padded for its decoding one
            backends["flex, heads unpadded"] = FlexBackend(split_kv=True, pad_groups=False)
    for name, backend in backends.items():
        size = backend.block_size or 16
        blocks = args.batch * -(-args.context // size) + 1
        pool = Pool(
            [torch.randn(blocks * size, kv_heads, dim, **like) for _ in range(LAYERS)],
            [torch.randn(blocks * size, kv_heads, dim, **like) for _ in range(LAYERS)],
            (0,) * LAYERS,
            size,
        )
        batch = decode_batch(args.batch, args.context, size, blocks - 1)
        systems[f"{name} ({size}-token blocks)"] = lambda b=backend, p=pool, s=batch: run(b, p, s, query, kv)
        if device.type == "cuda":  # the layers as a captured decode step runs them: metadata loaded before
            meta = backend.load(backend.prepare(batch, pool), device)
            replay = captured(lambda b=backend, p=pool, m=meta: layers(b, p, m, query, kv))
            if replay is not None:
                systems[f"{name} ({size}-token blocks), captured"] = replay
    if device.type == "cuda":
        replay = captured(sdpa)
        if replay is not None:
            systems["sdpa, contiguous cache, captured"] = replay
    times: dict[str, list[float]] = {name: [] for name in systems}
    for step in systems.values():
        step()  # compile, warm up
    synchronize()
    for _ in range(args.rounds):
        for name, step in systems.items():
            started = time.perf_counter()
            step()
            synchronize()
            times[name].append((time.perf_counter() - started) * 1000)
    base = statistics.median(times["sdpa, contiguous cache"])
    captured_base = statistics.median(times.get("sdpa, contiguous cache, captured", [base]))
    print(
        f"{device.type}, {args.dtype}: batch {args.batch}, {args.context}-token contexts, {LAYERS} layers of "
        f"{heads} heads, {kv_heads} KV heads, dim {dim}; one thread; medians of {args.rounds}"
    )
    print("| attention | ms per step | / contiguous SDPA | bytes allocated per step |")
    print("| --- | --- | --- | --- |")
    for name, step in systems.items():
        ms = statistics.median(times[name])
        reference = captured_base if name.endswith("captured") else base
        print(f"| {name} | {ms:.3f} | {ms / reference:.2f} | {allocated(step, device):,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
