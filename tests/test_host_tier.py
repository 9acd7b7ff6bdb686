"""The KV host tier (cpuMemSize): what the cache manager plans (workers/engine/kv_cache.py) and the copies
that carry it out (workers/models/kv_pool.py HostKV), on CPU tensors. End to end on real weights:
tests/test_real_weights.py; over HTTP: tests/test_e2e_host_tier.py."""

from __future__ import annotations

import torch

from schemas.blocks import block_keys
from workers.engine.kv_cache import BlockTable, KVCacheManager
from workers.models.kv_pool import HostKV, KVLayout, KVShape, PagedKV

BLOCK = 4


def cached(kv: KVCacheManager, tokens: list[int]) -> BlockTable:
    table = BlockTable(None)
    kv.admit(table, tokens)
    assert kv.allocate(table, len(tokens))
    kv.commit(table, len(tokens), len(tokens), lambda: tokens)
    kv.release(table)
    return table


def test_an_evicted_block_is_copied_to_the_host_tier_and_a_later_prefix_hit_copies_it_back() -> None:
    kv = KVCacheManager(3, BLOCK, host_blocks=4)
    first = list(range(9))  # two full blocks and one token
    cached(kv, first)
    assert kv.take_copies() == ([], [])
    cached(kv, list(range(100, 109)))  # three blocks: the first prompt's two keyed blocks are evicted
    out, into = kv.take_copies()
    assert len(out) == 2 and into == []
    assert set(kv.host.cached) == set(block_keys(first, BLOCK, None))
    assert kv.host_usage == 0.5  # two of the tier's four blocks hold a cached prefix
    table = BlockTable(None)
    assert kv.admit(table, first) == 8  # both blocks, from the host tier
    out, into = kv.take_copies()
    assert [h for h, _ in into] == [kv.host.cached[k] for k in block_keys(first, BLOCK, None)]
    assert [b for _, b in into] == table.blocks and kv.host_hits == 8
    # The two pool blocks they took were the second prompt's unkeyed tail (evicted first, not copied)
    # and one of its keyed blocks, now in the tier too.
    assert len(out) == 1 and len(kv.host.cached) == 3
    assert kv.keys()[-2:] == block_keys(first, BLOCK, None)  # keyed in the pool again at once
    assert kv.swapped_in == 2


def test_a_host_block_read_by_this_steps_copies_is_not_reused_before_they_are_made() -> None:
    kv = KVCacheManager(2, BLOCK, host_blocks=1)
    cached(kv, list(range(5)))
    cached(kv, list(range(50, 55)))  # evicts the first block to the tier's only block
    kv.take_copies()
    table = BlockTable(None)
    assert kv.admit(table, list(range(5))) == 4  # pins the tier's block for this step's copy in
    assert kv.host.take() is None
    kv.take_copies()
    assert kv.host.take() is not None


def test_a_swapped_out_sequence_comes_back_to_where_it_was() -> None:
    kv = KVCacheManager(4, BLOCK, prefix_caching=False, host_blocks=4)
    table = BlockTable(None)
    assert kv.allocate(table, 10)
    kv.commit(table, 10, 10, lambda: list(range(10)))
    blocks = list(table.blocks)
    assert kv.swap_out(table)
    assert table.blocks == [] and table.swapped is not None and kv.used == 0
    out, _ = kv.take_copies()
    assert [b for b, _ in out] == blocks
    assert kv.host_usage == 0.75  # its three blocks
    hosts = [h for _, h in out]
    assert kv.swap_in(table, 11)
    _, into = kv.take_copies()
    assert [h for h, _ in into] == hosts and [b for _, b in into] == table.blocks
    assert table.computed == 10 and table.swapped is None
    assert sorted(kv.host.free) == [0, 1, 2, 3] and kv.host_usage == 0


def test_without_room_in_the_tier_a_preempted_sequence_is_recomputed() -> None:
    kv = KVCacheManager(4, BLOCK, prefix_caching=False, host_blocks=2)
    table = BlockTable(None)
    assert kv.allocate(table, 12)  # three blocks, the tier holds two
    assert not kv.swap_out(table)
    assert len(table.blocks) == 3 and kv.host.free and kv.take_copies() == ([], [])


