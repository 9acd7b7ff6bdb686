"""Attention over the paged KV pool: one interface, one backend per device.

For each attention layer of a step a backend does two things: it writes the step's keys and values
into the layer's pool at their slots, and it attends the step's packed queries over each sequence's
blocks (causal within the sequence, within the layer's sliding window if it has one, with logit
soft-capping where the model asks for it, GQA). Before each step the runner asks the backend for the
step's metadata, built on the host from the plain arrays of models/step.py (`prepare`) and moved to the
device (`load`); the layers then call the attention op, which finds it in the forward context.

The op is a registered torch custom op, `tokenline::paged_attention`, that writes into an output
buffer it is given and returns nothing: torch.compile keeps it out of the compiled graph as one opaque
call (vLLM's piecewise scheme) and compiles the rest of the forward around it.

Backends (`attentionBackend`; `auto` picks by device and installed packages):
- `portable` (attention/portable.py): any device; gathers each group's context and calls SDPA. `auto`
  on a CPU.
- `flex` (attention/flex.py): decodes through flex_attention over the pool in place, 128-token blocks;
  `auto` on a GPU without FlashInfer (heads of 16 dimensions and up). Its decode step can be captured.
- `npu` (attention/npu.py): torch_npu's fused infer-attention over the block tables, 128-token blocks.
  Its decode step can be captured, its attention calls updated with each step's lengths.
- `flashinfer` (attention/cuda.py): FlashInfer's paged prefill kernel, when the package is installed.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import AttentionInterface

from workers.models.step import StepBatch

logger = logging.getLogger(__name__)

ATTENTION = "tokenline_paged"  # the model's attention implementation, in transformers' registry
BACKENDS = ("auto", "portable", "flex", "npu", "flashinfer")
FLEX_GPU_MIN_HEAD_DIM = 16  # flex_attention's Triton kernels: "embedding dimension … must be at least 16"
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_MIN_VERSION = "0.2.1.post2"
# npu_fused_infer_attention_score in the TND layout, without rope: heads of these sizes (CANN's own
# check, "queryD … must be same equal 192/128/64"), float16 and bfloat16 queries.
NPU_HEAD_DIMS = (64, 128, 192)


class Pool(Protocol):
    """The KV pool as a backend reads it (models/kv_pool.py PagedKV)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    windows: tuple[int, ...]
    block_size: int
    ring_tokens: int


class AttentionBackend(Protocol):
    name: str
    block_size: int | None  # the one block size its kernels take (None: any)
    rings: bool  # sliding-window layers keep a ring per batch slot (else they keep blocks, masked)
    softcap: bool  # it computes logit soft-capping (Gemma 2)
    capturable: bool  # a decode step's metadata has one shape per batch size (models/compile.py)
    compiles_per_batch: bool  # its kernels compile once per batch size (warmed for every bucket)

    def prepare(self, batch: StepBatch, pool: Pool) -> Any:
        """The step's metadata on the host (no device work)."""
        ...

    def load(self, meta: Any, device: torch.device) -> Any:
        """The metadata on the device, ready for the step's layers."""
        ...

    def forward(
        self,
        pool: Pool,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        meta: Any,
        window: int,
        scale: float,
        softcap: float,
    ) -> None:
        """Write `key`/`value` [tokens, KV heads, dim] into the layer's pool, attend `query`
        [tokens, heads, dim] and write the result into `out` [tokens, heads, dim]."""
        ...

    # A capturable backend's decode steps are recorded as device graphs (models/compile.py):

    def capture_meta(self, meta: Any, pool: Pool, device: torch.device) -> Any:
        """The metadata a bucket's graph is recorded over (from the host metadata of a padded step):
        device buffers that every later step of the bucket is copied into. RuntimeError where the
        model's steps cannot be recorded."""
        ...

    def refresh(self, captured: Any, meta: Any) -> None:
        """Copy a step's host metadata `meta` into the bucket's recorded `captured`, before its replay."""
        ...


@dataclass
class StepContext:
    """What the attention op of every layer reads during one forward pass."""

    backend: AttentionBackend
    pool: Pool
    meta: Any


_CONTEXT: StepContext | None = None


