"""Per-window block accounting: layers with a narrower attention window keep blocks of their own. Pure Python.

With one block table for every layer, a block stays as long as any layer reads it, so a model that mixes
full and sliding layers (Gemma 3: five sliding layers for every full one) keeps every block of a long
sequence although most of its layers read only the last window. As in TensorRT-LLM's variable
sliding-window attention, the layers sharing a narrower window get a pool of their own: its blocks hold
only those layers' keys and values, and a request's table there releases the blocks that fell wholly
behind the window (sink blocks stay) after each forward. The full layers' table is the one the schedulers
see (the manager's ``pool``); the cache memory is split between the pools by their layers, so the full
layers' pool, and with it how many tokens fit, grows.

A windowed pool is sized so that it can never run out before the main pool does
(:func:`window_pool_bound`): schedulers stay exact while reasoning about one pool only, and a request a
windowed pool could not serve is a bug that :class:`BlockPool` reports, never a silent wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bm.kv.block_pool import BlockPool, require
from bm.kv.tables import NO_BLOCK
from bm.kv.types import cdiv


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """An attention window over one block table, as TensorRT-LLM's: a query at position ``p`` attends
    positions ``p - window + 1 .. p`` and the first ``sink_token_length`` (the sinks). The main table and
    every windowed pool's table release behind their window by this one rule."""

    window: int
    sink_token_length: int
    tokens_per_block: int

    @property
    def max_blocks(self) -> int:
        """Most blocks a generating request's table holds: the window's tokens can straddle one more
        block than they fill, and sink blocks stay."""
        bs = self.tokens_per_block
        return cdiv(self.sink_token_length, bs) + cdiv(self.window, bs) + 1

    def release(self, table: list[int], num_released: int, num_computed_tokens: int) -> tuple[list[int], int]:
        """Mark the entries no query from ``num_computed_tokens`` on attends as :data:`NO_BLOCK`: from
        past the sink blocks and the entries already looked at (the first ``num_released``) up to the
        first block the next query reads. Returns the block ids they held, for the caller's pool to
        release, and the table's new ``num_released``."""
        bs = self.tokens_per_block
        start = max(cdiv(self.sink_token_length, bs), num_released)
        end = min(max(0, num_computed_tokens - self.window + 1) // bs, len(table))
        if end <= start:
            return [], num_released
        released = [b for b in table[start:end] if b != NO_BLOCK]
        table[start:end] = [NO_BLOCK] * (end - start)
        return released, end


@dataclass(frozen=True)
class WindowGroup:
    """The layers sharing one attention window narrower than the main table's, and their pool's size."""

    window: int
    num_layers: int
    num_blocks: int


def window_pool_bound(
    window: int, sink_token_length: int, tokens_per_block: int, max_num_requests: int, max_num_tokens: int
) -> int:
    """Most blocks a window's pool can hold at once, whatever the schedule.

    A request's table there, once released after a forward that left ``c`` tokens computed, holds its
    sink blocks plus the blocks from ``(c - window + 1) // bs`` on; the next iteration grows it by the
    ``n`` tokens it schedules. That is at most ``ceil(S/bs) + ceil((n + window)/bs) + 1`` blocks, and the
    ``n`` of one iteration sum to at most ``max_num_tokens`` (drafts included) over at most
    ``max_num_requests`` requests holding blocks.
    """
    bs = tokens_per_block
    sinks = cdiv(sink_token_length, bs)
    return max_num_requests * (sinks + 2) + cdiv(max_num_tokens + max_num_requests * window, bs)


def split_blocks(
    num_blocks: int, main_layers: int, groups: Sequence[tuple[int, int]], max_main_blocks: int
) -> tuple[int, list[int]]:
    """Share the memory of ``num_blocks`` all-layer blocks between the main pool and windowed pools.

    ``groups``: (layers, most blocks the pool can use) per windowed pool. Each windowed pool takes what
    it can use (no more than the main pool), the main pool the rest, up to ``max_main_blocks`` (what any
    schedule could fill). Never fewer main blocks than ``num_blocks``: the split only adds capacity.
    Returns (main blocks, blocks per windowed pool).
    """
    budget = num_blocks * (main_layers + sum(layers for layers, _ in groups))  # in one-layer blocks

    def cost(main: int) -> int:
        return main * main_layers + sum(layers * min(bound, main) for layers, bound in groups)

    low, high = num_blocks, max(num_blocks, budget // main_layers)
    while low < high:  # the largest main pool whose split fits the budget (cost grows with it)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= budget else (low, mid - 1)
    main = max(num_blocks, min(low, max_main_blocks))
    return main, [min(bound, main) for _, bound in groups]


class _Table:
    __slots__ = ("blocks", "num_released", "num_tokens")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.num_tokens = 0
        self.num_released = 0  # blocks below this index were looked at for release


class WindowedTables:
    """One window's pool and every request's table in it (one table per request: no beams, no reuse)."""

    def __init__(self, group: WindowGroup, tokens_per_block: int, sink_token_length: int = 0) -> None:
        self.group = group
        self.window = group.window
        self.tokens_per_block = tokens_per_block
        self.sink_token_length = sink_token_length
        self._window = SlidingWindow(group.window, sink_token_length, tokens_per_block)
        self.pool = BlockPool(group.num_blocks)
        self._tables: dict[int, _Table] = {}
        self.num_released_entries = 0  # over live tables: entries released behind the window

    def grow(self, request_id: int, num_tokens: int) -> list[int]:
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = _Table()
        missing = cdiv(num_tokens, self.tokens_per_block) - len(table.blocks)
        if missing > 0:
            table.blocks.extend(self.pool.allocate(missing))
        table.num_tokens = max(num_tokens, table.num_tokens)
        return table.blocks

    def release_outside_window(self, request_id: int, num_computed_tokens: int) -> int:
        """Give back the blocks no query from ``num_computed_tokens`` on attends here; returns how many."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        released, table.num_released = self._window.release(
            table.blocks, table.num_released, num_computed_tokens
        )
        self.pool.release(released)
        self.num_released_entries += len(released)
        return len(released)

    def trim(self, request_id: int, num_tokens: int) -> int:
        """Roll back to ``num_tokens`` tokens (rejected drafts): the blocks past them go back."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        keep = cdiv(num_tokens, self.tokens_per_block)
        extra = [b for b in reversed(table.blocks[keep:]) if b != NO_BLOCK]
        self.num_released_entries -= sum(1 for b in table.blocks[keep:] if b == NO_BLOCK)
        del table.blocks[keep:]
        table.num_released = min(table.num_released, keep)
        self.pool.release(extra)
        table.num_tokens = min(table.num_tokens, num_tokens)
        return len(extra)

    def free(self, request_id: int) -> int:
        table = self._tables.pop(request_id, None)
        if table is None:
            return 0
        live = [b for b in reversed(table.blocks) if b != NO_BLOCK]
        self.num_released_entries -= len(table.blocks) - len(live)
        self.pool.release(live)
        return len(live)

    def block_ids(self, request_id: int) -> list[int]:
        table = self._tables.get(request_id)
        return table.blocks if table is not None else []

    def check_integrity(self, num_tokens: dict[int, int]) -> None:
        """The pool holds, each table covers the main table's tokens (``num_tokens`` by request), no block
        is listed twice, and the pool's used blocks are exactly those the tables list."""
        self.pool.check_integrity()
        require(
            self._tables.keys() <= num_tokens.keys(),
            f"window {self.window}: tables of requests the main table does not hold",
        )
        held: list[int] = []
        released = 0
        for request_id, table in self._tables.items():
            require(
                table.num_tokens == num_tokens[request_id]
                and len(table.blocks) == cdiv(table.num_tokens, self.tokens_per_block),
                f"window {self.window}: request {request_id}'s table of {len(table.blocks)} blocks for "
                f"{table.num_tokens} tokens, the main table's {num_tokens[request_id]}",
            )
            live = [b for b in table.blocks if b != NO_BLOCK]
            released += len(table.blocks) - len(live)
            held.extend(live)
        require(len(held) == len(set(held)), f"window {self.window}: a block is in two tables")
        require(all(self.pool.ref_count(b) == 1 for b in held), f"window {self.window}: a shared block")
        require(
            len(held) == self.pool.num_used_blocks,
            f"window {self.window}: {self.pool.num_used_blocks} blocks in use but {len(held)} in tables",
        )
        require(released == self.num_released_entries, f"window {self.window}: released count drifted")
