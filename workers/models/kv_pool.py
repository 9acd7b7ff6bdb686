"""The KV pool on the device: its shape from the model's configuration, its size from npuMemSize, and
the buffers the attention backends (models/attention/) write and read.

Per full-attention layer, keys and values [blocks × block_size, KV heads, head_dim], block-major (the
layout Ascend's and FlashInfer's paged kernels read, as [blocks, block_size, ...] views). Per
sliding-window layer, where the backend keeps rings, [rings × ring_tokens, KV heads, head_dim]: one ring
per batch slot, a sequence's token at position p at p mod ring_tokens; where it does not, blocks like
the full-attention layers, masked to the window. The values' head size is the keys' but in DeepSeek's
multi-head latent attention (MLA: DeepSeek-V2, V3, R1), which tokenline keeps decompressed, as
transformers' attention layers hand it over: per head, keys of the non-rotated and the rotated parts
(128 + 64 dimensions in V3) and values of their own size (128).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.models.quant import float_dtype

logger = logging.getLogger(__name__)

# With npuMemSize -1, the pool takes this share of the device memory free after loading the weights.
FREE_MEMORY_SHARE = 0.9
# On a CPU, -1 sizes the pool for this many full-length sequences per batch slot (the rest of the
# host's memory is the API's, Redis's and the page cache's) ...
CPU_CONTEXTS_PER_SLOT = 2
# ... and at most this share of the memory the host has available at start-up (the pool is written
# whole at once: a larger one is the kernel's OOM killer, for this process or another).
CPU_AVAILABLE_SHARE = 0.5


class PoolSizeError(ValueError):
    """The pool's size (npuMemSize) cannot serve: more memory than there is, or too little for the
    sliding-window rings. Said at start-up."""


def host_available_bytes(root: Path = Path("/")) -> int | None:
    """The memory this process may still take on its host: Linux's MemAvailable, bounded by what its
    cgroup (a container's memory limit, v2 or v1) leaves; None where neither can be read."""
    limits = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    cgroups = (
        ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),
        ("sys/fs/cgroup/memory/memory.limit_in_bytes", "sys/fs/cgroup/memory/memory.usage_in_bytes"),
    )
    for limit_file, usage_file in cgroups:
        try:
            limit, usage = (root / limit_file).read_text().strip(), (root / usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 2**60:  # v1 says "no limit" with ~2**63
            limits.append(max(0, int(limit) - int(usage)))
        break
    return min(limits) if limits else None


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, value_dim: int, dtype: torch.dtype) -> int:
    return layers * kv_heads * (head_dim + value_dim) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the pool: the model's attention layers (each one's sliding window, 0 for
    full attention), KV heads, the keys' head size, dtype; the longest context the pool serves; and the
    values' head size (0: the keys')."""

    windows: tuple[int, ...]
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    context: int = 0
    value_dim: int = 0

    def __post_init__(self) -> None:
        if not self.value_dim:
            object.__setattr__(self, "value_dim", self.head_dim)

    @classmethod
    def of(cls, model: torch.nn.Module, shards: int = 1, context: int = 0) -> KVShape:
        """The model's shape, or one rank's part of it when `shards` ranks split the KV heads. A window
        that a `context`-token sequence cannot outgrow is full attention (Phi-3.5 and Phi-4-mini ship
        `sliding_window: 262144`)."""
        config = model.config.get_text_config()
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        value_dim = head_dim
        if getattr(config, "qk_nope_head_dim", None) and getattr(config, "v_head_dim", None):
            # DeepSeek's latent attention, decompressed: its config's head_dim is the rotated part's alone.
            head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
            value_dim = int(config.v_head_dim)
        layers = int(config.num_hidden_layers)
        window = int(getattr(config, "sliding_window", None) or 0)
        if context and window >= context:
            window = 0
        types = getattr(config, "layer_types", None)
        if types is not None:  # alternating layers (Gemma 2/3, Qwen2's max_window_layers, ...)
            windows = tuple(window if kind == "sliding_attention" else 0 for kind in types[:layers])
        else:  # a sliding window on every layer (Mistral, Mixtral, Phi-3) or none
            windows = (window,) * layers
        return cls(windows, kv_heads // shards, head_dim, float_dtype(model), context, value_dim)

    @property
    def full_layers(self) -> int:
        return sum(1 for w in self.windows if w == 0)

    @property
    def bytes_per_token(self) -> int:
        """Of all layers: what a token costs where every layer keeps it."""
        return bytes_per_token(len(self.windows), self.kv_heads, self.head_dim, self.value_dim, self.dtype)

    @property
    def full_bytes_per_token(self) -> int:
        return bytes_per_token(self.full_layers, self.kv_heads, self.head_dim, self.value_dim, self.dtype)

    @property
    def sliding_bytes_per_token(self) -> int:
        return self.bytes_per_token - self.full_bytes_per_token


@dataclass(frozen=True)
class KVLayout:
    """The pool as sized at start-up: `num_blocks` blocks of `block_size` slots, and for the
    sliding-window layers (where `rings`) one ring of `ring_tokens` slots per batch slot (the window and
    one step's tokens fit)."""

    shape: KVShape
    block_size: int
    num_blocks: int
    rings: int
    ring_tokens: int

    @property
    def window(self) -> int:
        return max(self.shape.windows)

    @property
    def blocked_bytes_per_token(self) -> int:
        """What a token costs in the blocks: the full-attention layers', and the sliding ones' without rings."""
        return self.shape.full_bytes_per_token if self.rings else self.shape.bytes_per_token

    @property
    def bytes(self) -> int:
        ring_bytes = self.rings * self.ring_tokens * self.shape.sliding_bytes_per_token
        return self.num_blocks * self.block_size * self.blocked_bytes_per_token + ring_bytes

    @classmethod
    def plan(
        cls,
        shape: KVShape,
        device: torch.device,
        mem_gib: float,
        block_size: int,
        max_batch_size: int,
        max_model_len: int,
        max_step_tokens: int,
        rings: bool = True,
    ) -> KVLayout:
        """`mem_gib` GiB (npuMemSize; on a CPU, no more than the host has available), or with -1 a share
        of the device's free memory (on a CPU: enough for CPU_CONTEXTS_PER_SLOT full contexts per batch
        slot, within CPU_AVAILABLE_SHARE of the host's available memory); the rings first, the blocks
        from the rest. Without `rings` the sliding-window layers keep blocks like the others."""
        window = max(shape.windows) if rings else 0
        ring_count = max_batch_size if window else 0
        ring_tokens = window - 1 + max_step_tokens if window else 0
        ring_bytes = ring_count * ring_tokens * shape.sliding_bytes_per_token
        per_token = shape.full_bytes_per_token if window else shape.bytes_per_token
        if mem_gib > 0:
            budget = int(mem_gib * 2**30)
            available = host_available_bytes() if device.type == "cpu" else None
            if available is not None and budget > available:
                raise PoolSizeError(
                    f"npuMemSize {mem_gib:g} GiB is more than the {available / 2**30:.3f} GiB of memory "
                    "this host has available"
                )
        elif device.type == "cpu":
            budget = cls._cpu_budget(max_batch_size * (max_model_len + block_size) * per_token, ring_bytes)
        else:
            backend = getattr(torch, device.type)
            free, _total = backend.mem_get_info(device)
            budget = int(free * FREE_MEMORY_SHARE)
        if budget < ring_bytes:
            raise PoolSizeError(
                f"npuMemSize holds {budget / 2**30:.3f} GiB, less than the {ring_bytes / 2**30:.3f} GiB "
                f"the sliding-window layers need ({ring_count} batch slots × {ring_tokens} tokens)"
            )
        if per_token:
            blocks = max(1, (budget - ring_bytes) // (block_size * per_token))
        else:  # the rings are all the memory: the blocks only count tokens
            blocks = max_batch_size * -(-max_model_len // block_size)
        return cls(shape, block_size, blocks, ring_count, ring_tokens)

    @staticmethod
    def _cpu_budget(contexts: int, ring_bytes: int) -> int:
        """npuMemSize -1 on a CPU: CPU_CONTEXTS_PER_SLOT full contexts per batch slot (`contexts`: the
        bytes of one per slot) and the rings, within CPU_AVAILABLE_SHARE of the host's available memory
        (logged when capped)."""
        wanted = CPU_CONTEXTS_PER_SLOT * contexts + ring_bytes
        available = host_available_bytes()
        if available is None or wanted <= available * CPU_AVAILABLE_SHARE:
            return wanted
        budget = int(available * CPU_AVAILABLE_SHARE)
        logger.warning(
            "npuMemSize -1: %d full contexts per batch slot would take %.3f GiB; the KV pool takes %.3f GiB, "
            "%d%% of the %.3f GiB this host has available (set npuMemSize, or lower maxBatchSize or maxSeqLen)",
            CPU_CONTEXTS_PER_SLOT,
            wanted / 2**30,
            budget / 2**30,
            round(CPU_AVAILABLE_SHARE * 100),
            available / 2**30,
        )
        return budget


class PagedKV:
    """The pool's buffers, per layer (see the module's docstring), with one scratch block (and ring)
    beyond the layout's, which no sequence holds: the padded rows of a compiled step write there."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        shape = layout.shape
        self.num_blocks, self.block_size = layout.num_blocks, layout.block_size
        self.windows = shape.windows
        self.context = shape.context
        self.ring_tokens = layout.ring_tokens
        self.scratch_block, self.scratch_ring = layout.num_blocks, layout.rings
        blocked = ((layout.num_blocks + 1) * layout.block_size, shape.kv_heads)
        ring = ((layout.rings + 1) * layout.ring_tokens, shape.kv_heads)

        def buffer(window: int, dim: int) -> torch.Tensor:
            rows = ring if window and layout.rings else blocked
            return torch.zeros((*rows, dim), dtype=shape.dtype, device=device)

        self.keys = [buffer(w, shape.head_dim) for w in shape.windows]
        self.values = [buffer(w, shape.value_dim) for w in shape.windows]


class HostKV:
    """The host-memory tier under the pool (MindIE's cpuMemSize): per layer, keys and values of
    `num_blocks` blocks in host memory (pinned on an accelerator), and the copies between it and the
    pool. A step's copies are made together before its pass (engine/kv_cache.py plans them): all the
    copies out first (a block leaving the pool may be the target of a copy in, or of the pass), one
    gather and one scatter per layer and direction. On an accelerator they run on a stream of their
    own: it waits for the passes before it, whose writes the copies out read, and the next pass waits
    for it; the host waits for the copies out only (it scatters what they bring into the tier)."""

    def __init__(self, pool: PagedKV, num_blocks: int, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.device = device
        pinned = device.type != "cpu"
        self.pool_keys = [k.view(-1, pool.block_size, *k.shape[1:]) for k in pool.keys]
        self.pool_values = [v.view(-1, pool.block_size, *v.shape[1:]) for v in pool.values]
        # Allocated, not written: on a CPU the pages are taken as blocks first arrive (pinned memory on an
        # accelerator is taken at once).
        self.keys = [torch.empty((num_blocks, *k.shape[1:]), dtype=k.dtype, pin_memory=pinned) for k in self.pool_keys]
        self.values = [
            torch.empty((num_blocks, *v.shape[1:]), dtype=v.dtype, pin_memory=pinned) for v in self.pool_values
        ]
        self.stream = torch.Stream(device=device) if pinned else None

    @staticmethod
    def blocks_for(layout: KVLayout, gib: float) -> int:
        """How many of the pool's blocks `gib` GiB of host memory holds."""
        return int(gib * 2**30) // (layout.block_size * layout.blocked_bytes_per_token)

    def copy(self, out: list[tuple[int, int]], into: list[tuple[int, int]]) -> None:
        """Copy pool blocks to host blocks (`out`: (pool block, host block) pairs), then host blocks to
        pool blocks (`into`: (host block, pool block))."""
        if not out and not into:
            return
        if self.stream is None:
            self._copy(out, into)
            return
        compute = torch.accelerator.current_stream(self.device)
        self.stream.wait_stream(compute)
        with self.stream:
            self._copy(out, into)
        compute.wait_stream(self.stream)

    def _copy(self, out: list[tuple[int, int]], into: list[tuple[int, int]]) -> None:
        pairs = ((self.pool_keys, self.keys), (self.pool_values, self.values))
        if out:
            sources = torch.tensor([b for b, _ in out], device=self.device)
            targets = torch.tensor([h for _, h in out])
            gathered = [
                [layer.index_select(0, sources).to("cpu", non_blocking=self.stream is not None) for layer in pool]
                for pool, _ in pairs
            ]
            if self.stream is not None:  # the host's scatter below reads what the device sent
                self.stream.synchronize()
            for (_, host), blocks in zip(pairs, gathered, strict=True):
                for buffer, layer_blocks in zip(host, blocks, strict=True):
                    buffer.index_copy_(0, targets, layer_blocks)
        if into:
            sources = torch.tensor([h for h, _ in into])
            targets = torch.tensor([b for _, b in into], device=self.device)
            for pool, host in pairs:
                for layer, buffer in zip(pool, host, strict=True):
                    staged = buffer.index_select(0, sources)
                    if self.stream is not None:
                        staged = staged.pin_memory().to(self.device, non_blocking=True)
                    layer.index_copy_(0, targets, staged)