def test_a_swapped_sequence_that_ends_while_waiting_frees_its_host_blocks() -> None:
    kv = KVCacheManager(4, BLOCK, prefix_caching=False, host_blocks=2)
    table = BlockTable(None)
    assert kv.allocate(table, 8)
    assert kv.swap_out(table)
    kv.take_copies()
    assert kv.host.free == []
    kv.forget(table)
    kv.take_copies()
    assert sorted(kv.host.free) == [0, 1]


def test_the_copies_move_each_blocks_keys_and_values() -> None:
    """Keys of 3 dimensions and values of 5, as DeepSeek's latent attention has them of two sizes."""
    shape = KVShape((0, 0), kv_heads=2, head_dim=3, dtype=torch.float32, value_dim=5)
    layout = KVLayout(shape, BLOCK, 6, 0, 0)
    pool = PagedKV(layout, torch.device("cpu"))
    for layer, (keys, values) in enumerate(zip(pool.keys, pool.values, strict=True)):
        keys.copy_(torch.arange(keys.numel(), dtype=torch.float32).view_as(keys) + 1000 * layer)
        values.copy_(-torch.arange(values.numel(), dtype=torch.float32).view_as(values) - 1000 * layer)
    before = [k.clone() for k in pool.keys] + [v.clone() for v in pool.values]
    host = HostKV(pool, 3, torch.device("cpu"))
    host.copy([(1, 0), (4, 2)], [])
    for buffer in (*pool.keys, *pool.values):
        buffer.zero_()
    host.copy([], [(2, 0), (0, 5)])  # host block 2 (pool block 4) to pool 0, host 0 (pool 1) to pool 5
    for now, then in zip([*pool.keys, *pool.values], before, strict=True):
        blocks, old = now.view(-1, BLOCK, 2, now.shape[-1]), then.view(-1, BLOCK, 2, now.shape[-1])
        assert torch.equal(blocks[0], old[4]) and torch.equal(blocks[5], old[1])
        assert not blocks[1:5].any()
    assert [k.shape[-1] for k in host.keys] == [3, 3] and [v.shape[-1] for v in host.values] == [5, 5]
    assert HostKV.blocks_for(layout, 1.0) == 2**30 // (BLOCK * 2 * 2 * (3 + 5) * 4)


def test_a_prefix_whose_later_block_outlived_an_earlier_one_is_keyed_once() -> None:
    """The pool holds a prefix's third and fourth blocks but not its first two, which the host tier
    holds: a sequence admitted on that prefix copies the first two in and shares the pool's others.
    Keyed again at fresh blocks, one key named two blocks, and evicting the second raised KeyError
    in the middle of a step (the worker then served nothing)."""
    kv = KVCacheManager(num_blocks=8, block_size=2, prefix_caching=True, host_blocks=8)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    first, first_tokens = BlockTable(None), [*prompt, 100]
    kv.admit(first, first_tokens)
    kv.allocate(first, 9)
    kv.commit(first, 9, 9, lambda: first_tokens)
    kv.take_copies()
    assert kv.swap_out(first)  # preempted: its blocks stay keyed in the pool, its copy on the host
    kv.take_copies()
    sharer = BlockTable(None)
    assert kv.admit(sharer, [*prompt[:4], 200]) == 4
    kv.allocate(sharer, 5)
    kv.take_copies()
    filler = BlockTable(None)
    kv.allocate(filler, 10)  # evicts the prefix's third and fourth blocks to the host tier
    kv.take_copies()
    kv.release(filler)
    assert kv.swap_in(first, 9)  # fresh blocks
    kv.take_copies()
    first_tokens.append(101)
    kv.commit(first, 10, 10, lambda: first_tokens)  # keys the third and fourth blocks there again
    kv.release(sharer)
    other = BlockTable(None)
    kv.allocate(other, 6)  # evicts the first two blocks to the host tier
    kv.take_copies()
    kv.release(other)
    later = BlockTable(None)
    assert kv.admit(later, [*prompt, 300]) == 8
    assert all(kv.cached[key] == block for block, key in kv.key_of.items())
    assert len(set(kv.key_of.values())) == len(kv.key_of)
    kv.release(later)
    kv.release(first)
    whole = BlockTable(None)
    assert kv.allocate(whole, 16)  # every block, each keyed one evicted once
    assert len(whole.blocks) == 8 and not kv.free_blocks
