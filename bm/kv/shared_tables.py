"""Block tables that share blocks by reference count: a beam request's table per beam, and the tables of
an n-samples family (a request and the siblings forked from its computed prompt). Pure Python.

Sharing is what makes beams and samples cheap: a fork copies no block, it only takes references; a
table copies a block only when it is about to write into one that another table still holds (copy on
write). Everything that follows from that lives here: forking, the copy before a write, how many blocks a
forked request needs (its copies included) now and to completion, and the invariant that without block
reuse only tables of one request or one family share a block. The manager keeps the tables
(:class:`RequestBlocks`) and hands a forked request's ones to this class; a plain request never comes
here.
"""

from __future__ import annotations

from collections.abc import Mapping

from bm.kv.block_pool import BlockPool, IntegrityError, require
from bm.kv.tables import NO_BLOCK, RequestBlocks
from bm.kv.types import KVRequest, sharing_of


class SharedTables:
    """Forking, copy on write and the block counts of forked tables, over one pool."""

    def __init__(self, pool: BlockPool, tokens_per_block: int) -> None:
        self.pool = pool
        self.tokens_per_block = tokens_per_block

    # -- what a forked request needs ------------------------------------------------------------------

    @staticmethod
    def num_blocks_to_completion(request: KVRequest, num_blocks: int) -> int | None:
        """Most blocks a beam or sample request holds at once, given ``num_blocks`` for one table of its
        final length; None for a request whose table is never forked.

        Beams: a full table per beam and no window release (beams fork their tables), an upper bound so
        a request admitted on it never runs short. n samples: every sample's full table, each with one
        copy of a shared block (see :meth:`fork_sample`), counted before the fork for all of them and
        after it by each sibling.
        """
        beams, num_pending_samples, shares_blocks = sharing_of(request)
        if beams > 1:
            return num_blocks * beams
        if num_pending_samples > 0 or shares_blocks:
            return (num_blocks + 1) * (1 + num_pending_samples)
        return None

    def num_blocks_to_allocate(self, blocks: RequestBlocks, num_tokens: int) -> int:
        """Blocks :meth:`grow` takes for a forked request to hold ``num_tokens`` tokens: the growth of
        every table, plus a copy for each table whose block at the next written position is shared."""
        bs = self.tokens_per_block
        needed = -(-num_tokens // bs)
        if len(blocks.tables) == 1:  # a sample: its one table may share its tail with siblings
            return max(0, needed - len(blocks.tables[0])) + (self._shared_tail(blocks) is not None)
        total = 0
        index = (num_tokens - 1) // bs
        writers: dict[int, int] = {}  # block written at the next position -> beams writing into it
        for table in blocks.tables:
            total += max(0, needed - len(table))
            if index < len(table):
                writers[table[index]] = writers.get(table[index], 0) + 1
        # every writer of a shared block copies it, except the last when no one else holds it
        for block_id, count in writers.items():
            total += count - (self.pool.ref_count(block_id) == count)
        return total

    # -- growing: copy, then write -------------------------------------------------------------------

    def grow(self, blocks: RequestBlocks, num_tokens: int) -> list[tuple[int, int]]:
        """Grow every table of a forked request to ``num_tokens`` tokens, each first copying the shared
        block it is about to write into. Returns the ``(source, destination)`` copies for the runtime,
        in the order the blocks were taken (each table's copy, then its growth)."""
        copies: list[tuple[int, int]] = []
        if len(blocks.tables) == 1:
            index = self._shared_tail(blocks)
            if index is not None:
                copies.append(self._copy(blocks.tables[0], index))
            blocks.grow(0, num_tokens, self.pool, self.tokens_per_block)
            return copies
        for beam in range(len(blocks.tables)):
            copy = self.copy_on_write(blocks.tables[beam], num_tokens - 1)
            if copy is not None:
                copies.append(copy)
            blocks.grow(beam, num_tokens, self.pool, self.tokens_per_block)
        return copies

    def copy_on_write(self, table: list[int], position: int) -> tuple[int, int] | None:
        """Before ``table`` writes ``position``: if its block is shared, give the table its own copy.

        Returns ``(source, destination)`` block ids whose contents the runtime must copy, or None.
        """
        index = position // self.tokens_per_block
        if index >= len(table) or self.pool.ref_count(table[index]) == 1:
            return None
        return self._copy(table, index)

    def _copy(self, table: list[int], index: int) -> tuple[int, int]:
        source = table[index]
        (destination,) = self.pool.allocate(1)
        table[index] = destination
        self.pool.release([source])
        return source, destination

    def _shared_tail(self, blocks: RequestBlocks) -> int | None:
        """The index of the table's block at its next written position when another table shares it."""
        table = blocks.tables[0]
        index = blocks.num_tokens[0] // self.tokens_per_block
        if index < len(table) and table[index] != NO_BLOCK and self.pool.ref_count(table[index]) > 1:
            return index
        return None

    # -- forking --------------------------------------------------------------------------------------

    def fork_beams(self, blocks: RequestBlocks, parents: list[int]) -> None:
        """Beam ``i`` now continues beam ``parents[i]``: its table becomes a shared copy of the parent's.

        Called after each beam-search step (the first call turns the prompt's single table into one per
        beam). No block is copied here; blocks are shared by reference count until a beam writes into a
        shared one, which :meth:`grow` then copies. The new references are taken before the old ones are
        dropped, so a block both keep never passes through the free list.
        """
        tables = [list(blocks.tables[p]) for p in parents]
        num_tokens = [blocks.num_tokens[p] for p in parents]
        for table in tables:
            self.pool.share([b for b in table if b != NO_BLOCK])
        for table in blocks.tables:
            self.pool.release([b for b in reversed(table) if b != NO_BLOCK])
        blocks.tables, blocks.num_tokens = tables, num_tokens

    def found_family(self, source: RequestBlocks, family: int) -> None:
        """Make ``source`` (request ``family``, whose prompt is computed) the head of a sample family."""
        require(len(source.tables) == 1 and not source.padding, f"request {family}: samples need one table")
        source.family = family

    def fork_sample(self, source: RequestBlocks, num_tokens: int) -> RequestBlocks:
        """A sibling's tables: sharing the first ``num_tokens`` tokens of ``source``'s table (no copy here)
        and its registered chain, so block reuse goes on from where the prompt stands. The block holding
        the next written position, when partial, stays shared until a sibling (or the request) writes it:
        :meth:`grow` then copies it first."""
        table = source.tables[0][: -(-num_tokens // self.tokens_per_block)]
        self.pool.share([b for b in table if b != NO_BLOCK])
        blocks = RequestBlocks()
        blocks.tables[0] = list(table)
        blocks.num_tokens[0] = num_tokens
        blocks.chain = list(source.chain[: num_tokens // self.tokens_per_block])
        blocks.num_released = source.num_released
        blocks.family = source.family
        return blocks

    # -- invariants -----------------------------------------------------------------------------------

    def check_integrity(self, requests: Mapping[int, RequestBlocks], enable_block_reuse: bool) -> None:
        """A sample family's tables are single tables (never beams), and without block reuse a block is
        shared only between the tables of one request or of one family."""
        owner: dict[int, int] = {}
        for request_id, blocks in requests.items():
            if blocks.family is None:
                family = request_id
            else:
                family = blocks.family
                require(len(blocks.tables) == 1, f"request {request_id}: beams in a sample family")
            if enable_block_reuse:
                continue
            for block_id in blocks.live_blocks():
                if owner.setdefault(block_id, family) != family:
                    raise IntegrityError(
                        f"block {block_id} is shared by requests {owner[block_id]} and {request_id} "
                        "without block reuse"
                    )
