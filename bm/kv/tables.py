"""What the cache holds for one request: a block table per beam, and under V1 a table of pad tokens.

Beam search forks a request's table into one per beam; they share blocks by reference count until a beam
writes into a shared one. Keeping every table of a request behind this one class means the manager never
keys tables by ``(request, beam)`` tuples, and freeing a request is freeing one object.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from bm.kv.block_hash import BlockKey
from bm.kv.block_pool import IntegrityError, require

if TYPE_CHECKING:
    from bm.kv.block_pool import BlockPool

# A table entry whose block was released because it fell outside the attention window.
NO_BLOCK = -1


def release_behind_window(
    table: list[int], start: int, num_computed_tokens: int, window: int, tokens_per_block: int
) -> tuple[list[int], int]:
    """Mark the entries from ``start`` up to the first block the next query still attends as
    :data:`NO_BLOCK`, and return the block ids they held (for the caller's pool to release) with the
    index the released range ends at (``start`` when there is none).

    The next query sits at ``num_computed_tokens`` and sees the keys after ``position - window``; later
    queries see less, so a block wholly before that never comes back. ``start`` is past the sink blocks
    and the entries already looked at. The main table and every windowed pool's table release this way.
    """
    end = min(max(0, num_computed_tokens - window + 1) // tokens_per_block, len(table))
    if end <= start:
        return [], start
    released = [b for b in table[start:end] if b != NO_BLOCK]
    table[start:end] = [NO_BLOCK] * (end - start)
    return released, end


class RequestBlocks:
    """Block tables of one request: ``tables[b]`` covers ``num_tokens[b]`` tokens of beam ``b``."""

    __slots__ = ("chain", "family", "num_padding_tokens", "num_released", "num_tokens", "padding", "tables")

    def __init__(self) -> None:
        self.tables: list[list[int]] = [[]]
        self.num_tokens: list[int] = [0]
        # V1 only: the pad tokens executed beside a shorter prompt, in a table of their own so they never
        # touch the request's real attention.
        self.padding: list[int] = []
        self.num_padding_tokens = 0
        self.chain: list[BlockKey | None] = []  # keys of the registered prefix (block reuse)
        self.num_released = 0  # attention window: blocks below this index were looked at
        self.family: int | None = None  # n samples: the request whose prompt blocks these tables share

    @property
    def num_beams(self) -> int:
        return len(self.tables)

    @property
    def is_forked(self) -> bool:
        """Its tables share blocks by reference count, with each other (beams) or with sample siblings
        (a family): a write into a shared block copies it first (:class:`bm.kv.shared_tables.SharedTables`)."""
        return len(self.tables) > 1 or self.family is not None

    def grow(self, beam: int, num_tokens: int, pool: BlockPool, tokens_per_block: int) -> list[int]:
        """Extend table ``beam`` with fresh blocks from ``pool`` until it holds ``num_tokens`` tokens (a
        table never shrinks here; :meth:`bm.kv.KVCacheManager.trim` rolls back). Returns the table."""
        table = self.tables[beam]
        missing = -(-num_tokens // tokens_per_block) - len(table)
        if missing > 0:
            table.extend(pool.allocate(missing))
        if num_tokens > self.num_tokens[beam]:
            self.num_tokens[beam] = num_tokens
        return table

    def all_tables(self) -> Iterator[list[int]]:
        yield from self.tables
        if self.padding:
            yield self.padding

    def live_blocks(self) -> Iterator[int]:
        """Every held block, once per table that references it."""
        for table in self.all_tables():
            for block_id in table:
                if block_id != NO_BLOCK:
                    yield block_id

    def check_integrity(self, request_id: int, tokens_per_block: int) -> None:
        """Every table (the pad table too) has exactly the blocks its tokens fill, none listed twice."""
        sized = [*zip(self.tables, self.num_tokens, strict=True), (self.padding, self.num_padding_tokens)]
        for table, num_tokens in sized:
            require(
                len(table) == -(-num_tokens // tokens_per_block),
                f"request {request_id}: a table of {len(table)} blocks for {num_tokens} tokens",
            )
            live = [b for b in table if b != NO_BLOCK]
            if len(live) != len(set(live)):
                raise IntegrityError(f"request {request_id}: a table lists a block twice: {table}")

    def distinct_blocks(self) -> set[int]:
        # set() over whole tables runs in C; a no-evict policy asks this of every request every iteration
        held = set(self.tables[0]) if len(self.tables) == 1 else set().union(*self.tables)
        if self.padding:
            held.update(self.padding)
        held.discard(NO_BLOCK)
        return held
