"""CPU stand-ins for the device kernels the NPU and FlashInfer attention backends and the NPU's int8
products call, written from the operators' documented contracts (torch_npu's `npu_scatter_pa_kv_cache`,
`_npu_reshape_and_cache` and `npu_fused_infer_attention_score` in layout TND, its int8 operators; FlashInfer's
`BatchPrefillWithPagedKVCacheWrapper` and, in its CUDA-graph mode, `BatchDecodeWithPagedKVCacheWrapper`).

A pure seam: they let the tests run each backend's metadata (slots, block tables, cumulative and
per-sequence lengths, page offsets, windows) through a whole engine on the CPU and compare its output
with transformers'. They prove the backends call the operators as documented, not the operators
themselves: `make device-check` runs the real ones on a device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import types
from collections.abc import Callable
from typing import Any

import torch


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int, softcap: float
) -> torch.Tensor:
    """q [n, H, D] (the last n positions of a sequence of len(k)), k and v [len, KV heads, D]: causal
    from the bottom right, within `window` keys (self included) when it is > 0."""
    n, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(length - n, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    allowed = key_pos <= query_pos
    if window:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


class NpuGraphs:
    """`torch_npu.npu`'s graph-task API as its source and Ascend/pytorch's `test_aclgraph_update.py` use it,
    the rules of its sequence asserted: while a graph is captured, an `ExternalEvent` waited on and
    reset, then one operator in `graph_task_group_begin/end` (its handle); before a replay, on an update
    stream, `graph_task_update_begin(stream, handle)`, the same operator on the same tensors with new
    host arguments, `graph_task_update_end`, and the task's event recorded (else the replay waits
    forever).

    `record` stands in for NPUGraph capture, as compile.replay_on_host does for any device: its replay
    runs the recorded step again over the same buffers, and each fused-attention call in it takes the
    host arguments of its task as last updated, as a graph's replay would, not the ones the host code
    passes."""

    class Task:
        def __init__(self, event: Any) -> None:
            self.event = event
            self.call: dict[str, Any] | None = None
            self.updated = False

    def __init__(self) -> None:
        self.capturing = False
        self.current: object = "default stream"
        self.waiting: Any = None  # the event waited on before the next task group
        self.group: NpuGraphs.Task | None = None  # the task group being captured
        self.updating: NpuGraphs.Task | None = None
        self.updated: NpuGraphs.Task | None = None  # the task an update ended last
        self.replaying: Any = None  # an iterator over the replayed graph's tasks
        self.replays: list[int] = []  # each replay's task count
        self.tasks: list[NpuGraphs.Task] = []  # every task group captured
        runtime = self

        class ExternalEvent:
            def __init__(self) -> None:
                self.recorded = False

            def wait(self, stream: object) -> None:
                assert runtime.capturing and runtime.group is None and stream is runtime.current
                runtime.waiting = self

            def reset(self, stream: object) -> None:
                assert runtime.waiting is self

            def record(self, stream: object) -> None:
                assert runtime.updated is not None and runtime.updated.event is self and stream is runtime.current
                self.recorded = True

        class Stream:
            def synchronize(self) -> None:
                pass

        self.ExternalEvent = ExternalEvent
        self.Stream = Stream
        self._default = Stream()
        self.current = self._default

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def current_stream(self) -> object:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: object) -> Any:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def graph_task_group_begin(self, stream: object) -> None:
        assert self.capturing and self.group is None and self.waiting is not None and stream is self.current
        self.group, self.waiting = self.Task(self.waiting), None

    def graph_task_group_end(self, stream: object) -> Task:
        task, self.group = self.group, None
        assert task is not None and task.call is not None and stream is self.current, "one operator a task group"
        self.tasks.append(task)
        return task

    def graph_task_update_begin(self, stream: object, handle: Task) -> None:
        assert not self.capturing and self.updating is None and stream is self.current is not self._default
        self.updating, handle.updated = handle, False

    def graph_task_update_end(self, stream: object) -> None:
        assert self.updating is not None and self.updating.updated and stream is self.current
        self.updated, self.updating = self.updating, None

    def record(self, step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        start = len(self.tasks)
        self.capturing = True
        try:
            out = step()
        finally:
            self.capturing = False
        tasks = self.tasks[start:]

        def replay() -> None:
            for task in tasks:
                assert task.event.recorded, "a replay waits for the event its task's update records"
                task.event.recorded = False
            self.replaying = iter(tasks)
            try:
                out.copy_(step())
                assert next(self.replaying, None) is None, "every recorded task replayed"
            finally:
                self.replaying = None
            self.replays.append(len(tasks))

        return out, replay

    def call(self, call: dict[str, Any]) -> dict[str, Any]:
        """The host arguments a fused-attention call runs with: in a replay, its task's."""
        if self.replaying is None:
            return call
        task = next(self.replaying)
        lengths = {k: task.call[k] for k in ("actual_seq_lengths", "actual_seq_lengths_kv")}
        return {**call, **lengths}

    def out_call(self, call: dict[str, Any]) -> None:
        """The `.out` form captured into a task group, or issued again to update one."""
        if self.group is not None:
            assert self.group.call is None
            self.group.call = dict(call)
        elif self.updating is not None:
            recorded = self.updating.call
            assert recorded is not None and recorded.keys() == call.keys()
            for name, value in call.items():
                if name in ("actual_seq_lengths", "actual_seq_lengths_kv"):
                    continue
                tensors = value if isinstance(value, list) else [value]
                before = recorded[name] if isinstance(recorded[name], list) else [recorded[name]]
                assert all(
                    a is b or (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr())
                    for a, b in zip(tensors, before, strict=True)
                ), f"an update changes the task's {name}: a graph's tensors stay where they were captured"
            self.updating.call = dict(call)
            self.updating.updated = True


