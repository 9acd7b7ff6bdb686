"""Ascend NPUs: torch_npu's fused infer-attention over the block tables, keys and values written in
place by slot. vllm-ascend's attention_v1 and MindIE-LLM's FIA backend call the same operators.

- Writing: `torch_npu.npu_scatter_pa_kv_cache` (`cache_mode="Norm"`: the caches in ND layout) scatters
  the step's keys and values into the pool viewed as [blocks, block_size, KV heads, dim], at int32 slot
  indices, as vllm-ascend writes on A2/A3; where torch_npu lacks it, `_npu_reshape_and_cache`, an ATB
  operator that needs CANN's NNAL package (MindIE-LLM's).
- Attending: one `npu_fused_infer_attention_score` call per layer for the whole packed step (decodes
  and prefill chunks alike) in layout TND: queries [tokens, heads, dim]; the pool viewed as
  [blocks, block_size, KV heads × dim]; `block_table` int32 [sequences, blocks];
  `actual_seq_lengths` the cumulative query ends; `actual_seq_lengths_kv` each sequence's context
  length; `sparse_mode=3` (causal, bottom-right) with the 2048 × 2048 compressed causal mask.
- Sliding windows: the operator's document says `pre_tokens`, `next_tokens` and `sparse_mode` are
  ignored where a sequence has one query (Q_S = 1, every decode), and its band mode's `pre_tokens`
  counts the tokens before the query, not the window. So a sliding-window layer is attended by the
  fused operator, causal, in a step where no sequence's context exceeds its window (the window then
  cuts nothing), and otherwise by the portable backend's gather and SDPA, masked to the window, which
  writes the layer's keys and values itself. Such layers keep blocks like the others (no rings).
- The kernels take 128-token blocks; there is no logit soft-capping (a model with it is served by the
  portable backend).
- Graphs (models/compile.py): a decode bucket's step is recorded as an `NPUGraph`, as vllm-ascend's full
  decode graphs are. The fused operator takes its lengths as host lists, which a graph would replay as
  they were at capture; so each layer's call is recorded as a task group of its own
  (`graph_task_group_begin/end`, the `.out` form with a workspace), behind an `ExternalEvent` the graph
  waits for, and before each replay it is issued again with the step's context lengths on an update
  stream (`graph_task_update_begin/end`), which records the event (torch_npu's NPUGraph API; the
  `test_aclgraph_update.py` of Ascend/pytorch shows the sequence). The recorded calls read one query and
  one output buffer per bucket, shared by the layers, and a block table as wide as the longest context.
  A model with sliding-window layers is not recorded: which kernels attend it depends on the contexts.

The metadata is plain Python and tensors; `prepare` runs on any host (tests check it against a
reference of what the operator computes).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from workers.models.attention import Pool, sequence_blocks
from workers.models.attention.portable import PortableBackend, PortableStep
from workers.models.device import host_to, to_device
from workers.models.step import StepBatch

BLOCK_SIZE = 128
MASK_SIZE = 2048  # the compressed causal mask sparse_mode 3 takes
CAUSAL = 3  # sparse_mode: right-down causal, with the compressed mask
# What recording the fused attention in a graph takes of torch_npu (torch_npu.npu's graph-task API).
GRAPH_API = (
    "ExternalEvent",
    "Stream",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "is_current_stream_capturing",
)
OPERATORS = ("_npu_fused_infer_attention_score_get_max_workspace",)


@dataclass
class NpuStep:
    """`slots` [tokens] (int32), `block_table` [sequences, longest table] (int32, padded with the row's
    first block), `query_ends` (cumulative query lengths) and `context_lens`, as the operator takes them;
    and where some context exceeds a sliding window of the model's, the portable backend's metadata
    for those layers."""

    slots: Any
    block_table: Any
    query_ends: list[int]
    context_lens: list[int]
    mask: Any = None
    windowed: PortableStep | None = None
    graph: GraphTasks | None = None  # a recorded bucket's: its fused-attention calls


@dataclass
class Task:
    """One layer's fused-attention call in a graph: its task group, the event the graph waits for
    before it, and the call's arguments (its lengths replaced before each replay)."""

    handle: Any
    event: Any
    call: dict[str, Any]


