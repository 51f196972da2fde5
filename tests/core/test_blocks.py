"""BlockPool: free list, reference counts, sharing and exhaustion."""

from __future__ import annotations

import random

import pytest

from kvforge.core.kv.blocks import BlockPool, NoFreeBlocksError


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_fresh_pool_is_all_free():
    pool = BlockPool(8)
    assert pool.num_blocks == 8
    assert pool.num_free == 8
    assert pool.num_used == 0
    assert pool.ref_counts == [0] * 8


def test_allocate_hands_out_distinct_blocks_with_one_reference():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert len(a) == 3 and len(b) == 2
    assert len(set(a) | set(b)) == 5
    assert all(0 <= blk < 8 for blk in a + b)
    assert all(pool.ref_counts[blk] == 1 for blk in a + b)
    assert pool.num_used == 5
    assert pool.num_free == 3
    assert pool.allocate(0) == []
    assert pool.num_used == 5


def test_free_returns_blocks():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert pool.num_used == 0
    assert pool.num_free == 4
    assert all(pool.ref_counts[blk] == 0 for blk in blocks)


def test_exhaustion_raises_and_allocates_nothing():
    pool = BlockPool(4)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)
    assert pool.num_free == 4  # a failed allocation takes nothing
    held = pool.allocate(4)
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.num_used == 4
    pool.free(held[:1])
    assert pool.allocate(1) == held[:1]


def test_no_free_blocks_error_is_a_runtime_error():
    assert issubclass(NoFreeBlocksError, RuntimeError)


def test_double_free_raises():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError, match="freed more times"):
        pool.free(blocks[:1])
    assert pool.num_free == 4  # the failed free did not push a duplicate onto the free list
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.free([2])
    assert pool.num_free == 4


def test_freed_blocks_are_reused_before_untouched_ones():
    pool = BlockPool(8)
    first = pool.allocate(3)
    pool.allocate(2)
    pool.free(first)
    again = pool.allocate(3)
    assert set(again) == set(first)
    assert pool.num_used == 5


def test_share_adds_references():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert [pool.ref_counts[b] for b in blocks] == [2, 2]
    assert pool.num_used == 2  # sharing takes no new blocks
    pool.free(blocks)
    assert pool.num_used == 2  # still held by the other owner
    assert [pool.ref_counts[b] for b in blocks] == [1, 1]
    pool.free(blocks)
    assert pool.num_used == 0
    with pytest.raises(ValueError):
        pool.free(blocks)


def test_share_of_unallocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.share([1])
    assert pool.ref_counts == [0, 0, 0, 0]


def test_random_operations_keep_invariants():
    """Against a reference model: no block is handed out twice while in use, counts always add up."""
    rng = random.Random(1234)
    pool = BlockPool(16)
    owners: list[list[int]] = []  # each entry: one owner's blocks
    for _ in range(2000):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(0, 5)
            in_use = {b for owner in owners for b in owner}
            if n > pool.num_free:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(n)
                continue
            got = pool.allocate(n)
            assert len(got) == n and len(set(got)) == n
            assert not set(got) & in_use, "a block still in use was handed out again"
            owners.append(got)
        elif op < 0.6 and owners:
            shared = list(rng.choice(owners))
            pool.share(shared)
            owners.append(shared)
        elif owners:
            pool.free(owners.pop(rng.randrange(len(owners))))
        expected = [0] * 16
        for owner in owners:
            for b in owner:
                expected[b] += 1
        assert pool.ref_counts == expected
        assert pool.num_used == sum(1 for c in expected if c > 0)
        assert pool.num_used + pool.num_free == 16
    for owner in owners:
        pool.free(owner)
    assert pool.num_used == 0


def test_cached_free_count_follows_every_move():
    """num_cached_free is kept as blocks move (the engine's stats read it after every step): it always equals a
    recount of the free queue, through registering, freeing, reviving cache hits, evicting and resetting."""
    pool, rng = BlockPool(12), random.Random(7)
    owners: list[list[int]] = []
    digests: dict[bytes, tuple[int, ...]] = {}
    most = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.3 and pool.num_free:
            owners.append(pool.allocate(rng.randint(1, min(3, pool.num_free))))
        elif op < 0.5 and owners:
            block = rng.choice(rng.choice(owners))
            tokens = (step,)
            if pool.register(block, bytes([step % 251]) * 16, tokens):
                digests[bytes([step % 251]) * 16] = tokens
        elif op < 0.7 and digests:
            digest, tokens = rng.choice(list(digests.items()))
            block = pool.lookup(digest, tokens)
            if block is not None:  # a hit, maybe on a free block: revived
                pool.share([block])
                owners.append([block])
        elif op < 0.97 and owners:
            pool.free(owners.pop(rng.randrange(len(owners))))
        else:
            pool.reset_cache()
        assert pool.num_cached_free == sum(1 for b in pool._free if pool.hashes[b] is not None)
        most = max(most, pool.num_cached_free)
    assert most >= 3  # the walk did keep cached blocks in the free queue