def torch_npu() -> types.ModuleType:
    """`torch_npu` with the operators the NPU attention backend and the NPU int8 products call, and
    the graph-task API of `torch_npu.npu` (NpuGraphs)."""
    module = types.ModuleType("torch_npu")
    graphs = NpuGraphs()
    module.npu = graphs  # type: ignore[attr-defined]

    def _npu_reshape_and_cache(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_indices: torch.Tensor,
    ) -> None:
        assert slot_indices.dtype == torch.int32
        flat = slot_indices.long()
        key_cache.view(-1, *key_cache.shape[2:])[flat] = key
        value_cache.view(-1, *value_cache.shape[2:])[flat] = value

    def npu_scatter_pa_kv_cache(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        cache_mode: str = "PA_NZ",
    ) -> None:
        # ND caches ('Norm'), 3-D keys and values of the caches' type, contiguous ("输入参数不支持非连续").
        assert cache_mode == "Norm" and key.dim() == value.dim() == 3 and key_cache.dim() == value_cache.dim() == 4
        assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
        assert all(t.is_contiguous() for t in (key, value, key_cache, value_cache))
        assert slot_mapping.dtype in (torch.int32, torch.int64)
        flat = slot_mapping.long()
        key_cache.view(-1, *key_cache.shape[2:])[flat] = key
        value_cache.view(-1, *value_cache.shape[2:])[flat] = value

    def attend(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor,
        block_table: torch.Tensor,
        input_layout: str,
        block_size: int,
        actual_seq_lengths: list[int],
        actual_seq_lengths_kv: list[int],
        num_key_value_heads: int,
        num_heads: int,
        scale: float,
        sparse_mode: int,
    ) -> tuple[torch.Tensor, None]:
        # sparse_mode 3: causal from the bottom right, with the 2048 × 2048 compressed mask. (A band, mode
        # 4, is not emulated: its pre_tokens are ignored where a sequence has one query, and the backend
        # does not call it.)
        assert input_layout == "TND" and block_table.dtype == torch.int32 and atten_mask.shape == (2048, 2048)
        assert sparse_mode == 3 and query.shape[1] == num_heads and actual_seq_lengths[-1] == query.shape[0]
        dim = query.shape[2]
        keys = key.reshape(-1, num_key_value_heads, dim)
        values = value.reshape(-1, num_key_value_heads, dim)
        out = torch.empty_like(query)
        start = 0
        for row, (end, length) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv, strict=True)):
            blocks = block_table[row].long()
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
            out[start:end] = _attend(query[start:end], keys[slots], values[slots], scale, 0, 0.0)
            start = end
        return out, None

    # The operator, its `.out` form and its workspace query take `attend`'s arguments (their signature,
    # through functools.wraps, is what tests/test_device_interfaces.py holds to torch-npu's schema).
    @functools.wraps(attend)
    def npu_fused_infer_attention_score(**call: Any) -> tuple[torch.Tensor, None]:
        return attend(**graphs.call(call))

    def fused_out(*, workspace: torch.Tensor, out: list[torch.Tensor], **call: Any) -> list[torch.Tensor]:
        # `Tensor? workspace=None, Tensor(a!) attention_out, Tensor(b!) softmax_lse`, passed as out=[...].
        assert isinstance(workspace, torch.Tensor) and len(out) == 2
        assert out[0].shape == call["query"].shape and out[0].dtype == call["query"].dtype
        graphs.out_call({**call, "workspace": workspace, "out": out})
        if graphs.updating is None:  # an update changes the task; it computes nothing
            out[0].copy_(attend(**graphs.call(call))[0])
        return out

    @functools.wraps(attend)
    def get_max_workspace(**call: Any) -> torch.Tensor:
        assert "workspace" not in call and "out" not in call
        attend(**call)  # the same arguments as the operator's
        return torch.empty(64, dtype=torch.uint8)

    npu_fused_infer_attention_score.out = fused_out  # type: ignore[attr-defined]
    module._npu_fused_infer_attention_score_get_max_workspace = get_max_workspace  # type: ignore[attr-defined]

    module._npu_reshape_and_cache = _npu_reshape_and_cache  # type: ignore[attr-defined]
    module.npu_scatter_pa_kv_cache = npu_scatter_pa_kv_cache  # type: ignore[attr-defined]
    module.npu_fused_infer_attention_score = npu_fused_infer_attention_score  # type: ignore[attr-defined]
    for name, function in _npu_int8_operators().items():
        setattr(module, name, function)
    return module


