"""Per-request block tables over a :class:`BlockPool`. Pure Python.

The manager is the only place that knows how many blocks a request needs, now and at completion, so the
capacity policies above it never do block arithmetic of their own. It returns plain lists of block ids;
the runtime turns them into slot mappings and block-table tensors.
"""

from __future__ import annotations

from typing import Protocol

from bm.kv.block_pool import BlockPool, IntegrityError, require


class KVRequest(Protocol):
    """What the manager needs to know of a request (the scheduler's ``LlmRequest`` satisfies it)."""

    @property
    def request_id(self) -> int: ...

    @property
    def num_tokens_at_completion(self) -> int:
        """Prompt plus the most tokens it may still generate: the cache footprint at its end."""
        ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables for active requests; allocation grows a table, completion frees it."""

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}

    # -- capacity questions (what the schedulers ask) --------------------------------------------------

    def get_max_resource_count(self) -> int:
        """Total blocks in the pool: the budget a capacity policy divides among requests."""
        return self.pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.tokens_per_block)

    def get_needed_resource_to_completion(self, request: KVRequest) -> int:
        """Blocks the request holds once it has all its tokens, counting the ones it holds already."""
        return self.num_blocks_for_tokens(request.num_tokens_at_completion)

    def get_remaining_resource_to_completion(self, request: KVRequest) -> int:
        """Blocks still to allocate before the request completes."""
        held = len(self._tables.get(request.request_id, ()))
        return max(0, self.get_needed_resource_to_completion(request) - held)

    def num_blocks_to_allocate(self, request_id: int, num_tokens: int) -> int:
        """Blocks :meth:`allocate` would take for the request to hold ``num_tokens`` tokens in total."""
        held = len(self._tables.get(request_id, ()))
        return max(0, self.num_blocks_for_tokens(num_tokens) - held)

    def num_freeable_blocks(self, request_id: int) -> int:
        """Blocks that :meth:`free` would return to the pool (those no other table references)."""
        return sum(1 for b in self._tables.get(request_id, ()) if self.pool.ref_count(b) == 1)

    def can_allocate(self, request_id: int, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_blocks_to_allocate(request_id, num_tokens))

    # -- allocation -----------------------------------------------------------------------------------

    def allocate(self, request_id: int, num_tokens: int) -> list[int]:
        """Grow the request's table to hold ``num_tokens`` tokens (a context chunk, or one more token).

        Returns the full block table. Raises :class:`OutOfBlocksError` when the pool is short; the
        capacity scheduler is expected to have checked.
        """
        table = self._tables.setdefault(request_id, [])
        missing = self.num_blocks_for_tokens(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        self._num_tokens[request_id] = max(num_tokens, self._num_tokens.get(request_id, 0))
        return table

    def append(self, request_id: int, num_new_tokens: int = 1) -> list[int]:
        """Room for generated tokens: the same growth as :meth:`allocate`, counted from the current size."""
        return self.allocate(request_id, self._num_tokens.get(request_id, 0) + num_new_tokens)

    def free(self, request_id: int) -> int:
        """Release every block of the request; returns how many it held. Unknown ids free nothing."""
        table = self._tables.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        if not table:
            return 0
        self.pool.release(table)
        return len(table)

    # -- views ----------------------------------------------------------------------------------------

    def block_ids(self, request_id: int) -> list[int]:
        return self._tables.get(request_id, [])

    def num_tokens(self, request_id: int) -> int:
        return self._num_tokens.get(request_id, 0)

    def has_request(self, request_id: int) -> bool:
        return request_id in self._tables

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def check_integrity(self) -> None:
        """Pool accounting holds, every table covers its tokens, and no block is owned twice."""
        self.pool.check_integrity()
        seen: dict[int, int] = {}
        for request_id, table in self._tables.items():
            require(
                len(table) == self.num_blocks_for_tokens(self._num_tokens.get(request_id, 0)),
                f"request {request_id}: {len(table)} blocks for {self._num_tokens.get(request_id)} tokens",
            )
            for block_id in table:
                if block_id in seen:
                    raise IntegrityError(
                        f"block {block_id} owned by requests {seen[block_id]} and {request_id}"
                    )
                seen[block_id] = request_id
                require(self.pool.ref_count(block_id) == 1, f"block {block_id} has a wrong reference count")
        require(
            len(seen) == self.pool.num_used_blocks,
            f"{self.pool.num_used_blocks} blocks in use but {len(seen)} in tables",
        )
