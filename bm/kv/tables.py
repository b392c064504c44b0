"""What the cache holds for one request: a block table per beam, and under V1 a table of pad tokens.

Beam search forks a request's table into one per beam; they share blocks by reference count until a beam
writes into a shared one. Keeping every table of a request behind this one class means the manager never
keys tables by ``(request, beam)`` tuples, and freeing a request is freeing one object. The tables grow,
trim and release themselves over a pool; the manager decides when.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from bm.kv.block_hash import BlockKey
from bm.kv.block_pool import IntegrityError, require

if TYPE_CHECKING:
    from bm.kv.block_pool import BlockPool

# A table entry whose block was released because it fell outside the attention window.
NO_BLOCK = -1


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

    def grow_padding(self, num_tokens: int, pool: BlockPool, tokens_per_block: int) -> list[int]:
        """V1: extend the pad-token table until it holds ``num_tokens`` pad tokens. Returns the table."""
        missing = -(-num_tokens // tokens_per_block) - len(self.padding)
        if missing > 0:
            self.padding.extend(pool.allocate(missing))
        self.num_padding_tokens = max(num_tokens, self.num_padding_tokens)
        return self.padding

    def trim(self, num_tokens: int, pool: BlockPool, tokens_per_block: int) -> int:
        """Roll the (single) table back to ``num_tokens`` tokens: the blocks past them go back to
        ``pool``, tail first. Returns how many."""
        table = self.tables[0]
        keep = -(-num_tokens // tokens_per_block)
        extra = [b for b in reversed(table[keep:]) if b != NO_BLOCK]
        del table[keep:]
        pool.release(extra)
        self.num_tokens[0] = min(self.num_tokens[0], num_tokens)
        return len(extra)

    def release(self, pool: BlockPool) -> int:
        """Give every held block back to ``pool``; returns how many references were dropped.

        Each table goes back tail first, and the first table (the one a request without beams registers
        for reuse) last, so among a sequence's cached blocks the tail is evicted before the head, which
        more requests are likely to share.
        """
        freed = 0
        for table in [*self.tables[1:], self.padding, self.tables[0]]:
            live = [b for b in reversed(table) if b != NO_BLOCK]
            pool.release(live)
            freed += len(live)
        return freed

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


def held_references(requests: Mapping[int, RequestBlocks], request_ids: Iterable[int]) -> dict[int, int]:
    """Block id -> references the tables of ``request_ids`` (those in ``requests``) hold on it."""
    refs: dict[int, int] = {}
    for request_id in request_ids:
        blocks = requests.get(request_id)
        if blocks is not None:
            for b in blocks.live_blocks():
                refs[b] = refs.get(b, 0) + 1
    return refs


def check_references(requests: Mapping[int, RequestBlocks], pool: BlockPool, tokens_per_block: int) -> None:
    """Every request's tables are well formed, each block's reference count is the number of tables
    holding it, and the pool's used blocks are exactly the blocks some table holds."""
    holders: dict[int, int] = {}
    for request_id, blocks in requests.items():
        blocks.check_integrity(request_id, tokens_per_block)
        for block_id in blocks.live_blocks():
            holders[block_id] = holders.get(block_id, 0) + 1
    for block_id, count in holders.items():
        require(
            pool.ref_count(block_id) == count,
            f"block {block_id} has reference count {pool.ref_count(block_id)} but {count} tables hold it",
        )
    require(
        len(holders) == pool.num_used_blocks,
        f"{pool.num_used_blocks} blocks in use but {len(holders)} in tables",
    )