HALVES = (torch.float16, torch.bfloat16)
MAX_DIM = 65535  # "x1与x2最后一维的shape大小不能超过65535"; npu_weight_quant_batchmatmul: K, N in [1, 65535]


def _npu_int8_operators() -> dict[str, Any]:
    """torch_npu's int8 operators as their documents (op-plugin, docs/zh/custom_APIs/torch_npu) define
    them for Atlas A2/A3, their type rules asserted: npu_dynamic_quant, npu_quantize (div_mode False),
    npu_trans_quant_param, npu_quant_matmul (int8 inputs, the table of allowed type combinations) and
    npu_weight_quant_batchmatmul. The integer products are exact; the rest in float32."""

    def npu_dynamic_quant(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # torch_npu's name
        assert input.dtype in HALVES and input.dim() > 1  # "数据类型支持float16、bfloat16"
        rows = input.float()
        scale = rows.abs().amax(-1).clamp(min=1e-12) / 127  # float32, x's shape less its last dimension
        return torch.round(rows / scale.unsqueeze(-1)).clamp(-128, 127).to(torch.int8), scale

    def npu_quantize(
        input: torch.Tensor,  # torch_npu's name
        scales: torch.Tensor,
        zero_points: torch.Tensor,
        dtype: Any,
        axis: int,
        div_mode: bool,
    ) -> torch.Tensor:
        # div_mode False: scales and zero points of the input's type, one per element of the last axis.
        assert not div_mode and dtype == torch.qint8 and axis == -1
        assert scales.dtype == zero_points.dtype == input.dtype
        assert scales.shape == zero_points.shape == input.shape[-1:]
        values = input.float() * scales.float() + zero_points.float()
        return torch.round(values).clamp(-128, 127).to(torch.int8)

    def npu_trans_quant_param(scale: torch.Tensor, offset: Any = None, round_mode: int = 0) -> torch.Tensor:
        assert scale.dtype == torch.float32 and scale.is_contiguous() and offset is None
        # float32 truncated to FP19, packed into int64 with the flag bit 46.
        return (scale.view(torch.int32).long() & 0xFFFFE000) | (1 << 46)

    def npu_quant_matmul(
        x1: torch.Tensor,
        x2: torch.Tensor,
        scale: torch.Tensor,
        *,
        offset: Any = None,
        pertoken_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        assert x1.dtype == x2.dtype == torch.int8 and x1.shape[-1] == x2.shape[0] and offset is None
        assert x1.shape[-1] <= MAX_DIM and x2.shape[-1] <= MAX_DIM
        n = x2.shape[-1]
        assert scale.dim() == 1 and scale.shape[0] in (1, n) and (bias is None or bias.shape == (n,))
        if pertoken_scale is not None:
            assert pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == x1.shape[:-1]
        floats = (torch.int32, torch.bfloat16, torch.float32)
        if output_dtype == torch.bfloat16:  # the table's third row
            assert scale.dtype in (torch.float32, torch.bfloat16) and (bias is None or bias.dtype in floats)
        elif output_dtype == torch.float16 and pertoken_scale is not None:  # the fourth
            assert scale.dtype == torch.float32 and (bias is None or bias.dtype in floats)
        else:  # float16 without a per-token scale: int64 (a float32 scale is refused in graph mode)
            assert output_dtype == torch.float16 and scale.dtype == torch.int64
            assert bias is None or bias.dtype == torch.int32
        if scale.dtype == torch.int64:
            scale = (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        accumulators = (x1.long() @ x2.long()).float()
        if bias is not None and bias.dtype == torch.int32:
            y = (accumulators + bias.float()) * scale.float()
        else:
            y = accumulators * scale.float()
            if pertoken_scale is not None:
                y = y * pertoken_scale.unsqueeze(-1)
            if bias is not None:
                y = y + bias.float()
        return y.to(output_dtype)

    def npu_weight_quant_batchmatmul(
        x: torch.Tensor,
        weight: torch.Tensor,
        antiquant_scale: torch.Tensor,
        antiquant_offset: torch.Tensor | None = None,
        *,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert x.dtype in HALVES and x.dim() == 2 and weight.dtype == torch.int8 and weight.shape[0] == x.shape[1]
        assert max(weight.shape) <= MAX_DIM
        n = weight.shape[1]
        assert antiquant_scale.dtype == x.dtype and antiquant_scale.shape == (n,)
        assert antiquant_offset is None or (antiquant_offset.dtype == x.dtype and antiquant_offset.shape == (n,))
        # "当x数据类型为bfloat16，bias需为float32；当x数据类型为float16，bias需为float16"
        assert bias is None or bias.dtype == (torch.float32 if x.dtype == torch.bfloat16 else torch.float16)
        offset = 0.0 if antiquant_offset is None else antiquant_offset.float()
        y = x.float() @ ((weight.float() + offset) * antiquant_scale.float())
        return (y if bias is None else y + bias.float()).to(x.dtype)

    return {
        "npu_dynamic_quant": npu_dynamic_quant,
        "npu_quantize": npu_quantize,
        "npu_trans_quant_param": npu_trans_quant_param,
        "npu_quant_matmul": npu_quant_matmul,
        "npu_weight_quant_batchmatmul": npu_weight_quant_batchmatmul,
    }


def flashinfer(version: str = "0.6.18") -> types.ModuleType:
    """`flashinfer` (as release `version`) with the paged prefill wrapper and the graph-mode decode
    wrapper the CUDA backend calls, and `graphs`, the stand-in's own recorder of CUDA graphs."""
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)  # found by importlib.util.find_spec
    module.__version__ = version  # type: ignore[attr-defined]

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str) -> None:
            assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
            self.planned: dict[str, Any] | None = None

        def plan(
            self,
            qo_indptr: torch.Tensor,
            paged_kv_indptr: torch.Tensor,
            paged_kv_indices: torch.Tensor,
            paged_kv_last_page_len: torch.Tensor,
            num_qo_heads: int,
            num_kv_heads: int,
            head_dim_qk: int,
            page_size: int,
            *,
            causal: bool,
            sm_scale: float,
            window_left: int,
            logits_soft_cap: float | None,
            q_data_type: torch.dtype,
            kv_data_type: torch.dtype,
        ) -> None:
            for array in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
                assert array.dtype == torch.int32
            self.planned = {
                "qo": qo_indptr.tolist(),
                "pages": paged_kv_indptr.tolist(),
                "indices": paged_kv_indices.long(),
                "last": paged_kv_last_page_len.tolist(),
                "page_size": page_size,
                "num_qo_heads": num_qo_heads,
                "num_kv_heads": num_kv_heads,
                "head_dim": head_dim_qk,
                "causal": causal,
                "sm_scale": sm_scale,
                "window_left": window_left,
                "logits_soft_cap": logits_soft_cap,
                "q_data_type": q_data_type,
                "kv_data_type": kv_data_type,
            }

        def run(
            self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *, out: torch.Tensor
        ) -> torch.Tensor:
            plan = self.planned
            assert plan is not None and plan["causal"]
            k_cache, v_cache = paged_kv_cache
            # What the wrapper checks against its plan: the types, the packed rows, the heads, the output.
            assert q.dtype == plan["q_data_type"] and k_cache.dtype == v_cache.dtype == plan["kv_data_type"]
            assert q.shape == (plan["qo"][-1], plan["num_qo_heads"], plan["head_dim"])
            assert k_cache.shape[1:] == (plan["page_size"], plan["num_kv_heads"], plan["head_dim"])
            assert out.shape == q.shape and out.dtype == q.dtype
            size = plan["page_size"]
            window = plan["window_left"] + 1 if plan["window_left"] >= 0 else 0
            for row in range(len(plan["last"])):
                pages = plan["indices"][plan["pages"][row] : plan["pages"][row + 1]]
                length = (len(pages) - 1) * size + plan["last"][row]
                keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:length]
                values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:length]
                a, b = plan["qo"][row], plan["qo"][row + 1]
                out[a:b] = _attend(q[a:b], keys, values, plan["sm_scale"], window, plan["logits_soft_cap"] or 0.0)
            return out

    class BatchDecodeWithPagedKVCacheWrapper:
        """The decode wrapper in CUDA-graph mode (decode.py of FlashInfer 0.6.18 and 0.7.2): the batch
        is fixed by its buffers; `plan` (host work, never inside a graph) copies the step into them;
        `run` reads them, as a replayed graph's kernels do, not anything the host passes at the
        replay."""

        def __init__(
            self,
            float_workspace_buffer: torch.Tensor,
            kv_layout: str = "NHD",
            use_cuda_graph: bool = False,
            use_tensor_cores: bool = False,
            paged_kv_indptr_buffer: torch.Tensor | None = None,
            paged_kv_indices_buffer: torch.Tensor | None = None,
            paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        ) -> None:
            workspace = float_workspace_buffer
            assert kv_layout == "NHD" and workspace.dtype == torch.uint8 and use_cuda_graph
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            assert all(b is not None and b.dtype == torch.int32 and b.device == workspace.device for b in buffers)
            self.indptr, self.indices, self.last = buffers  # type: ignore[assignment]
            self.batch = len(self.last)
            assert len(self.indptr) == self.batch + 1
            self.tensor_cores = use_tensor_cores
            self.planned: dict[str, Any] | None = None
            graphs.wrappers.append(self)

        def plan(
            self,
            indptr: torch.Tensor,
            indices: torch.Tensor,
            last_page_len: torch.Tensor,
            num_qo_heads: int,
            num_kv_heads: int,
            head_dim: int,
            page_size: int,
            *,
            window_left: int = -1,
            logits_soft_cap: float | None = None,
            q_data_type: torch.dtype = torch.float16,
            kv_data_type: torch.dtype | None = None,
            sm_scale: float | None = None,
        ) -> None:
            assert not graphs.recording, "plan cannot be used in a CUDA graph"
            assert self.tensor_cores or num_qo_heads // num_kv_heads in (1, 2, 3, 4, 6, 8)
            if len(last_page_len) != self.batch:
                raise ValueError("The batch size should be fixed during the lifecycle of the wrapper")
            if len(indices) > len(self.indices):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self.indptr.copy_(indptr)
            self.indices[: len(indices)].copy_(indices)
            self.last.copy_(last_page_len)
            graphs.plans += 1
            self.planned = {
                "num_qo_heads": num_qo_heads,
                "num_kv_heads": num_kv_heads,
                "head_dim": head_dim,
                "page_size": page_size,
                "window": window_left + 1 if window_left >= 0 else 0,
                "softcap": logits_soft_cap or 0.0,
                "q_data_type": q_data_type,
                "kv_data_type": kv_data_type or q_data_type,
                "sm_scale": sm_scale if sm_scale is not None else head_dim**-0.5,
            }

        def run(
            self,
            q: torch.Tensor,
            paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
            *,
            out: torch.Tensor | None = None,
        ) -> torch.Tensor:
            plan = self.planned
            assert plan is not None, "run before plan"
            k_cache, v_cache = paged_kv_cache
            assert q.dtype == plan["q_data_type"] and k_cache.dtype == v_cache.dtype == plan["kv_data_type"]
            assert q.shape == (self.batch, plan["num_qo_heads"], plan["head_dim"])
            assert k_cache.shape[1:] == (plan["page_size"], plan["num_kv_heads"], plan["head_dim"])
            out = torch.empty_like(q) if out is None else out
            assert out.shape == q.shape and out.dtype == q.dtype
            graphs.runs += 1
            size, indptr, last = plan["page_size"], self.indptr.tolist(), self.last.tolist()
            for row in range(self.batch):
                pages = self.indices[indptr[row] : indptr[row + 1]].long()
                length = (len(pages) - 1) * size + last[row]
                keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:length]
                values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:length]
                out[row : row + 1] = _attend(
                    q[row : row + 1], keys, values, plan["sm_scale"], plan["window"], plan["softcap"]
                )
            return out

    class Graphs:
        """Stands in for CUDA graph capture on the CPU (as compile.replay_on_host): the replay runs the
        recorded step again over the same buffers; while either runs, `plan` is refused."""

        def __init__(self) -> None:
            self.recording = False
            self.wrappers: list[BatchDecodeWithPagedKVCacheWrapper] = []
            self.plans = self.runs = 0

        def record(self, step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
            out = self._recorded(step)
            return out, lambda: out.copy_(self._recorded(step))

        def _recorded(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
            self.recording = True
            try:
                return step()
            finally:
                self.recording = False

    graphs = Graphs()
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    module.graphs = graphs  # type: ignore[attr-defined]  # the stand-in's own: not FlashInfer's
    return module
