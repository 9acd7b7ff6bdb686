"""Tensor parallelism: one model instance across the devices of a group, one process per device.

The ranks join one torch.distributed group (HCCL on Ascend, NCCL on CUDA, gloo on a CPU); transformers
shards the weights by the model's tensor-parallel plan (`DistributedConfig(tp_plan="auto")`: attention
and MLP projections split by heads and columns, an all-reduce after each row-wise projection, the LM
head's output gathered on every rank), and each rank's paged KV pool holds its own KV heads.

Rank 0 (the leader) is the engine: it schedules, samples and talks to Redis. Before each pass it sends
the step's plain arrays (models/step.py StepBatch: token ids, positions, block tables, lengths; built
on the host) to the other ranks (followers) over a gloo group, so that the message never waits on a device;
a token the leader drew on the device and has not read yet goes from its device to theirs with a
broadcast on the device group. Then every rank runs the same packed forward, and the collectives
inside it meet. While idle the leader sends a ping every PING_SECONDS, so every collective, the
followers' wait for the next step included, has a timeout (`groupTimeout`): a rank that hangs ends
the group instead of hanging it. A failure in a pass of the group is the group's failure
(runner.GroupBroken): the ranks cannot agree on which collective they are in any more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from schemas.model_files import ModelFiles
from workers.models.device import to_device
from workers.models.loader import LoadedModel, load_model
from workers.models.quant.sharded import refusal, unsupported
from workers.models.runner import GroupBroken, ModelRunner
from workers.models.step import StepBatch

logger = logging.getLogger(__name__)

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
# The leader sends a ping when it sent nothing for this long (its engine thread wakes at least
# every 0.5 s while idle).
PING_SECONDS = 1.0
# How long the ranks wait for each other to start: to arrive at the rendezvous (a rank's imports of
# torch, transformers and the device's backend take seconds to minutes), to load their shards and to
# compile their decode steps. It is not `groupTimeout`, which bounds each collective of a running
# group; a rank that dies while the group starts is noticed at once (rank 0 watches its children, the
# others die with rank 0).
START_TIMEOUT_SECONDS = 3600.0
ARRIVAL_POLL_SECONDS = 0.1
ARRIVED_KEY = "tokenline/arrived"  # the rendezvous store's count of the follower ranks that arrived
GO_KEY = "tokenline/go"  # set by rank 0 once every rank has arrived


class NoTensorParallelPlan(ValueError):
    """The model cannot be split over the group: no plan in transformers, or heads that do not divide."""


@dataclass(frozen=True)
class GroupSpec:
    """This process's place in its group: rank, world size, the leader's rendezvous address
    (tcp://host:port) and the timeout of every collective, in seconds."""

    rank: int
    world: int
    address: str
    timeout: float


def check_plan(path: Path, world: int, quantized: bool = False) -> None:
    """Refuse a model that `world` ranks cannot share, before anything loads; `quantized`: its weights
    are int8, which the plan must split only as tokenline splits them (quant/sharded.py)."""
    from transformers import AutoConfig

    files = ModelFiles.of(path)
    config = AutoConfig.from_pretrained(files.path, local_files_only=True, trust_remote_code=False).get_text_config()
    if not getattr(config, "base_model_tp_plan", None):
        raise NoTensorParallelPlan(
            f"model type {config.model_type!r} has no tensor-parallel plan in transformers, so it cannot be split "
            f"over {world} devices: serve it with worldSize 1"
        )
    problem = unsupported(config.base_model_tp_plan) if quantized else None
    if problem is not None:
        raise NoTensorParallelPlan(str(refusal(*problem, world)))
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % world or kv_heads % world:
        raise NoTensorParallelPlan(
            f"worldSize {world} must divide the model's {heads} attention heads and {kv_heads} KV heads"
        )


def kv_shards(model: torch.nn.Module, world: int) -> int:
    """How many ways the group splits the model's KV heads: `world` when the plan splits the key
    projection by columns (heads; DeepSeek-V2's latent attention splits the projection that decompresses
    its keys and values); 1 when it gathers it (a fused QKV projection, as in Phi-3) or leaves the
    attention whole on every rank (DeepSeek-V3's plan), and then every rank attends, and keeps, every
    KV head."""
    plan = getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {}
    keys = ("self_attn.k_proj", "self_attn.kv_b_proj")
    split = any(key.endswith(keys) and style == "colwise" for key, style in plan.items())
    if not split:
        logger.info("the tensor-parallel plan does not split the attention heads: each rank keeps every KV head")
    return world if split else 1


class GroupDidNotStart(RuntimeError):
    """A rank did not reach the rendezvous: it exited, or START_TIMEOUT_SECONDS passed."""


def rendezvous(spec: GroupSpec, lost: Callable[[], str | None] | None = None) -> dist.Store:
    """The group's store, once every rank has arrived at it. Rank 0 hosts it and waits for the others
    (asking `lost`, between polls, whether one of them exited: its reason, or None); the others wait
    for rank 0's go. Only then does the process group form, so its connections (bounded by the short
    `groupTimeout`) are made between ranks that are all there."""
    host, port = spec.address.removeprefix("tcp://").rsplit(":", 1)
    start = timedelta(seconds=START_TIMEOUT_SECONDS)
    store = dist.TCPStore(host, int(port), spec.world, spec.rank == 0, start, wait_for_workers=False)
    if spec.rank:
        store.add(ARRIVED_KEY, 1)
        store.wait([GO_KEY])
    else:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while store.add(ARRIVED_KEY, 0) < spec.world - 1:
            reason = lost() if lost is not None else None
            if reason is not None:
                raise GroupDidNotStart(reason)
            if time.monotonic() > deadline:
                raise GroupDidNotStart(f"the other ranks did not arrive within {START_TIMEOUT_SECONDS:g}s")
            time.sleep(ARRIVAL_POLL_SECONDS)
        store.set(GO_KEY, "1")
    store.set_timeout(timedelta(seconds=spec.timeout))
    return store


class Collective:
    """This rank's membership: the process group (the device's backend) and a gloo group beside it
    for the step messages."""

    def __init__(self, spec: GroupSpec, device: torch.device, lost: Callable[[], str | None] | None = None) -> None:
        self.spec = spec
        self.device = device
        backend = BACKENDS[device.type]
        timeout = timedelta(seconds=spec.timeout)
        if device.type != "cpu":  # HCCL and NCCL bind each rank's communicator to its current device
            getattr(torch, device.type).set_device(device)
        store = rendezvous(spec, lost)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world, timeout=timeout)
        self.control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        logger.info("rank %d of %d joined the group (%s) on %s", spec.rank, spec.world, backend, device)

    def loaded(self) -> None:
        """Wait until every rank has loaded its shards (they may take very different times)."""
        self._starting_barrier()

    def compiled(self) -> None:
        """Wait until every rank has compiled its decode step's graph (as `loaded`), before it runs."""
        self._starting_barrier()

    def _starting_barrier(self) -> None:
        dist.monitored_barrier(
            group=self.control, timeout=timedelta(seconds=START_TIMEOUT_SECONDS), wait_all_ranks=True
        )

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV blocks each rank's memory holds)."""
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(
    spec: GroupSpec,
    device: torch.device,
    path: Path,
    dtype: str,
    lost: Callable[[], str | None] | None = None,
    quantization: str = "",
) -> tuple[Collective, LoadedModel]:
    """A rank's start: join the group, load this rank's shards, wait until every rank has loaded
    (RuntimeError if one failed: its own log says why). `lost`: see `rendezvous`; `quantization`: the
    setting (loader.load_model)."""
    collective = Collective(spec, device, lost)
    loaded = load_model(path, device, dtype, spec.world, quantization)
    collective.loaded()
    return collective, loaded