@dataclass
class GraphTasks:
    """The fused-attention calls of a bucket's graph, and the buffers they read and write."""

    tasks: list[Task] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The bucket's `name` buffer of `like`'s shape and type, made by the first layer recorded."""
        kept = self.buffers.get(name)
        if kept is None or kept.shape != like.shape or kept.dtype != like.dtype:
            kept = self.buffers[name] = torch.empty_like(like)
        return kept

    def record(self, call: dict[str, Any], out: torch.Tensor) -> None:
        """Record the fused-attention `call` (keyword arguments) as a task group of the graph being
        captured, writing into `out`."""
        import torch_npu

        npu = torch_npu.npu
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        query = self.buffer("query", call["query"])
        query.copy_(call["query"])
        call = {**call, "query": query}
        # Sized for any lengths; the bucket's largest so far serves each layer that needs no more.
        needed = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**call)
        kept = self.buffers.get("workspace")
        if kept is None or kept.numel() * kept.element_size() < needed.numel() * needed.element_size():
            self.buffers["workspace"] = needed
        outputs = [self.buffer("out", query), self.buffer("lse", query.new_empty(1))]
        call |= {"workspace": self.buffers["workspace"], "out": outputs}
        npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(**call)
        self.tasks.append(Task(npu.graph_task_group_end(stream), event, call))
        out.copy_(outputs[0].view(out.shape))

    def update(self, context_lens: list[int], stream: Any) -> None:
        """Issue every recorded call again with these context lengths on the update `stream`, for the
        graph's next replay."""
        import torch_npu

        npu = torch_npu.npu
        # The previous replay has run its calls before they change (vllm-ascend's ACLGraphWrapper too).
        npu.current_stream().synchronize()
        with npu.stream(stream):
            for task in self.tasks:
                task.call["actual_seq_lengths_kv"] = context_lens
                npu.graph_task_update_begin(stream, task.handle)
                torch_npu.npu_fused_infer_attention_score.out(**task.call)
                npu.graph_task_update_end(stream)
                task.event.record(stream)


