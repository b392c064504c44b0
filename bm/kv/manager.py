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


def beam_key(request_id: int, beam: int) -> int | tuple[int, int]:
    """The table id of one beam: beam 0 is the request's own table, so a request without beams has one."""
    return request_id if beam == 0 else (request_id, beam)


class KVCacheManager:
    """Block tables for active requests; allocation grows a table, completion frees it."""

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        self._num_beams: dict[int, int] = {}  # request id -> beam tables (absent: one)

    # -- capacity questions (what the schedulers ask) --------------------------------------------------

    def get_max_resource_count(self) -> int:
        """Total blocks in the pool: the budget a capacity policy divides among requests."""
        return self.pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.tokens_per_block)

    def get_needed_resource_to_completion(self, request: KVRequest) -> int:
        """Blocks the request holds once it has all its tokens, counting the ones it holds already.

        A beam request counts a full table per beam: an upper bound (beams share their prompt blocks),
        so that a request admitted on it can never run short.
        """
        beams = getattr(request, "beam_width", 1)
        return self.num_blocks_for_tokens(request.num_tokens_at_completion) * beams

    def get_remaining_resource_to_completion(self, request: KVRequest) -> int:
        """Blocks still to allocate before the request completes."""
        held = len(self._distinct_blocks(request.request_id))
        return max(0, self.get_needed_resource_to_completion(request) - held)

    def num_blocks_to_allocate(self, request_id: int, num_tokens: int) -> int:
        """Blocks :meth:`allocate` would take for the request to hold ``num_tokens`` tokens in total.

        For a request with beams: over every beam, plus a copy for each beam whose block at the next
        written position is shared (see :meth:`copy_on_write`).
        """
        num_beams = self._num_beams.get(request_id, 1)
        if num_beams == 1:
            held = len(self._tables.get(request_id, ()))
            return max(0, self.num_blocks_for_tokens(num_tokens) - held)
        total = 0
        index = (num_tokens - 1) // self.tokens_per_block
        writers: dict[int, int] = {}  # block written at the next position -> beams writing into it
        for beam in range(num_beams):
            table = self._tables[beam_key(request_id, beam)]
            total += max(0, self.num_blocks_for_tokens(num_tokens) - len(table))
            if index < len(table):
                writers[table[index]] = writers.get(table[index], 0) + 1
        # every writer of a shared block copies it, except the last when no one else holds it
        for block_id, count in writers.items():
            total += count - (self.pool.ref_count(block_id) == count)
        return total

    def num_freeable_blocks(self, request_id: int) -> int:
        """Blocks that :meth:`free` would return to the pool (those no other request references)."""
        refs: dict[int, int] = {}
        for table in self._request_tables(request_id):
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        return sum(1 for b, n in refs.items() if self.pool.ref_count(b) == n)

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
        freed = 0
        for beam in range(1, self._num_beams.pop(request_id, 1)):
            freed += self._free_table(beam_key(request_id, beam))
        return freed + self._free_table(request_id)

    def _free_table(self, key: int | tuple[int, int]) -> int:
        table = self._tables.pop(key, None)
        self._num_tokens.pop(key, None)
        if not table:
            return 0
        self.pool.release(table)
        return len(table)

    # -- beams: shared blocks, forked on write ---------------------------------------------------------

    def fork_beams(self, request_id: int, parents: list[int]) -> None:
        """Beam ``i`` now continues beam ``parents[i]``: its table becomes a shared copy of the parent's.

        Called after each beam-search step (the first call turns the prompt's single table into one per
        beam). No block is copied here; blocks are shared by reference count until a beam writes into a
        shared one, which :meth:`copy_on_write` then forks.
        """
        old = [beam_key(request_id, b) for b in range(self._num_beams.get(request_id, 1))]
        tables = [list(self._tables[old[p]]) for p in parents]
        num_tokens = [self._num_tokens[old[p]] for p in parents]
        for table in tables:
            self.pool.share(table)
        self.free(request_id)
        for beam, (table, n) in enumerate(zip(tables, num_tokens, strict=True)):
            self._tables[beam_key(request_id, beam)] = table
            self._num_tokens[beam_key(request_id, beam)] = n
        if len(parents) > 1:
            self._num_beams[request_id] = len(parents)

    def copy_on_write(self, key: int | tuple[int, int], position: int) -> tuple[int, int] | None:
        """Before writing ``position`` into table ``key``: if its block is shared, give the table its own copy.

        Returns ``(source, destination)`` block ids whose contents the runtime must copy, or None.
        """
        table = self._tables[key]
        index = position // self.tokens_per_block
        if index >= len(table) or self.pool.ref_count(table[index]) == 1:
            return None
        source = table[index]
        (destination,) = self.pool.allocate(1)
        table[index] = destination
        self.pool.release([source])
        return source, destination

    def num_beams(self, request_id: int) -> int:
        return self._num_beams.get(request_id, 1)

    def _request_tables(self, request_id: int) -> list[list[int]]:
        keys = (beam_key(request_id, b) for b in range(self._num_beams.get(request_id, 1)))
        return [self._tables[k] for k in keys if k in self._tables]

    def _distinct_blocks(self, request_id: int) -> set[int]:
        return {b for table in self._request_tables(request_id) for b in table}

    # -- views ----------------------------------------------------------------------------------------

    def block_ids(self, request_id: int) -> list[int]:
        return self._tables.get(request_id, [])

    def num_tokens(self, request_id: int) -> int:
        return self._num_tokens.get(request_id, 0)

    def has_request(self, request_id: int) -> bool:
        return request_id in self._tables

    @property
    def num_requests(self) -> int:
        """Owners of block tables (a request with beams counts once)."""
        return len(self._tables) - sum(n - 1 for n in self._num_beams.values())

    def check_integrity(self) -> None:
        """Pool accounting holds, every table covers its tokens, and each block's reference count is the
        number of tables holding it (a block is shared only between beams of one request)."""
        self.pool.check_integrity()
        seen: dict[int, int] = {}
        owner: dict[int, int] = {}
        for key, table in self._tables.items():
            request_id = key[0] if isinstance(key, tuple) else key
            require(
                len(table) == self.num_blocks_for_tokens(self._num_tokens.get(key, 0)),
                f"table {key}: {len(table)} blocks for {self._num_tokens.get(key)} tokens",
            )
            for block_id in table:
                if owner.setdefault(block_id, request_id) != request_id:
                    raise IntegrityError(
                        f"block {block_id} owned by requests {owner[block_id]} and {request_id}"
                    )
                seen[block_id] = seen.get(block_id, 0) + 1
        for block_id, count in seen.items():
            require(self.pool.ref_count(block_id) == count, f"block {block_id} has a wrong reference count")
        require(
            len(seen) == self.pool.num_used_blocks,
            f"{self.pool.num_used_blocks} blocks in use but {len(seen)} in tables",
        )
