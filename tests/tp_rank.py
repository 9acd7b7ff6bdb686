"""One rank of a tensor-parallel engine, for tests/test_tensor_parallel.py: rank 0 runs an engine core
over the group and writes each request's output ids as JSON; the other ranks follow its steps.

    python tests/tp_rank.py MODEL_DIR RANK WORLD ADDRESS OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.engine_runs import CACHE, MAX_BATCH, MAX_LEN, arrivals, overlapped_batch, serve  # noqa: E402
from workers.engine.core import EngineCore  # noqa: E402
from workers.models.parallel import GroupSpec, follow, join_group  # noqa: E402
from workers.models.runner import make_runner  # noqa: E402


def main() -> int:
    path, rank, world, address, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    device = torch.device("cpu")
    collective, loaded = join_group(GroupSpec(rank, world, address, timeout=60.0), device, path, "float32")
    if rank:
        runner = make_runner(loaded, MAX_LEN, MAX_BATCH, CACHE.pool, 1, 1, collective)
        follow(runner, collective)
    else:
        engine = EngineCore.build(loaded, MAX_LEN, MAX_BATCH, 1, 1, cache=CACHE, collective=collective)
        results: dict[str, object] = {name: serve(engine, plan) for name, plan in arrivals().items()}
        results["overlapped"] = serve(engine, overlapped_batch(), overlapped=True)
        results["kv_heads"] = engine.runner.kv.keys[0].shape[1]
        engine.runner.group.stop()  # type: ignore[union-attr]
        Path(out).write_text(json.dumps(results))
    collective.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
