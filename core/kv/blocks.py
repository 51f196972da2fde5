"""BlockPool: the KV cache's fixed-size blocks, with reference counts and a prefix cache.

A full block that has been computed is registered under its hash, H(parent hash, token ids), whose
root is the model fingerprint, so equal prefixes of any two requests map to the same blocks. Blocks
no sequence uses go to a free queue in least-recently-freed order; a cached block stays findable
there until it is handed out again (evicted) because space is needed. A hit verifies the stored
token ids, so a hash collision can never return another prefix's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Deterministic across processes and machines (the persisted tier relies on that)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()[:16]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Unused blocks, oldest first: allocation takes from the front, so cached blocks freed long
        # ago are evicted first (LRU). OrderedDict: O(1) removal when a cache hit revives a block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_cached_free = 0  # blocks in _free that hold a hash: kept as they move (stats read it every step)

    @property
    def num_free(self) -> int:
        """Blocks no sequence uses (some may still hold cached prefixes)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Unused blocks that still hold a reusable cached prefix."""
        return self._num_cached_free

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        """Forget the prefix a block taken from the free queue (or still in it) holds."""
        digest = self.hashes[block]
        if digest is not None:
            if self.cached.get(digest) == block:
                del self.cached[digest]
            self.hashes[block] = self.block_tokens[block] = None
            self._num_cached_free -= 1

    def share(self, blocks: list[int]) -> None:
        """Another sequence uses these blocks too (n samples of one prompt, prefix-cache hits)."""
        for block in blocks:
            if self.ref_counts[block] == 0:  # only a cached prefix may be revived from the free queue
                if self.hashes[block] is None:
                    raise ValueError(f"block {block} is not allocated")
                del self._free[block]
                self._num_cached_free -= 1
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block with none left joins the free queue."""
        drops: dict[int, int] = {}
        for block in blocks:  # check everything first: an invalid list frees nothing
            drops[block] = drops.get(block, 0) + 1
            if not 0 <= block < self.num_blocks or self.ref_counts[block] < drops[block]:
                raise ValueError(f"block {block} freed more times than allocated")
        for block in reversed(blocks):  # a sequence's tail blocks are evicted before its head
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hashes[block] is None:
                    self._free[block] = None
                    self._free.move_to_end(block, last=False)  # uncached: reuse it first
                else:
                    self._free[block] = None
                    self._num_cached_free += 1

    def holds(self, block: int, digest: bytes) -> bool:
        """Whether `block` still holds the computed block of this hash (not evicted since it was registered)."""
        return self.hashes[block] == digest

    def lookup(self, digest: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens under this hash, or None."""
        if not self.enable_caching:
            return None
        block = self.cached.get(digest)
        if block is None or self.block_tokens[block] != tuple(token_ids):
            return None
        return block

    def register(self, block: int, digest: bytes, token_ids: Sequence[int]) -> bool:
        """Mark a full, computed block as reusable under its hash (first writer wins). True if this
        call registered it."""
        if not self.enable_caching or self.hashes[block] is not None:
            return False
        if digest in self.cached:
            return False  # the same prefix is cached in another block already
        self.hashes[block], self.block_tokens[block] = digest, tuple(token_ids)
        self.cached[digest] = block
        if self.ref_counts[block] == 0:  # an unused block (none of the engine's callers does this)
            self._num_cached_free += 1
        return True

    def reset_cache(self) -> int:
        """Forget every cached prefix in unused blocks; returns how many were dropped."""
        dropped = [block for block in self._free if self.hashes[block] is not None]
        for block in dropped:
            self._evict(block)
        return len(dropped)
