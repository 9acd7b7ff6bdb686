"""A tensor-parallel worker's group as the serving layer starts and ends it: rank 0 starts ranks
1..N-1 (`start_group`) and leads them; each of those runs `follow_group`; a rank that exits while the
group serves fails its requests and stops rank 0 (`group_lost`), so the group restarts whole."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from schemas.config import ModelConfig, Settings
from schemas.model_files import ModelFiles
from schemas.quantization import detect as detect_quantization
from workers.serving.lifecycle import stop_self, wait_idle

if TYPE_CHECKING:
    import torch

    from workers.models.loader import LoadedModel
    from workers.models.parallel import Collective
    from workers.ops.group import Followers
    from workers.serving.beacon import Beacon
    from workers.serving.loop import EngineLoop

logger = logging.getLogger("workers")

# How long the other ranks get to leave after rank 0's stop, and how long the engine gets to fail the
# requests after a rank died before rank 0 exits at once.
GROUP_LEAVE_SECONDS = 10.0
GROUP_ABORT_SECONDS = 2.0


@dataclass
class StartedGroup:
    """Rank 0's side of a group that has formed and loaded: its membership, its model shards and the
    other ranks' processes."""

    collective: Collective
    loaded: LoadedModel
    followers: Followers

    def end(self, status: int) -> None:
        """After serving: the other ranks leave (or are killed, when the group failed)."""
        self.followers.stop(timeout=GROUP_LEAVE_SECONDS if status == 0 else 0)
        if status == 0:
            self.collective.close()


def start_group(
    settings: Settings, model: ModelConfig, args: argparse.Namespace, device: torch.device
) -> StartedGroup | int:
    """Rank 0: check the model can be split, start ranks 1..N-1, join them and load this rank's
    shards; the exit status when it cannot."""
    from workers.models.parallel import GroupSpec, NoTensorParallelPlan, check_plan, join_group
    from workers.ops.group import Followers, free_address

    world = model.world_size
    try:
        quantized = detect_quantization(ModelFiles.of(model.path), settings.quantization) is not None
        check_plan(model.path, world, quantized)
    except NoTensorParallelPlan as exc:
        logger.error("model %s: %s", model.name, exc)
        return 2
    address = free_address()
    devices = ["cpu"] * world if device.type == "cpu" else [f"{device.type}:{r}" for r in range(world)]
    argv = ["--model", model.name, "--dtype", args.dtype, "--threads", str(args.threads)]
    argv += ["--prefill-threads", str(args.prefill_threads)]
    followers = Followers.start(world, argv, address, devices)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world))
    try:
        spec = GroupSpec(0, world, address, settings.group_timeout)
        collective, loaded = join_group(spec, device, model.path, args.dtype, followers.exited, settings.quantization)
    except RuntimeError as exc:
        logger.error("the device group did not start: %s", exc)
        followers.stop(timeout=0)
        return 1
    return StartedGroup(collective, loaded, followers)


def group_lost(loop: EngineLoop, beacon: Beacon, stop: threading.Event, rank: int, status: int) -> None:
    """A rank of the group exited: fail the group's requests and stop, so that the group restarts whole.
    If the engine thread is stuck in a collective past GROUP_ABORT_SECONDS, leave the live set and exit
    at once: the API fails a dead worker's requests by its heartbeat."""
    logger.error("rank %d of the device group exited (status %s): failing its requests and stopping", rank, status)
    loop.fatal = f"rank {rank} of the device group exited"
    loop.abort_all("A device of the worker's group failed; the worker restarts.")
    stop_self(stop)
    if not wait_idle(loop, time.monotonic() + GROUP_ABORT_SECONDS):
        logger.error("the engine did not fail its requests within %gs; exiting at once", GROUP_ABORT_SECONDS)
        beacon.heartbeat.end()
        os._exit(1)


def follow_group(settings: Settings, model: ModelConfig, args: argparse.Namespace) -> int:
    """Ranks 1..N-1 of a tensor-parallel group: load this rank's shards, then run the steps rank 0
    sends until it says stop; exit non-zero when the group breaks (rank 0 then restarts it)."""
    from workers.engine.core import CacheConfig
    from workers.models.attention import UnsupportedAttention
    from workers.models.device import resolve_device
    from workers.models.parallel import GroupSpec, follow, join_group
    from workers.models.runner import make_runner
    from workers.ops.group import die_with_leader, ignore_stop_signals

    die_with_leader()
    ignore_stop_signals()
    os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(args.world))
    try:
        device = resolve_device(args.device, settings.accelerator)
    except RuntimeError as exc:
        logger.error("rank %d: %s", args.rank, exc)
        return 2
    try:
        spec = GroupSpec(args.rank, args.world, args.group_address, settings.group_timeout)
        collective, loaded = join_group(spec, device, model.path, args.dtype, quantization=settings.quantization)
        runner = make_runner(
            loaded,
            settings.max_seq_len,
            settings.max_batch_size,
            CacheConfig.from_settings(settings, model).pool,
            args.threads,
            args.prefill_threads,
            collective,
        )
        gc.collect()
        gc.freeze()
        follow(runner, collective)
    except UnsupportedAttention as exc:  # refused by the probe forward, as rank 0 refuses it (exit 2)
        logger.error("rank %d: %s", args.rank, exc)
        return 2
    except Exception as exc:  # the group broke: rank 0 died, hung past the timeout, or this rank failed
        logger.error("rank %d: the device group broke (%s: %s); leaving", args.rank, type(exc).__name__, exc)
        return 1
    collective.close()
    logger.info("rank %d: left the device group", args.rank)
    return 0
