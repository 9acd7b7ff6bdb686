"""A decoder layer's products in int8 against float, at a 7B-class model's shapes, on one device.

`python bench/linear.py --device cuda`: the seven projections of one Llama-3-8B layer (q, k, v, o from
hidden 4096 with 8 KV heads of 128; gate and up to 14,336; down back to 4096) as `quantization: int8`
runs them (models/quant/: per-channel int8 weights, per-token dynamic activations, the device's int8
product: cuBLASLt's through `torch._int_mm` on a GPU, fbgemm on the CPU, npu_quant_matmul on an NPU)
against the float layers (`--dtype`, bfloat16 by default on an accelerator, float32 on the CPU), at 1,
8, 32 and 128 rows (a decode step's batch). q, k and v (and gate and up) are one int8 product each,
as in a served model (`Siblings`, models/quant/linear.py); the float ones are seven, as transformers
runs them. On an accelerator the layer is compiled (`compile: auto`) and on CUDA its
products captured as one CUDA graph and replayed, as a captured decode step runs them (no host time);
`--eager` runs them uncompiled. There a third variant runs too: the int8 weights upcast inside the
compiled float product (what a weight-only int8 path would do). Medians of `--rounds` rounds, the
variants alternating; and the weight bytes of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from bench.attention import captured
from workers.models.quant.convert import bind, symmetric_rows, weight_bytes
from workers.models.quant.kernels import ops_for
from workers.models.quant.linear import DYNAMIC, Int8Linear

HIDDEN, KV, INTERMEDIATE = 4096, 1024, 14336
SHAPES = {  # name: (in, out)
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV),
    "v_proj": (HIDDEN, KV),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE),
    "up_proj": (HIDDEN, INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}


class UpcastLinear(nn.Module):
    """int8 weights and per-channel scales, upcast to the input's type inside the product."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype)) * self.scale


class Layer(nn.Module):
    """One decoder layer's projections, called as transformers' attention and MLP call them."""

    def __init__(self, projections: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in projections.items():
            setattr(self, name, module)

    def forward(self, x: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
        outputs = [getattr(self, name)(wide if name == "down_proj" else x) for name in SHAPES]
        return torch.cat([o[:, :8] for o in outputs], -1)  # one output, so that nothing is left out


def layers(device: torch.device, dtype: torch.dtype, upcast: bool) -> dict[str, Layer]:
    """The float projections, their int8 counterparts (quantized as `quantization: int8` does) and,
    with `upcast`, the int8 weights multiplied in `dtype`."""
    ops = ops_for(device)
    if ops is None:
        raise SystemExit(f"no int8 products on {device}")
    built: dict[str, dict[str, nn.Module]] = {"float": {}, "int8": {}, "int8 weights, float product": {}}
    for name, (inputs, outputs) in SHAPES.items():
        linear = nn.Linear(inputs, outputs, bias=False, device=device, dtype=dtype).requires_grad_(False)
        weight, scale = symmetric_rows(linear.weight)
        built["float"][name], built["int8"][name] = linear, Int8Linear(DYNAMIC, weight, scale).to(device)
        built["int8 weights, float product"][name] = UpcastLinear(weight, scale, dtype)
    if not upcast:
        del built["int8 weights, float product"]
    result = {kind: Layer(projections) for kind, projections in built.items()}
    bind(result["int8"], device, dtype)  # as the loader binds them: q, k and v one product, gate and up another
    return result


def timer(run: Callable[[], None], device: torch.device, repeats: int) -> Callable[[], float]:
    """A callable that runs `run` `repeats` times and returns microseconds per run; on CUDA the runs
    are one captured graph's replays, timed by CUDA events."""
    if device.type != "cuda":
        synchronize = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)

        run()  # warm up

        def eager() -> float:
            synchronize()
            started = time.perf_counter()
            for _ in range(repeats):
                run()
            synchronize()
            return (time.perf_counter() - started) * 1e6 / repeats

        return eager
    replay = captured(run)
    if replay is None:
        raise SystemExit("the layer's products could not be captured as a CUDA graph")

    def replayed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000 / repeats

    return replayed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu")
    parser.add_argument("--dtype", help="the float layers' type (default: bfloat16 on an accelerator, else float32)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, help="runs per round (default: 200 on an accelerator, 5 on the CPU)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile on an accelerator")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "npu":
        import torch_npu  # noqa: F401
    accelerator = device.type != "cpu"
    compiled = accelerator and not args.eager
    dtype = getattr(torch, args.dtype or ("bfloat16" if accelerator else "float32"))
    repeats = args.repeats or (200 if accelerator else 5)
    torch.manual_seed(0)
    if not accelerator:
        torch.set_num_threads(1)
    # One compiled variant per layer kind and row count, all of one forward: more than Dynamo's default 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    variants = layers(device, dtype, upcast=compiled)
    base = weight_bytes(variants["float"])
    kernel = variants["int8"].q_proj.ops.name  # type: ignore[union-attr]
    print(
        f"{device} ({kernel}); float layers in {dtype}; {'compiled' if compiled else 'eager'}"
        f"{', captured' if device.type == 'cuda' else ''}; medians of {args.rounds} rounds of {repeats} runs"
    )
    sizes = {k: weight_bytes(v) for k, v in variants.items()}
    print("weights: " + ", ".join(f"{k} {b / 2**20:.1f} MiB ({b / base:.2f}x)" for k, b in sizes.items()))
    print("| rows | " + " | ".join(f"{k} µs per layer" for k in variants) + " | int8 / float |")
    print("| --- " * (len(variants) + 2) + "|")
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
        wide = torch.randn(rows, INTERMEDIATE, device=device, dtype=dtype)
        with torch.inference_mode():
            timers = {}
            for kind, layer in variants.items():
                forward = torch.compile(layer, fullgraph=True, dynamic=False) if compiled else layer
                timers[kind] = timer(lambda f=forward, x=x, wide=wide: f(x, wide), device, repeats)
            times: dict[str, list[float]] = {name: [] for name in timers}
            for _ in range(args.rounds):
                for name, measure in timers.items():
                    times[name].append(measure())
        medians = {k: statistics.median(v) for k, v in times.items()}
        cells = " | ".join(f"{m:.1f}" for m in medians.values())
        print(f"| {rows} | {cells} | {medians['int8'] / medians['float']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
