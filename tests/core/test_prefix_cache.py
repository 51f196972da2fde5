"""BlockPool prefix cache and KVCacheManager: hash chains, verified hits, LRU eviction only when
space is needed, admission with hits, forking, and rollback of speculative positions."""

from __future__ import annotations

import pytest

from kvforge.core.kv.blocks import BlockPool, block_hash
from kvforge.core.kv.manager import KVCacheManager
from kvforge.core.request import Sequence
from kvforge.core.sampling import SamplingParams

ROOT = b"fingerprint-A"


def seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=8))


def computed(manager: KVCacheManager, s: Sequence) -> Sequence:
    """Admit `s`, pretend its prompt was computed, and register its full blocks."""
    hits = manager.match_prefix(s)
    assert manager.admit(s, hits, s.num_tokens - len(hits) * manager.block_size)
    s.num_computed_tokens = s.num_tokens
    manager.cache_computed_blocks(s)
    return s


def test_hash_chain_is_deterministic_and_depends_on_root_and_parent():
    a = block_hash(ROOT, [1, 2, 3])
    assert a == block_hash(ROOT, [1, 2, 3]) and len(a) == 16
    assert a != block_hash(b"fingerprint-B", [1, 2, 3])  # another model never hits
    assert block_hash(a, [4, 5]) != block_hash(block_hash(ROOT, [9, 9, 9]), [4, 5])
    assert a != block_hash(ROOT, [1, 2, 4])


def test_hit_requires_matching_token_ids_even_under_the_same_hash():
    pool = BlockPool(4)
    block = pool.allocate(1)[0]
    pool.register(block, b"h" * 16, [1, 2])
    pool.free([block])
    assert pool.lookup(b"h" * 16, [1, 2]) == block
    assert pool.lookup(b"h" * 16, [1, 3]) is None  # a collision returns nothing, never the wrong KV


def test_shared_prefix_hits_and_last_token_is_always_computed():
    pool = BlockPool(16)
    manager = KVCacheManager(pool, 4, ROOT)
    first = computed(manager, seq(list(range(10))))
    table = list(first.block_table)
    manager.free(first)
    second = seq(list(range(10)) + [77, 78])
    hits = manager.match_prefix(second)
    assert hits == table[:2]  # two full blocks; the partial third is not cached
    exact = seq(list(range(8)))
    assert len(manager.match_prefix(exact)) == 1  # 8 tokens = 2 full blocks, but one token must run
    other_model = KVCacheManager(pool, 4, b"fingerprint-B")
    assert other_model.match_prefix(seq(list(range(10)) + [77, 78])) == []


def test_cached_blocks_are_evicted_lru_and_only_when_needed():
    pool = BlockPool(6)
    manager = KVCacheManager(pool, 2, ROOT)
    old = computed(manager, seq([1, 2, 3, 4, 5], "old"))  # 3 blocks, 2 of them full and cached
    manager.free(old)
    new = computed(manager, seq([6, 7, 8, 9, 10], "new"))
    manager.free(new)
    assert pool.num_cached_free == 4 and pool.num_used == 0
    pool.allocate(2)  # the two never-cached blocks go first: nothing is evicted
    assert pool.num_cached_free == 4
    pool.allocate(1)  # now the least recently freed cached block goes
    assert len(manager.match_prefix(seq([1, 2, 3, 4, 5]))) < 2
    assert len(manager.match_prefix(seq([6, 7, 8, 9, 10]))) == 2


def test_hit_revives_a_free_cached_block_and_protects_it_from_eviction():
    pool = BlockPool(4)
    manager = KVCacheManager(pool, 2, ROOT)
    first = computed(manager, seq([1, 2, 3]))
    manager.free(first)
    again = seq([1, 2, 3])
    hits = manager.match_prefix(again)
    assert manager.admit(again, hits, 1)
    assert pool.ref_counts[hits[0]] == 1 and again.num_computed_tokens == 2
    pool.allocate(pool.num_free)  # exhaust the pool: the block in use cannot be evicted
    assert pool.lookup(again.block_hashes[0], [1, 2]) == hits[0]


def test_admit_is_all_or_nothing():
    pool = BlockPool(3)
    manager = KVCacheManager(pool, 2, ROOT)
    first = computed(manager, seq([1, 2, 3]))
    manager.free(first)
    pool.allocate(2)  # leave exactly the cached block free
    big = seq([1, 2, 3, 4, 5, 6, 7])
    hits = manager.match_prefix(big)
    assert hits and not manager.admit(big, hits, 5)
    assert big.block_table == [] and big.num_computed_tokens == 0
    assert pool.ref_counts[hits[0]] == 0  # the hit was given back


def test_draft_slots_and_truncate_rolls_back():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, 4, ROOT)
    s = computed(manager, seq([1, 2, 3, 4, 5]))  # 2 blocks
    assert manager.allocate(s, 1 + 4)  # the last token + 4 drafts: 5 + 5 = 10 tokens -> 3 blocks
    assert len(s.block_table) == 3
    s.num_computed_tokens = 10
    manager.truncate(s, 6)  # 4 speculative positions rejected
    assert len(s.block_table) == 2 and s.num_computed_tokens == 6 and pool.num_used == 2
    manager.free(s)
    assert pool.num_used == 0


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, 4, ROOT)
    parent = computed(manager, seq([1, 2, 3, 4, 5, 6]))  # one full block, one partial
    child = seq([1, 2, 3, 4, 5, 6])
    copies = manager.fork(parent, child)
    assert child.block_table[0] == parent.block_table[0] and pool.ref_counts[parent.block_table[0]] == 2
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.num_computed_tokens == parent.num_computed_tokens
    manager.free(parent)
    manager.free(child)
    assert pool.num_used == 0


def test_sharing_an_uncached_free_block_is_refused():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool.share([0])
