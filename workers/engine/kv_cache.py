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

What the cache holds is told as events (vLLM's BlockStored / BlockRemoved): once `publish` is
called, each key registered or evicted is appended to `events`, which another thread drains
(`changes`) to publish where the API routes by it (workers/serving/routing.py).

The host tier (`host_blocks`, MindIE's cpuMemSize; models/kv_pool.py HostKV holds the memory) sits
under the pool, with two uses:
- A keyed block evicted from the pool is copied to the host tier first (kept there least recently used
  first), and a sequence whose prefix continues there gets pool blocks that the tier's copies fill
  (`admit`): a later hit costs a copy instead of the prefix's computation.
- A preempted sequence's blocks, its last partial one included, are copied to the host tier
  (`swap_out`) and back when it resumes (`swap_in`), instead of being computed again; only when the
  tier cannot take them is the sequence recomputed.
The copies are only planned here; the engine makes a step's copies together before its pass
(`take_copies`). A host block that this step's copies read is pinned until they are made.
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
    swapped: list[int] | None = None  # preempted: the host blocks that hold its blocks, in order
    swapped_computed: int = 0  # and how many of its tokens they hold
    lost: int = 0  # preempted without a swap: the computed tokens it gave up


class HostTier:
    """The host blocks: free ones, and keyed ones (a copy of an evicted pool block) least recently used
    first; the keyed ones are given up when a block is needed."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        self.cached: OrderedDict[bytes, int] = OrderedDict()
        self.pinned: set[int] = set()  # read by this step's copies in

    def take(self) -> int | None:
        """A free host block, evicting the least recently used keyed one if need be (never one that
        this step's copies read); None if there is none."""
        if self.free:
            return self.free.pop()
        for key, block in self.cached.items():
            if block not in self.pinned:
                del self.cached[key]
                return block
        return None


class KVCacheManager:
    """Blocks for the full-attention layers; with `rings`, also one ring of the sliding-window layers'
    slots per running sequence. Those layers keep only their window, so a cached prefix would lack
    them: prefix caching is off for such models."""

    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = True, rings: int = 0, host_blocks: int = 0
    ) -> None:
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
        # (key, held): registered (True) or evicted (False), in order, once `publish` is called;
        # appended by the engine thread only.
        self.events: deque[tuple[bytes, bool]] | None = None
        # The host tier (not for models with rings: a sequence's ring is not in its blocks).
        self.host = HostTier(host_blocks) if host_blocks and not rings else None
        self.copies_out: list[tuple[int, int]] = []  # (pool block, host block), this step
        self.copies_in: list[tuple[int, int]] = []  # (host block, pool block), this step
        self._host_release: list[int] = []  # host blocks free once this step's copies are made
        self.swapped_out = 0  # blocks copied to the host tier, in all
        self.swapped_in = 0  # blocks copied back
        self.host_hits = 0  # prompt tokens found in the host tier

    @property
    def used(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - len(self.free_blocks)

    @property
    def host_usage(self) -> float:
        """The share of the host tier's blocks holding a preempted sequence's blocks or a cached
        prefix's (0 without a host tier)."""
        if self.host is None or not self.host.num_blocks:
            return 0.0
        return 1 - len(self.host.free) / self.host.num_blocks

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
            self._share(block)
        table.blocks = hit
        if self.host is not None:
            self._admit_from_host(table, table.hashes[len(hit) : usable])
        table.registered = len(table.blocks)
        table.computed = len(table.blocks) * self.block_size
        return table.computed

    def _admit_from_host(self, table: BlockTable, keys: list[bytes]) -> None:
        """Extend the table's cached prefix over the keys the host tier holds: pool blocks for them,
        filled by this step's copies in, and keyed at once. A key the pool holds too (past the first
        one it lacks: a prefix's later block can outlive an earlier one) is shared from the pool, as
        `admit` shares it: keyed twice, one of its blocks would be evicted under a key that names the
        other."""
        host = self.host
        assert host is not None
        for key in keys:
            block = self.cached.get(key)
            if block is not None:
                self._share(block)
                table.blocks.append(block)
                continue
            source = host.cached.get(key)
            if source is None or not self.free_blocks:
                return
            host.cached.move_to_end(key)
            host.pinned.add(source)
            block = self._pop_free()
            self.refs[block] = 1
            table.blocks.append(block)
            self.copies_in.append((source, block))
            self.host_hits += self.block_size
            self._register(key, block)

    def _share(self, block: int) -> None:
        """One more sequence holds a cached block (taken off the free list if none did)."""
        if self.refs[block] == 0:
            del self.free_blocks[block]
        self.refs[block] += 1

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
            block = self._pop_free()
            self.refs[block] = 1
            table.blocks.append(block)
        return True

    def _pop_free(self) -> int:
        """The least recently used free block; a keyed one is evicted (to the host tier, if there is one)."""
        block, _ = self.free_blocks.popitem(last=False)
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.cached[key]
            if self.events is not None:
                self.events.append((key, False))
            if self.host is not None and key not in self.host.cached:
                target = self.host.take()
                if target is not None:
                    self.copies_out.append((block, target))
                    self.host.cached[key] = target
        return block

    def _register(self, key: bytes, block: int) -> None:
        self.cached[key] = block
        self.key_of[block] = key
        if self.events is not None:
            self.events.append((key, True))

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
                self._register(key, block)
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

    def swap_out(self, table: BlockTable) -> bool:
        """Preempt the table's sequence to the host tier: its blocks are copied there and given back;
        False (nothing done) if the tier has no room for them."""
        if self.host is None or not table.blocks:
            return False
        targets: list[int] = []
        for _ in table.blocks:
            target = self.host.take()
            if target is None:
                self.host.free += targets
                return False
            targets.append(target)
        self.copies_out += zip(table.blocks, targets, strict=True)
        computed = table.computed
        self.release(table)
        table.swapped, table.swapped_computed = targets, computed
        return True

    def swap_in(self, table: BlockTable, tokens: int) -> bool:
        """Resume a swapped-out sequence with blocks for `tokens` tokens in all, its own filled by this
        step's copies in; False (nothing done) if the pool is short."""
        assert table.swapped is not None and not table.blocks
        if self.blocks_for(tokens) > len(self.free_blocks):
            return False
        sources = table.swapped
        self.allocate(table, tokens)
        self.copies_in += zip(sources, table.blocks, strict=False)
        assert self.host is not None
        self.host.pinned.update(sources)
        self._host_release += sources
        table.computed, table.swapped = table.swapped_computed, None
        return True

    def forget(self, table: BlockTable) -> None:
        """A sequence that will not run again (it ended while it waited): its swapped blocks are free."""
        if table.swapped is not None and self.host is not None:
            self._host_release += table.swapped
            table.swapped = None

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's copies (out, in), for the engine to make now; their host blocks are then free
        to reuse."""
        out, into = self.copies_out, self.copies_in
        self.copies_out, self.copies_in = [], []
        self.swapped_out += len(out)
        self.swapped_in += len(into)
        if self.host is not None:
            self.host.pinned.clear()
            self.host.free += self._host_release
            self._host_release = []
        return out, into

    def publish(self) -> None:
        """Start telling what the cache registers and evicts (`events`)."""
        if self.events is None:
            self.events = deque()

    def keys(self) -> list[bytes]:
        """From any thread: the keys registered now (a copy made in one step under the GIL)."""
        return list(self.cached)

    def changes(self) -> tuple[set[bytes], set[bytes]]:
        """From any thread: the keys registered and the keys evicted since the last call, each key in
        the set its last event puts it in."""
        stored: set[bytes] = set()
        removed: set[bytes] = set()
        while self.events is not None:
            try:
                key, held = self.events.popleft()
            except IndexError:
                return stored, removed
            (stored if held else removed).add(key)
            (removed if held else stored).discard(key)
        return stored, removed

    def _key(self, table: BlockTable, tokens: Sequence[int]) -> None:
        """Extend the table's block keys over the full blocks of `tokens`."""
        if len(tokens) // self.block_size > len(table.hashes):
            table.hashes = block_keys(tokens, self.block_size, table.salt, table.hashes)
