"""BlockPool: the KV cache's fixed-size blocks, handed out from a free list with reference counts."""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Another sequence uses these blocks too (e.g. n samples of one prompt)."""
        for block in blocks:
            if self.ref_counts[block] < 1:
                raise ValueError(f"block {block} is not allocated")
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block with none left returns to the free list."""
        drops: dict[int, int] = {}
        for block in blocks:  # check everything first: an invalid list frees nothing
            drops[block] = drops.get(block, 0) + 1
            if not 0 <= block < self.num_blocks or self.ref_counts[block] < drops[block]:
                raise ValueError(f"block {block} freed more times than allocated")
        for block in reversed(blocks):  # reversed: a sequence's tail blocks are reused first
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.appendleft(block)
