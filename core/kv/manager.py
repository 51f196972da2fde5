"""KVCacheManager: a sequence's view of the block pool — prefix-cache lookups, slot allocation,
registering computed blocks, forking samples, rolling back speculative positions."""

from __future__ import annotations

from kvforge.core.kv.blocks import BlockPool, block_hash
from kvforge.core.request import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, root_hash: bytes) -> None:
        self.pool, self.block_size, self.root_hash = pool, block_size, root_hash

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of the sequence's first `num_blocks` full blocks (extended lazily)."""
        hashes, size = seq.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            tokens = seq.token_ids
            for i in range(len(hashes), num_blocks):
                hashes.append(block_hash(hashes[-1] if hashes else self.root_hash, tokens[i * size:(i + 1) * size]))
        return hashes[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of the sequence. At least one token is always
        left to compute, since its logits are needed."""
        if not self.pool.enable_caching:
            return []
        size, tokens = self.block_size, seq.token_ids
        hits = []
        for i, digest in enumerate(self._hashes(seq, (len(tokens) - 1) // size)):
            block = self.pool.lookup(digest, tokens[i * size:(i + 1) * size])
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int, lookahead: int = 0) -> bool:
        """Make room for the next `num_new_tokens` (+ `lookahead` speculative) tokens; False if the
        pool cannot, in which case nothing changes."""
        needed = self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens + lookahead)
        if needed > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        return True

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Take the prefix-cache hits and room for the first chunk, all or nothing."""
        self.pool.share(hits)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.allocate(seq, num_new_tokens):
            return True
        self.pool.free(hits)
        seq.block_table, seq.num_computed_tokens = [], 0
        return False

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every full block whose K/V is now computed, so later requests can reuse it."""
        if not self.pool.enable_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        size, tokens = self.block_size, seq.token_ids
        for i, digest in enumerate(self._hashes(seq, full)):
            self.pool.register(seq.block_table[i], digest, tokens[i * size:(i + 1) * size])

    def free(self, seq: Sequence) -> None:
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
