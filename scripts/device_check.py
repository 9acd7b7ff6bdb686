"""`make device-check`: tokenline's engine on this machine's accelerator, checked and measured.

1. The engine tests on the device (TOKENLINE_TEST_DEVICE): every architecture against transformers'
   `generate()` with the device's attention backend (tests/test_architectures.py), the compiled
   decode step against the eager one and the step captured as device graphs against the eager one,
   for every architecture (tests/test_compile.py), and the int8 products of each quantization scheme
   against their exact math and an int8 model's compiled decode step against its eager one
   (tests/test_int8_products.py).
2. The decode-step benchmark on the device (bench/steps.py --deep): a 28-layer model's step, eager,
   compiled (where Inductor has a code generator for the device) and captured (where the device's
   attention backend can be: flex on a GPU without FlashInfer, the fused attention on an NPU, whose
   eager step is captured without triton-ascend), at batch 1 and 32, and the ATen operations per step.
3. On an accelerator, attention over the paged pool against SDPA over a contiguous cache
   (bench/attention.py, bfloat16; the demo model's heads, then Qwen2.5-7B's 28 and 4 KV heads) and a
   7B-class layer's int8 products against float (bench/linear.py): their tables as they print them.

It prints one table: device, attention backend, batch and bucket, ms per step eager / compiled /
captured, tokens/s. The device is an Ascend NPU (torch_npu importable and a device present), else a
CUDA GPU; `--device cpu` runs the same on the CPU (a dry run of the command). Exits non-zero when a
test fails or no device is found.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_architectures.py", "tests/test_compile.py", "tests/test_int8_products.py"]


def accelerator() -> str | None:
    """npu, cuda, or None."""
    import torch

    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return "npu"
    except ImportError:
        pass
    return "cuda" if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="npu, cuda or cpu (default: the accelerator found)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    device = args.device or accelerator()
    if device is None:
        print("device-check: no NPU or GPU on this machine (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    env = {**os.environ, "TOKENLINE_TEST_DEVICE": device}
    # On an accelerator the tests' engines take 1 GiB pools (tests/engine_runs.py): with pytest-xdist
    # installed, up to 8 test processes share the device (~80 s on an H200, where one took minutes).
    workers = min(8, os.cpu_count() or 1)
    parallel = ["-n", str(workers)] if device != "cpu" and workers > 1 and importlib.util.find_spec("xdist") else []
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", *parallel, *TESTS], cwd=ROOT, env=env)
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "steps.json"
        command = [sys.executable, "bench/steps.py", "--deep", "--device", device, "--rounds", str(args.rounds)]
        bench = subprocess.run([*command, "--json", str(rows_file)], cwd=ROOT, env=env)
        rows = json.loads(rows_file.read_text()) if bench.returncode == 0 else []
    extras = 0
    if device != "cpu":
        qwen = ["--heads", "28", "--kv-heads", "4", "--dim", "128", "--rounds", "3"]  # 7 query heads a KV head
        scripts = (["bench/attention.py", "--dtype", "bfloat16"], ["bench/attention.py", "--dtype", "bfloat16", *qwen])
        for script in (*scripts, ["bench/linear.py"]):
            extras |= subprocess.run([sys.executable, *script, "--device", device], cwd=ROOT, env=env).returncode
    sys.path.insert(0, str(ROOT))
    from bench.steps import table

    print(f"\ndevice check on {device}: tests {'passed' if tests.returncode == 0 else 'FAILED'}")
    if rows:
        print(table(rows))
    return 0 if tests.returncode == 0 and bench.returncode == 0 and extras == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
