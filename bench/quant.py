"""`make bench-quant`: SmolLM2-135M-Instruct with int8 weights (`quantization: int8`) against float32, on
two stacks started as `make run` starts them, side by side.

In each of `--rounds` rounds, alternating between the stacks: tokens/s at concurrency 1 and 8 (greedy,
`--max-tokens` tokens, EOS ignored); the report gives medians and the int8 / float32 ratios. And, in
process, the weights' bytes either way (`LoadedModel.weight_bytes`) and the int8 products' kernel.
`--compile on` (or `off`) sets TOKENLINE_COMPILE in both stacks; the default is `make run`'s `auto`.
Writes bench/results/quant.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import RESULTS, chat_body, run_levels, running_stack, write_results
from scripts import real_models

LEVELS = [1, 8]


def weights(model: Path) -> tuple[dict[str, int], str]:
    """Each build's weight bytes, and the kernel of the int8 products on this CPU."""
    import torch

    from workers.models.loader import load_model

    cpu = torch.device("cpu")
    int8 = load_model(model, cpu, quantization="int8")
    return {"float32": load_model(model, cpu).weight_bytes, "int8": int8.weight_bytes}, int8.kernel


def markdown(report: dict[str, Any]) -> str:
    rows = ["| measure | float32 | int8 | int8 / float32 | target |", "| --- | --- | --- | --- | --- |"]
    for level in LEVELS:
        f, q = report["tokens_per_s"]["float32"][str(level)], report["tokens_per_s"]["int8"][str(level)]
        rows.append(
            f"| tokens/s, c={level} (median of {report['rounds']}) | {f:.1f} | {q:.1f} | {q / f:.2f}× | ≥ 2.5× |"
        )
    w = report["weight_bytes"]
    rows.append(
        f"| weight memory | {w['float32'] / 2**20:.0f} MiB | {w['int8'] / 2**20:.0f} MiB | "
        f"{w['int8'] / w['float32']:.3f}× | ≤ 0.3× |"
    )
    return "\n".join(rows) + f"\n\nint8 products: {report['kernel']}; TOKENLINE_COMPILE={report['compile']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--compile", default="auto", choices=("auto", "on", "off"), help="TOKENLINE_COMPILE of both stacks"
    )
    args = parser.parse_args(argv)
    model = real_models.smollm2()
    logs = args.results / "logs" / "quant"
    measured: dict[str, dict[int, list[float]]] = {"float32": {}, "int8": {}}
    body = chat_body("bench", args.max_tokens)
    levels = [max(LEVELS)]
    compile_env = {"TOKENLINE_COMPILE": args.compile}
    with (
        running_stack(model, levels, logs / "float32", env=compile_env) as (float_url, _),
        running_stack(model, levels, logs / "int8", env={**compile_env, "TOKENLINE_QUANTIZATION": "int8"}) as (
            int8_url,
            _,
        ),
    ):
        for number in range(1, args.rounds + 1):
            for name, url in (("float32", float_url), ("int8", int8_url)):
                print(f"=== round {number}/{args.rounds}: {name}", flush=True)
                for result in run_levels(url, body, LEVELS):
                    measured[name].setdefault(result.concurrency, []).append(result.tokens_per_s)
    report = {
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "compile": args.compile,
        "tokens_per_s": {
            name: {str(level): statistics.median(values) for level, values in by_level.items()}
            for name, by_level in measured.items()
        },
        "all_rounds": {name: {str(k): v for k, v in by_level.items()} for name, by_level in measured.items()},
    }
    report["weight_bytes"], report["kernel"] = weights(model)
    write_results(args.results, "quant", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