class Leader:
    """Rank 0's side of the step messages (runner.StepSender)."""

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self.sent_at = time.monotonic()

    def send(self, batch: StepBatch, input_ids: torch.Tensor) -> None:
        self._post(("step", batch))
        if batch.pending:
            try:
                dist.broadcast(input_ids, src=0)
            except Exception as exc:
                raise GroupBroken(f"a rank of the device group failed: {exc}") from exc

    def ping(self) -> None:
        """While idle: show the followers the leader is alive (their wait has a timeout)."""
        if time.monotonic() - self.sent_at >= PING_SECONDS:
            self._post(("ping", None))

    def stop(self) -> None:
        """Tell the followers to leave (the leader is shutting down)."""
        try:
            self._post(("stop", None))
        except GroupBroken as exc:
            logger.warning("could not stop the other ranks: %s", exc)

    def _post(self, message: tuple[str, Any]) -> None:
        try:
            dist.broadcast_object_list([message], src=0, group=self.collective.control)
        except Exception as exc:
            raise GroupBroken(f"a rank of the device group failed: {exc}") from exc
        self.sent_at = time.monotonic()


def follow(runner: ModelRunner, collective: Collective) -> None:
    """A follower's life: run each step the leader sends until it says stop. Raises when the group
    breaks (the leader died or hung past the timeout)."""
    device = runner.device
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=collective.control)
        kind, batch = message[0]
        if kind == "stop":
            return
        if kind == "ping":
            continue
        if batch.pending:
            input_ids = torch.empty(batch.num_tokens, dtype=torch.long, device=device)
            dist.broadcast(input_ids, src=0)
        else:
            input_ids = to_device(torch.tensor(batch.token_ids, dtype=torch.long), device)
        runner.forward(batch, input_ids)
