"""KVCacheManager: a sequence's view of the block pool — prefix-cache lookups (in memory, then the
persisted tier), slot allocation, registering computed blocks, forking samples, rolling back
speculative positions."""

from __future__ import annotations

import time

from kvforge.core.kv.blocks import BlockPool, block_hash
from kvforge.core.kv.persist import PersistedKV
from kvforge.core.request import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, root_hash: bytes,
                 persisted: PersistedKV | None = None) -> None:
        self.pool, self.block_size, self.root_hash = pool, block_size, root_hash
        self.persisted = persisted if pool.enable_caching else None

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of the sequence's first `num_blocks` full blocks (extended lazily)."""
        hashes, size = seq.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            tokens = seq.cache_keys
            for i in range(len(hashes), num_blocks):
                hashes.append(block_hash(hashes[-1] if hashes else self.root_hash, tokens[i * size:(i + 1) * size]))
        return hashes[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of the sequence. At least one token is always
        left to compute, since its logits are needed."""
        if not self.pool.enable_caching:
            return []
        size, tokens = self.block_size, seq.cache_keys
        hits = []
        for i, digest in enumerate(self._hashes(seq, (len(tokens) - 1) // size)):
            block = self.pool.lookup(digest, tokens[i * size:(i + 1) * size])
            if block is None:
                break
            hits.append(block)
        return hits

    def match_persisted(self, seq: Sequence, num_hits: int) -> int:
        """How many blocks after the first `num_hits` the persisted tier holds (same one-token rule)."""
        if self.persisted is None:
            return 0
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        found = 0
        for digest in hashes[num_hits:]:
            if not self.persisted.contains(digest):
                break
            found += 1
        return found

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the next `num_new_tokens` (draft tokens included); False if the pool cannot, in
        which case nothing changes."""
        needed = self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)
        if needed > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        return True

    def admit(self, seq: Sequence, hits: list[int], budget: int, on_disk: int = 0) -> int:
        """Take the in-memory hits, load the next `on_disk` blocks from the persisted tier, and make
        room for a first chunk of at most `budget` tokens — all or nothing. Returns the chunk's
        length, or 0 (nothing changed) if the pool has no room. A block that fails to load is
        computed instead, with every block after it (the room for that was reserved)."""
        size = self.block_size
        self.pool.share(hits)
        cached = (len(hits) + on_disk) * size
        end = seq.chunk_end(cached, min(seq.num_tokens, cached + budget))
        needed = -(-end // size) - len(hits)
        if needed > self.pool.num_free:
            self.pool.free(hits)
            return 0
        seq.block_table = list(hits) + self.pool.allocate(needed)
        loaded = 0
        if self.persisted is not None:
            tokens, hashes, now = seq.cache_keys, self._hashes(seq, len(hits) + on_disk), time.time()
            for i in range(len(hits)):
                self.persisted.touch(hashes[i], i, now)
            for i in range(len(hits), len(hits) + on_disk):
                block_tokens = tokens[i * size:(i + 1) * size]
                if not self.persisted.load(hashes[i], block_tokens, seq.block_table[i], i, now):
                    break
                self.pool.register(seq.block_table[i], hashes[i], block_tokens)
                loaded += 1
        seq.num_computed_tokens = computed = (len(hits) + loaded) * size
        return seq.chunk_end(computed, min(seq.num_tokens, computed + budget)) - computed

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every full block whose K/V is now computed, so later requests can reuse it. An embedding
        request's blocks are not: its input is neither kept nor persisted (and it never reads the cache). A scoring
        request's are, in memory only (a reranker's documents share the query's head; one-off documents are not
        written to disk)."""
        if not self.pool.enable_caching or (seq.pools and seq.needs_every_position):
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        size, tokens = self.block_size, seq.cache_keys
        hashes, first_new = self._hashes(seq, full), None
        for i, digest in enumerate(hashes):
            block_tokens = tokens[i * size:(i + 1) * size]
            if self.pool.register(seq.block_table[i], digest, block_tokens) and self.persisted is not None \
                    and not seq.pools:
                if first_new is None:
                    first_new, now = i, time.time()
                parent = hashes[i - 1] if i else self.root_hash
                self.persisted.save(digest, parent, block_tokens, seq.block_table[i], i, now)
        if first_new:  # the chain grew: its earlier blocks on disk were just used too (LRU, deepest oldest)
            for i in range(first_new):
                self.persisted.touch(hashes[i], i, now)

    def free(self, seq: Sequence) -> None:
        self.cache_computed_blocks(seq)  # e.g. blocks that accepted draft tokens filled in its last step
        self.pool.free(seq.block_table)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Let `child` share the parent's computed full blocks and get its own copy of the partial
        last block. Returns the (source, destination) blocks to copy, or None if no block is free."""
        full = parent.num_computed_tokens // self.block_size
        partial = parent.num_computed_tokens % self.block_size != 0
        if partial and self.pool.num_free < 1:
            return None
        self.pool.share(parent.block_table[:full])
        child.block_table = list(parent.block_table[:full])
        copies = []
        if partial:
            block = self.pool.allocate(1)[0]
            copies.append((parent.block_table[full], block))
            child.block_table.append(block)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes[:full])
        return copies

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll back to `num_tokens` computed tokens (rejected speculative positions): blocks past the
        new end are freed."""
        keep = -(-num_tokens // self.block_size)
        self.pool.free(seq.block_table[keep:])
        del seq.block_table[keep:]
        del seq.block_hashes[num_tokens // self.block_size:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
