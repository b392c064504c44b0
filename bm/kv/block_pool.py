"""The pool of KV cache blocks: ids, reference counts and the free list. Pure Python.

The pool knows nothing of requests or tensors. It hands out block ids and takes them back; the tensors
that hold the keys and values live in ``bm.runtime`` and are indexed by these ids. The free list and the
cached (reusable) list are insertion-ordered dicts, so taking from either end and removing any given block
are all O(1).

Empty blocks are handed out last released, first taken, and a fresh pool hands out its ids in ascending
order: the blocks in use at any moment stay among the lowest ids that the run's peak ever needed. The
runtime allocates the cache's memory untouched on a CPU (the OS maps a page at its first write), so the
memory a run touches is its peak concurrent KV use, however large the pool; a first-in-first-out free
list would instead walk every block of a pool sized to most of RAM over a long run, touching all of it.
"""

from __future__ import annotations

from collections import OrderedDict

from bm.kv.block_hash import BlockKey


class OutOfBlocksError(RuntimeError):
    """Raised when a caller allocates more blocks than are free; schedulers must check first."""


class IntegrityError(AssertionError):
    """The cache's bookkeeping contradicts itself: a bug, never a user error."""


def require(condition: bool, message: str) -> None:
    """An assertion that survives ``python -O``: integrity checks must run in every build."""
    if not condition:
        raise IntegrityError(message)


class BlockPool:
    """A fixed number of blocks, each free, in use (referenced by one or more owners), or cached.

    A cached block is unreferenced but still holds a registered full block's keys and values: it can be
    taken again by reference (:meth:`share`) on a prefix hit, or reclaimed as free space. Cached blocks
    sit in least-recently-released order, and :meth:`allocate` prefers empty blocks, then evicts from the
    front of that order; so callers release a sequence's blocks tail first to have tails evicted before
    the heads that more requests share.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # empty blocks: the back is the next one handed out (the latest released, else the lowest fresh
        # id); cached blocks (unreferenced, registered) are evicted from the front (least recent).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._keys: dict[int, BlockKey] = {}  # registered blocks (in use or cached)
        self._by_hash: dict[int, int] = {}  # block_hash -> block_id
        self._num_registrations = 0
        self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks :meth:`allocate` can hand out: empty ones plus cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_empty_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for reuse (reclaimable)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks, each with a reference count of one: empty ones first (the latest
        released first, so few distinct blocks are ever touched), then the least recently released
        cached ones (their registration is dropped)."""
        free, ref_counts = self._free, self._ref_counts
        if num_blocks > len(free) + len(self._cached):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            if free:
                block_id = free.popitem()[0]  # the back: the latest released
            else:
                block_id = self._cached.popitem(last=False)[0]
                self._evict(block_id)
            ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def share(self, block_ids: list[int]) -> None:
        """Add one reference to each (used) block: another table now points at it too."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} is free; only a used block can be shared")
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in order; a registered block with none left is cached
        (most recently released last), any other is free again."""
        ref_counts, keys, cached, free = self._ref_counts, self._keys, self._cached, self._free
        for block_id in block_ids:
            count = ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} released more often than it was referenced")
            count -= 1
            ref_counts[block_id] = count
            if count == 0:
                if block_id in keys:
                    cached[block_id] = None
                else:
                    free[block_id] = None

    # -- reuse ----------------------------------------------------------------------------------------

    def lookup(self, block_hash: int) -> tuple[int, BlockKey] | None:
        """The registered block with this hash, if any (its contents still have to be verified)."""
        block_id = self._by_hash.get(block_hash)
        return None if block_id is None else (block_id, self._keys[block_id])

    def key(self, block_id: int) -> BlockKey | None:
        return self._keys.get(block_id)

    def share_cached(self, block_id: int) -> None:
        """Take one more reference on a registered block (a prefix hit); a cached one leaves the LRU."""
        require(block_id in self._keys, f"block {block_id} is not registered and cannot be shared")
        if self._ref_counts[block_id] == 0:
            del self._cached[block_id]
        self._ref_counts[block_id] += 1

    def register(
        self,
        block_id: int,
        block_hash: int,
        token_ids: tuple[int, ...],
        extra_keys: tuple,
        parent_serial: int,
    ) -> BlockKey | None:
        """Make an in-use full block findable by hash; returns the key its successors chain to.

        When the hash is taken by a block with the same contents (two requests computed the same prefix
        at once), that block stays the canonical copy and its key is returned: this one stays private.
        When the hash is taken by different contents (a collision), None: the chain stops here.
        """
        require(self._ref_counts[block_id] > 0, f"block {block_id} must be in use to be registered")
        require(block_id not in self._keys, f"block {block_id} is registered twice")
        found = self.lookup(block_hash)
        if found is not None:
            key = found[1]
            return key if key.matches(token_ids, extra_keys, parent_serial) else None
        self._num_registrations += 1
        key = BlockKey(block_hash, parent_serial, token_ids, extra_keys, self._num_registrations)
        self._keys[block_id] = key
        self._by_hash[block_hash] = block_id
        return key

    def _evict(self, block_id: int) -> None:
        key = self._keys.pop(block_id)
        del self._by_hash[key.block_hash]
        self.num_evicted_blocks += 1

    def check_integrity(self) -> None:
        """Free + in use + cached add up to the total, every block is in at most one list, reference
        counts are never negative, and the hash table and registrations agree."""
        counts = self._ref_counts
        used = sum(1 for c in counts if c > 0)
        require(all(c >= 0 for c in counts), "negative reference count")
        require(
            used + len(self._free) + len(self._cached) == self.num_blocks,
            f"used {used} + free {len(self._free)} + cached {len(self._cached)} != total {self.num_blocks}",
        )
        require(not self._free.keys() & self._cached.keys(), "a block is both free and cached")
        for block_id in self._free:
            require(counts[block_id] == 0, f"free block {block_id} is still referenced")
            require(block_id not in self._keys, f"free block {block_id} is still registered")
        for block_id in self._cached:
            require(counts[block_id] == 0, f"cached block {block_id} is still referenced")
            require(block_id in self._keys, f"cached block {block_id} is not registered")
        require(len(self._by_hash) == len(self._keys), "hash table and registrations differ in size")
        for block_id, key in self._keys.items():
            require(
                self._by_hash.get(key.block_hash) == block_id, f"block {block_id} is not findable by hash"
            )