@contextmanager
def forward_context(backend: AttentionBackend, pool: Pool, meta: Any) -> Iterator[None]:
    """The step's attention metadata, for the ops of the forward pass run inside the block."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, StepContext(backend, pool, meta)
    try:
        yield
    finally:
        _CONTEXT = previous


# The attention op, defined with torch.library's low-level API: a call costs ~2.5 µs against ~16 µs
# through `torch.library.custom_op` (its wrapper's per-call checks), once per layer per step.
torch.library.define(
    "tokenline::paged_attention",
    "(Tensor query, Tensor key, Tensor value, Tensor(a!) out, int layer, int window, float scale, float softcap) -> ()",
)


@torch.library.impl("tokenline::paged_attention", "CompositeExplicitAutograd")
def paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    layer: int,
    window: int,
    scale: float,
    softcap: float,
) -> None:
    """One layer's attention over the pool (the keys and values of the pool are written as a side
    effect: the op is opaque to the compiler and runs in program order)."""
    context = _CONTEXT
    if context is None:
        raise RuntimeError(f"the {ATTENTION} attention runs only inside tokenline's model runner")
    context.backend.forward(context.pool, layer, query, key, value, out, context.meta, window, scale, softcap)


@torch.library.register_fake("tokenline::paged_attention")
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    layer: int,
    window: int,
    scale: float,
    softcap: float,
) -> None:
    return None


def sequence_blocks(pool: Pool) -> int:
    """The most blocks one sequence can hold: its longest context's (the pool's context, where it knows
    one; else every slot of the pool). A captured bucket's tables are this wide for every row."""
    return -(-(getattr(pool, "context", 0) or pool.keys[0].shape[0]) // pool.block_size)


def layer_window(declared: int | None, kept: int, context: int, layer: int) -> int:
    """The window a layer attends: the pool's (0 for a window at or above the context, which is full
    attention); RuntimeError if the model and the pool disagree."""
    declared = int(declared or 0)
    if declared != kept and not (kept == 0 and context and declared >= context):
        raise RuntimeError(f"layer {layer}: the model attends a window of {declared}, the pool keeps {kept}")
    return kept


# What some architectures pass the attention function that changes its result, and that no backend
# computes: a learned sink logit per head (gpt-oss, and others: `s_aux`, `sinks`), an additive position
# bias (ALiBi: MPT).
UNSUPPORTED = {"s_aux": "attention sinks", "sinks": "attention sinks", "position_bias": "a position bias (ALiBi)"}


class UnsupportedAttention(RuntimeError):
    """The model's attention is not one tokenline computes: raised by its first forward (the runner's
    probe, before the worker serves), never answered wrongly."""


def unsupported(kwargs: dict[str, object]) -> None:
    """UnsupportedAttention where the model asks the attention for what no backend computes."""
    for name, what in UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(
                f"its attention adds {what} (`{name}`), which tokenline's attention backends do not compute"
            )


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, heads, tokens, dim], key and value
    [1, KV heads, tokens, dim] (the values' dim may differ: DeepSeek's latent attention); returns
    [1, tokens, heads, the values' dim]. The model passes no mask: the step's metadata carries each
    sequence's extent."""
    unsupported(kwargs)
    context = _CONTEXT
    if context is None:
        raise RuntimeError(f"the {ATTENTION} attention runs only inside tokenline's model runner")
    layer = int(module.layer_idx)  # type: ignore[attr-defined]
    pool = context.pool
    window = layer_window(sliding_window, pool.windows[layer], getattr(pool, "context", 0), layer)
    q = query[0].transpose(0, 1)
    out = torch.empty((*q.shape[:-1], value.shape[-1]), dtype=q.dtype, device=q.device)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    torch.ops.tokenline.paged_attention(
        q, key[0].transpose(0, 1), value[0].transpose(0, 1), out, layer, window, scale, float(softcap or 0.0)
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION, paged_attention)


def select_backend(
    device: torch.device,
    requested: str = "auto",
    softcap: bool = False,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    value_dim: int = 0,
) -> AttentionBackend:
    """The backend for `device`: the one `requested`, or with `auto` the device's own (the portable
    one where its package is missing, or where the model needs what the kernel lacks). Logged.
    `value_dim`: the values' head size where it is not the keys' (0: it is)."""
    if requested not in BACKENDS:
        raise ValueError(f"attentionBackend {requested!r}: one of {', '.join(BACKENDS)}")
    name = _native(device) if requested == "auto" else requested
    smallest = min(head_dim, value_dim or head_dim)
    lacking = {"flashinfer": _flashinfer_lacks, "npu": _npu_lacks}.get(name, lambda *_: None)(head_dim, dtype)
    if name in ("flashinfer", "npu") and value_dim and value_dim != head_dim:
        # Their paged kernels read keys and values of one head size: a forced one cannot serve the model.
        lacking = f"its kernels take keys and values of one head size, not {head_dim} and {value_dim}"
        if requested != "auto":
            raise ValueError(f"attentionBackend {requested}: {lacking}")
    if requested == "auto":
        if lacking:
            fallback = "flex" if name == "flashinfer" else "portable"
            logger.info("%s: %s serves", lacking, fallback)
            name = fallback
        if name != "portable" and softcap and not _backend(name, device).softcap:
            logger.info("the %s attention kernels have no logit soft-capping: the portable backend serves", name)
            name = "portable"
        if name == "flex" and smallest < FLEX_GPU_MIN_HEAD_DIM:
            logger.info(
                "flex_attention's GPU kernels take heads of %d dimensions and up: the portable backend serves",
                FLEX_GPU_MIN_HEAD_DIM,
            )
            name = "portable"
    backend = _backend(name, device)
    if backend.name != "portable" and softcap and not backend.softcap:
        raise ValueError(f"attentionBackend {name}: the model's logit soft-capping is not in its kernels")
    if requested in ("flashinfer", "npu") and lacking:
        logger.warning("attentionBackend %s: %s", requested, lacking)
    if backend.name == "flex" and device.type != "cpu" and smallest < FLEX_GPU_MIN_HEAD_DIM:
        raise ValueError(
            f"attentionBackend flex: flex_attention's GPU kernels take heads of {FLEX_GPU_MIN_HEAD_DIM} "
            f"dimensions and up; the model's have {smallest}"
        )
    logger.info("attention backend: %s on %s", backend.name, device)
    return backend


def _flashinfer_lacks(head_dim: int, dtype: torch.dtype) -> str | None:
    """What FlashInfer's kernels cannot do for the model, if anything: they take float16 and bfloat16
    (its kernel type map) and heads of 64, 128 or 256 dimensions (its prebuilt and Hopper kernels; vLLM
    refuses other sizes), from the release whose paged prefill `run` takes `out=` (0.2.1.post2)."""
    import flashinfer
    from packaging.version import Version

    version = str(getattr(flashinfer, "__version__", "0"))
    if Version(version) < Version(FLASHINFER_MIN_VERSION):
        return f"FlashInfer {version} is older than {FLASHINFER_MIN_VERSION}"
    return _kernel_lacks("FlashInfer's kernels", FLASHINFER_HEAD_DIMS, head_dim, dtype)


def _npu_lacks(head_dim: int, dtype: torch.dtype) -> str | None:
    """What the NPU's fused attention cannot do for the model, if anything (NPU_HEAD_DIMS)."""
    return _kernel_lacks("the NPU's fused attention kernels", NPU_HEAD_DIMS, head_dim, dtype)


def _kernel_lacks(kernels: str, head_dims: tuple[int, ...], head_dim: int, dtype: torch.dtype) -> str | None:
    """What `kernels`, which take float16 and bfloat16 heads of `head_dims` dimensions, lack for the model."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{kernels} take float16 and bfloat16, not {dtype}"
    if head_dim not in head_dims:
        dims = ", ".join(map(str, head_dims[:-1])) + f" or {head_dims[-1]}"
        return f"{kernels} take heads of {dims} dimensions, not {head_dim}"
    return None


def _native(device: torch.device) -> str:
    """The NPU's fused kernels; on a GPU FlashInfer where it is installed, else flex_attention (a
    decode step it serves can be captured as a device graph, models/compile.py)."""
    if device.type == "npu":
        return "npu"
    if device.type == "cuda":
        return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "flex"
    return "portable"


def _backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "npu":
        from workers.models.attention.npu import NpuBackend

        return NpuBackend()
    if name == "flashinfer":
        from workers.models.attention.cuda import FlashInferBackend

        return FlashInferBackend()
    if name == "flex":
        from workers.models.attention.flex import FlexBackend

        return FlexBackend(split_kv=device.type != "cpu", pad_groups=device.type != "cpu")
    from workers.models.attention.portable import PortableBackend

    return PortableBackend()
