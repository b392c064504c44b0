"""What the cache holds for one request: a block table per beam, and under V1 a table of pad tokens.

Beam search forks a request's table into one per beam; they share blocks by reference count until a beam
writes into a shared one. Keeping every table of a request behind this one class means the manager never
keys tables by ``(request, beam)`` tuples, and freeing a request is freeing one object.
"""

from __future__ import annotations

from collections.abc import Iterator

from bm.kv.block_hash import BlockKey

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

    def distinct_blocks(self) -> set[int]:
        # set() over whole tables runs in C; a no-evict policy asks this of every request every iteration
        held = set(self.tables[0]) if len(self.tables) == 1 else set().union(*self.tables)
        if self.padding:
            held.update(self.padding)
        held.discard(NO_BLOCK)
        return held
