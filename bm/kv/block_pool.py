"""The pool of KV cache blocks: ids, reference counts and the free list. Pure Python.

The pool knows nothing of requests or tensors. It hands out block ids and takes them back; the tensors
that hold the keys and values live in ``bm.runtime`` and are indexed by these ids. The free list is an
insertion-ordered dict so taking from the front and removing any given block are both O(1).
"""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """Raised when a caller allocates more blocks than are free; schedulers must check first."""


class IntegrityError(AssertionError):
    """The cache's bookkeeping contradicts itself: a bug, never a user error."""


def require(condition: bool, message: str) -> None:
    """An assertion that survives ``python -O``: integrity checks must run in every build."""
    if not condition:
        raise IntegrityError(message)


class BlockPool:
    """A fixed number of blocks, each free or referenced by one or more owners."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # dict keys keep insertion order: the front is the next block handed out.
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with a reference count of one."""
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        free = self._free
        taken = []
        for _ in range(num_blocks):
            block_id = next(iter(free))
            del free[block_id]
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def share(self, block_ids: list[int]) -> None:
        """Add one reference to each (used) block: another table now points at it too."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} is free; only a used block can be shared")
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block with no reference left is free again."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} released more often than it was referenced")
            count -= 1
            self._ref_counts[block_id] = count
            if count == 0:
                self._free[block_id] = None

    def check_integrity(self) -> None:
        """Free and used add up to the total, and a block is free exactly when nothing references it."""
        used = sum(1 for c in self._ref_counts if c > 0)
        require(all(c >= 0 for c in self._ref_counts), "negative reference count")
        require(
            used + len(self._free) == self.num_blocks,
            f"used {used} + free {len(self._free)} != total {self.num_blocks}",
        )
        for block_id in self._free:
            require(self._ref_counts[block_id] == 0, f"free block {block_id} is still referenced")
