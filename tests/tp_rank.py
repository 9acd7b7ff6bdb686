"""One rank of a tensor-parallel engine, for tests/test_tensor_parallel.py: for each model in turn, the
ranks form a group, rank 0 runs an engine core over it and writes each request's output ids as JSON
(OUT_DIR/<model dir's name>.json, with each rank's count of decode steps and of those it ran compiled),
and the other ranks follow its steps. One process serves every
model: a rank's start-up (torch, transformers) is paid once.

A model directory whose name has the part "-int8" is served with `quantization: int8`; one with the
part "-compiled" with its decode step compiled (`compile: on`), and one with the part "-slow" with a
collective timeout of SLOW_TIMEOUT seconds, rank 1's Inductor taking a second longer than that to
compile each graph (a rank that compiles more slowly than the others). The models' compiled code is dropped
after each (`torch._dynamo.reset`): a worker serves one model, and Dynamo keeps a handful of graphs per
function, whatever model they were compiled for.

A model directory whose name ends in "-position-bias" is served with its second layer passing an ALiBi
`position_bias` to the attention (tests/engine_runs.py `pass_position_bias`): every rank's runner is
expected to refuse it at its probe forward, and writes the reason (OUT_DIR/<name>.rank<R>.refused).

Each group's address is chosen by rank 0 just before it forms (a free port then, not one picked when
the test started, which something else may hold by the time a later model comes) and written to
OUT_DIR/<model dir's name>.address for the other ranks to read.

    python tests/tp_rank.py RANK WORLD OUT_DIR MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from scripts import localstack  # noqa: E402
from tests.engine_runs import (  # noqa: E402
    CACHE,
    MAX_BATCH,
    MAX_LEN,
    arrivals,
    overlapped_batch,
    pass_position_bias,
    serve,
)
from workers.engine.core import EngineCore  # noqa: E402
from workers.models.attention import UnsupportedAttention  # noqa: E402
from workers.models.compile import is_decode  # noqa: E402
from workers.models.parallel import GroupSpec, follow, join_group  # noqa: E402
from workers.models.quant.sharded import inner  # noqa: E402
from workers.models.runner import ModelRunner, make_runner  # noqa: E402
from workers.models.step import StepBatch  # noqa: E402

SLOW_TIMEOUT = 5.0


def main() -> int:
    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    for path in map(Path, sys.argv[4:]):
        serve_model(path, rank, world, group_address(rank, out / f"{path.name}.address"), out / f"{path.name}.json")
    return 0


def group_address(rank: int, file: Path) -> str:
    """Rank 0: a free port's address, written to `file`; the others: the address once it is there."""
    if rank == 0:
        address = f"tcp://127.0.0.1:{localstack.free_port()}"
        partial = file.with_suffix(".partial")
        partial.write_text(address)
        partial.rename(file)
        return address
    localstack.wait_for(file.exists, 120, f"rank 0's address in {file}")
    return file.read_text()


def serve_model(path: Path, rank: int, world: int, address: str, out: Path) -> None:
    device = torch.device("cpu")
    parts = path.name.split("-")
    quantization = "int8" if "int8" in parts else ""
    cache = dataclasses.replace(CACHE, compile="on") if "compiled" in parts else CACHE
    slow = "slow" in parts
    spec = GroupSpec(rank, world, address, timeout=SLOW_TIMEOUT if slow else 60.0)
    collective, loaded = join_group(spec, device, path, "float32", quantization=quantization)
    if slow and rank == 1:
        slow_inductor(SLOW_TIMEOUT + 1)
    if path.name.endswith("-position-bias"):
        pass_position_bias(loaded.model)
        try:
            if rank:
                make_runner(loaded, MAX_LEN, MAX_BATCH, cache.pool, 1, 1, collective)
            else:
                EngineCore.build(loaded, MAX_LEN, MAX_BATCH, 1, 1, cache=cache, collective=collective)
        except UnsupportedAttention as exc:
            out.with_name(f"{path.name}.rank{rank}.refused").write_text(str(exc))
        collective.close()
        return
    if rank:
        runner = make_runner(loaded, MAX_LEN, MAX_BATCH, cache.pool, 1, 1, collective)
        compiled = count_compiled_steps(runner)
        follow(runner, collective)
        dist.gather_object(compiled, None, dst=0, group=collective.control)
    else:
        engine = EngineCore.build(loaded, MAX_LEN, MAX_BATCH, 1, 1, cache=cache, collective=collective)
        compiled = count_compiled_steps(engine.runner)
        results: dict[str, object] = {name: serve(engine, plan) for name, plan in arrivals().items()}
        results["overlapped"] = serve(engine, overlapped_batch(), overlapped=True)
        results["kv_heads"] = engine.runner.kv.keys[0].shape[1]
        results["weight_bytes"] = loaded.weight_bytes
        results["quantization"] = loaded.quantization
        results["row_scales"] = row_scales(loaded.model)
        engine.runner.group.stop()  # type: ignore[union-attr]
        results["compiled_steps"] = counts = [None] * world  # each rank's [decodes, compiled]
        dist.gather_object(compiled, counts, dst=0, group=collective.control)
        out.write_text(json.dumps(results))
    collective.close()
    torch._dynamo.reset()


def slow_inductor(seconds: float) -> None:
    """From now on Inductor takes `seconds` longer to compile each graph."""
    import torch._inductor.compile_fx as inductor

    compile_fx = inductor.compile_fx

    def slower(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return compile_fx(*args, **kwargs)

    inductor.compile_fx = slower


def count_compiled_steps(runner: ModelRunner) -> list[int]:
    """From now on, counts of the runner's decode steps (each sequence one token) and of the steps its
    compiled decode step ran: [decodes, compiled]."""
    counts = [0, 0]
    forward, compiled = runner.forward, runner._compiled

    def counted_forward(batch: StepBatch, *args: Any, **kwargs: Any) -> torch.Tensor:
        counts[0] += is_decode(batch)
        return forward(batch, *args, **kwargs)

    def counted_compiled(*args: Any) -> torch.Tensor:
        counts[1] += 1
        return compiled(*args)

    runner.forward = counted_forward  # type: ignore[method-assign]
    runner._compiled = counted_compiled  # type: ignore[method-assign]
    return counts


def row_scales(model: torch.nn.Module) -> dict[str, list[float] | None]:
    """The weight scales of two layers that a group splits by their input features: the first
    attention output projection and an MoE model's first expert's down projection (by their names in
    one process; None where the layer is float)."""
    found = {}
    for name, module in model.named_modules():
        key = name.replace(".experts.experts.", ".experts.")  # sharded.SummedExperts holds them
        if key.endswith((".layers.0.self_attn.o_proj", ".layers.1.mlp.experts.0.down_proj")):
            scales = getattr(inner(module), "weight_scale", None)
            found[key] = None if scales is None else scales.tolist()
    return found


if __name__ == "__main__":
    sys.exit(main())