class NpuBackend:
    name = "npu"
    block_size = BLOCK_SIZE
    rings = False
    softcap = False
    capturable = True
    compiles_per_batch = False

    def __init__(self) -> None:
        self._mask: torch.Tensor | None = None
        self.portable = PortableBackend()  # sliding-window layers past their window
        self._update_stream: Any = None  # one for every graph, as torch_npu's own updates keep (streams are few)
        # Whether npu_scatter_pa_kv_cache takes `cache_mode`, found at the first write: before op-plugin's
        # change of 2026-04 it had no such argument and wrote the NZ layout, so the ATB writer serves.
        self._scatter: bool | None = None

    def prepare(self, batch: StepBatch, pool: Pool) -> NpuStep:
        size = pool.block_size
        slots = batch.slots(size)
        widths = [-(-end // size) for end in batch.context_len]
        longest = max(widths)
        table = [blocks[:w] + [blocks[0]] * (longest - w) for blocks, w in zip(batch.block_tables, widths, strict=True)]
        ends = list(itertools.accumulate(batch.query_len))
        windows = [w for w in pool.windows if w]
        past = bool(windows) and max(batch.context_len) > min(windows)
        return NpuStep(
            torch.tensor(slots, dtype=torch.int32),
            torch.tensor(table, dtype=torch.int32),
            ends,
            list(batch.context_len),
            windowed=self.portable.prepare(batch, pool) if past else None,
        )

    def load(self, meta: NpuStep, device: torch.device) -> NpuStep:
        if self._mask is None or self._mask.device != device:
            causal = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8), diagonal=1)
            self._mask = causal.to(device)
        windowed = None if meta.windowed is None else self.portable.load(meta.windowed, device)
        return NpuStep(
            to_device(meta.slots, device),
            to_device(meta.block_table, device),
            meta.query_ends,
            meta.context_lens,
            self._mask,
            windowed,
        )

    def capture_meta(self, meta: NpuStep, pool: Pool, device: torch.device) -> NpuStep:
        import torch_npu

        if any(pool.windows):
            raise RuntimeError("the npu backend attends sliding-window layers past their window with other kernels")
        lacking = [name for name in GRAPH_API if not hasattr(torch_npu.npu, name)]
        lacking += [name for name in OPERATORS if not hasattr(torch_npu, name)]
        if not hasattr(torch_npu.npu_fused_infer_attention_score, "out"):
            lacking.append("npu_fused_infer_attention_score.out")
        if lacking:
            raise RuntimeError(f"this torch_npu lacks {', '.join(lacking)}")
        loaded = self.load(meta, device)
        table = loaded.block_table[:, :1].repeat(1, sequence_blocks(pool))  # unread columns: each row's first block
        table[:, : loaded.block_table.shape[1]] = loaded.block_table
        return replace(loaded, block_table=table, graph=GraphTasks())

    def refresh(self, captured: NpuStep, meta: NpuStep) -> None:
        assert captured.graph is not None and captured.query_ends == meta.query_ends
        host_to(captured.slots, meta.slots)
        host_to(captured.block_table[:, : meta.block_table.shape[1]], meta.block_table)
        if self._update_stream is None:
            import torch_npu

            self._update_stream = torch_npu.npu.Stream()
        captured.graph.update(meta.context_lens, self._update_stream)

    def forward(
        self,
        pool: Pool,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        meta: NpuStep,
        window: int,
        scale: float,
        softcap: float,
    ) -> None:
        import torch_npu

        if window and max(meta.context_lens) > window:
            assert meta.windowed is not None
            self.portable.forward(pool, layer, query, key, value, out, meta.windowed, window, scale, softcap)
            return
        keys, values = pool.keys[layer], pool.values[layer]
        kv_heads, dim = keys.shape[1], keys.shape[2]
        blocks = keys.shape[0] // pool.block_size
        caches = (
            keys.view(blocks, pool.block_size, kv_heads, dim),
            values.view(blocks, pool.block_size, kv_heads, dim),
        )
        if self._scatter is not False and hasattr(torch_npu, "npu_scatter_pa_kv_cache"):
            try:
                torch_npu.npu_scatter_pa_kv_cache(
                    key.contiguous(), value.contiguous(), *caches, meta.slots, cache_mode="Norm"
                )
                self._scatter = True
            except TypeError:
                if self._scatter:
                    raise
                self._scatter = False
        if not self._scatter:  # an older torch_npu: the ATB operator (CANN's NNAL package)
            torch_npu._npu_reshape_and_cache(
                key=key.contiguous(),
                value=value.contiguous(),
                key_cache=caches[0],
                value_cache=caches[1],
                slot_indices=meta.slots,
            )
        call = {
            "query": query.contiguous(),
            "key": keys.view(blocks, pool.block_size, kv_heads * dim),
            "value": values.view(blocks, pool.block_size, kv_heads * dim),
            "atten_mask": meta.mask,
            "block_table": meta.block_table,
            "input_layout": "TND",
            "block_size": pool.block_size,
            "actual_seq_lengths": meta.query_ends,
            "actual_seq_lengths_kv": meta.context_lens,
            "num_key_value_heads": kv_heads,
            "num_heads": query.shape[1],
            "scale": scale,
            "sparse_mode": CAUSAL,
        }
        if meta.graph is not None and torch_npu.npu.is_current_stream_capturing():
            meta.graph.record(call, out)
            return
        attended, _ = torch_npu.npu_fused_infer_attention_score(**call)
        out.copy_(attended.view(out.shape))
