"""The KV cache manager: which blocks of the device's KV pool each sequence holds, and which blocks
hold a known prefix.

The pool (models/kv_pool.py) is `num_blocks` blocks of `block_size` token slots, sized once at start-up.
A sequence holds a block table: block i holds its tokens [i × block_size, (i + 1) × block_size). It
gains blocks as it grows (`allocate`) and gives them back when it finishes or is preempted (`release`).

Prefix caching: a full block is keyed by a hash of its tokens and of every token before it (and of the
request's cache salt, so that only requests with the same salt share blocks); its key is registered
once its slots are written (`commit`). A new sequence starts from the longest run of registered blocks
that its own tokens key to (`admit`), shared and reference-counted, and computes only the rest. A block
no sequence holds stays registered in the free list, least recently used first, until the pool needs
it (LRU eviction).

What the cache holds is told as events (vLLM's BlockStored / BlockRemoved): each key registered or
evicted is appended to `events`, which another thread drains (`changes`) to publish where the API
routes by it (workers/serving/beacon.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from schemas.blocks import block_keys


@dataclass(eq=False)
class BlockTable:
    """A sequence's blocks, how many of its tokens are in them (`computed`), and the keys of its full
    blocks as far as they are known."""

    salt: str | None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    hashes: list[bytes] = field(default_factory=list)
    registered: int = 0  # its first `registered` blocks are keyed in the pool
    ring: int | None = None  # its ring in the sliding-window layers' slots, if the model has such layers


class KVCacheManager:
    """Blocks for the full-attention layers; with `rings`, also one ring of the sliding-window layers'
    slots per running sequence. Those layers keep only their window, so a cached prefix would lack
    them: prefix caching is off for such models."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, rings: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching and not rings
        self.free_rings = list(range(rings)) if rings else None
        self.refs = [0] * num_blocks
        # Blocks no sequence holds, least recently used first; a keyed one is reused only when evicted.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found
        # (key, held): registered (True) or evicted (False), in order; appended by the engine thread only.
        self.events: deque[tuple[bytes, bool]] = deque()

    @property
    def used(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def admit(self, table: BlockTable, tokens: Sequence[int], reuse: bool = True) -> int:
        """Start a sequence on the longest cached prefix of `tokens` (leaving at least the last token to
        compute, whose logits it samples from); the number of tokens it need not compute. Without
        `reuse` (a request that scores every prompt token) it computes them all, and still offers its
        blocks to others."""
        assert not table.blocks
        if not self.prefix_caching:
            return 0
        self._key(table, tokens)
        usable = (len(tokens) - 1) // self.block_size if reuse else 0
        hit: list[int] = []
        for key in table.hashes[:usable]:
            block = self.cached.get(key)
            if block is None:
                break
            hit.append(block)
        for block in hit:
            if self.refs[block] == 0:
                del self.free_blocks[block]
            self.refs[block] += 1
        table.blocks = hit
        table.registered = len(hit)
        table.computed = len(hit) * self.block_size
        return table.computed

    def count(self, tokens: int, hit: int) -> None:
        """An admitted sequence's prompt: `tokens` looked up in the prefix cache, `hit` found."""
        self.queries += tokens
        self.hits += hit

    def allocate(self, table: BlockTable, tokens: int) -> bool:
        """Give the table blocks for `tokens` tokens in all; False (and nothing taken) if the pool is short."""
        needed = self.blocks_for(tokens) - len(table.blocks)
        if needed > len(self.free_blocks):
            return False
        if self.free_rings is not None and table.ring is None:
            if not self.free_rings:
                return False
            table.ring = self.free_rings.pop()
        for _ in range(needed):
            block, _ = self.free_blocks.popitem(last=False)
            key = self.key_of.pop(block, None)
            if key is not None:
                del self.cached[key]
                self.events.append((key, False))
            self.refs[block] = 1
            table.blocks.append(block)
        return True

    def commit(self, table: BlockTable, computed: int, known: int, tokens: Callable[[], Sequence[int]]) -> None:
        """The table's first `computed` tokens are written; of its tokens, the first `known` are on the
        host (`tokens()` lists them; called only when a block became full): key its full blocks."""
        table.computed = computed
        full = min(computed, known) // self.block_size
        if not self.prefix_caching or full <= table.registered:
            return
        self._key(table, tokens()[: full * self.block_size])
        for index in range(table.registered, full):
            key, block = table.hashes[index], table.blocks[index]
            if key not in self.cached and block not in self.key_of:
                self.cached[key] = block
                self.key_of[block] = key
                self.events.append((key, True))
        table.registered = full

    def release(self, table: BlockTable) -> None:
        """Give back the table's blocks; its last blocks go to the eviction end first (a prefix outlives
        its tails)."""
        for block in reversed(table.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_blocks[block] = None
        table.blocks = []
        table.computed = table.registered = 0
        if table.ring is not None:
            self.free_rings.append(table.ring)  # type: ignore[union-attr]
            table.ring = None

    def keys(self) -> list[bytes]:
        """From any thread: the keys registered now (a copy made in one step under the GIL)."""
        return list(self.cached)

    def changes(self) -> tuple[set[bytes], set[bytes]]:
        """From any thread: the keys registered and the keys evicted since the last call, each key in
        the set its last event puts it in."""
        stored: set[bytes] = set()
        removed: set[bytes] = set()
        while True:
            try:
                key, held = self.events.popleft()
            except IndexError:
                return stored, removed
            (stored if held else removed).add(key)
            (removed if held else stored).discard(key)

    def _key(self, table: BlockTable, tokens: Sequence[int]) -> None:
        """Extend the table's block keys over the full blocks of `tokens`."""
        if len(tokens) // self.block_size > len(table.hashes):
            table.hashes = block_keys(tokens, self.block_size, table.salt, table.hashes)
