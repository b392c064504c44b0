"""The torch backend's metadata: each forward's queries cut into prefill runs and decode rows, per window.

A context chunk of two or more tokens is a prefill run (:class:`PrefillSegment`: the compiled causal
kernel, or SDPA over its own keys or its gathered blocks); single-token queries, and the K + 1 queries
of a step verifying drafts, are decode rows, served all at once by the compiled kernel that reads blocks
in place (:class:`~bm.runtime.native.DecodeRows`) or, without it, grouped by context length with their blocks gathered
(:class:`DecodeGroup`). Under an attention window each query reads only its sink and window blocks.
:class:`WindowLayout` builds this for the layers sharing one window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bm.engine.execution.protocol import WorkItem
from bm.kv import cdiv
from bm.runtime.native import DecodeRows, PagedDecodeKernel

# Padded tokens per decode group: keeps one group's gathered keys (kv_heads x tokens x head_dim) small
# enough to stay in cache between the gather and the matmul that reads it.
DECODE_GROUP_TOKENS = 8192

PrefillRun = tuple[int, int, int, list[int]]  # (first packed index, end, cached prefix, block table)
DecodeRow = tuple[int, int, list[int]]  # (packed index, context length, block table)


@dataclass
class PrefillSegment:
    """A run of two or more query tokens of one request (a context chunk)."""

    start: int  # first token in the packed batch
    end: int
    prefix_len: int  # tokens already in the cache before this chunk
    # The blocks to read keys from, when prefix_len > 0: the request's first blocks, or under an
    # attention window only those holding attended keys (sink blocks, then the window's).
    block_ids: torch.Tensor | None = None
    # [L, keys] bool: keys are the gathered blocks' slots (prefix_len + L of them without a window), or
    # the chunk's own keys when nothing is gathered and the chunk is longer than the window.
    mask: torch.Tensor | None = None
    # [keys] positions of the mask's keys, where they are not simply 0, 1, ... (windowed gathers); read
    # only by ALiBi, whose bias depends on the distance between query and key.
    key_pos: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Single-token queries of similar context length, attended together in one fused attention call."""

    token_index: torch.Tensor  # [B] positions in the packed batch
    block_ids: torch.Tensor  # [B * num_blocks] flattened, padded block tables
    num_blocks: int
    row_bias: torch.Tensor  # [B, num_blocks * tokens_per_block]: 0 where attended, -inf past the end
    query_pos: torch.Tensor | None = None  # [B], for ALiBi
    key_pos: torch.Tensor | None = None  # [B, num_blocks * tokens_per_block] where not 0, 1, ... (ALiBi)


@dataclass
class WindowMetadata:
    """The torch backend's metadata for the layers of one attention window, in one forward."""

    slot_mapping: torch.Tensor  # [T] flat slot of each new token in these layers' cache
    prefill: list[PrefillSegment] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    native_decode: DecodeRows | None = None  # instead of decode_groups, where the kernel serves them


def add_rows(
    item: WorkItem,
    offset: int,
    table: list[int],
    bs: int,
    slots: list[int],
    prefill: list[PrefillRun],
    decode_rows: list[DecodeRow],
) -> None:
    """Add the flat cache slots of ``item``'s new tokens over ``table`` to ``slots``, and its queries
    (from packed index ``offset``) to the decode rows or the prefill runs.

    A context item that says where its decode rows begin (``decode_from``) is split there: its prompt
    positions always prefill and a resumed request's output always decodes, as each first ran alone, so
    chunking and pausing never change which kernel computes a position."""
    n, start = len(item.token_ids), item.start_pos
    if n == 1:
        slots.append(table[start // bs] * bs + start % bs)
    else:
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
    if item.decode_from is not None and not _verify_step(item, n):
        split = min(n, max(0, item.decode_from - start))
        if split:
            prefill.append((offset, offset + split, start, table))
        decode_rows.extend((offset + i, start + i + 1, table) for i in range(split, n))
    elif n == 1 or _verify_step(item, n):
        decode_rows.extend((offset + i, start + i + 1, table) for i in range(n))
    else:
        prefill.append((offset, offset + n, start, table))


def _verify_step(item: WorkItem, n: int) -> bool:
    """A generation step verifying drafts (its last token and K drafts, after a cached context).

    Its K + 1 queries run as K + 1 decode rows, query i attending the first ``start + i + 1`` keys, all
    read in place by the decode kernel in the same call as the batch's other decode rows. As a prefill
    chunk each would cost its own attention call per layer, with the prefix gathered from the cache,
    which made a verifying step cost several plain decode steps.
    """
    return item.num_draft > 0 and n == item.num_draft + 1 and item.start_pos > 0


def rows_in_pool(
    items: Sequence[WorkItem], window: int, bs: int
) -> tuple[list[int], list[PrefillRun], list[DecodeRow]]:
    """Slots, prefill runs and decode rows of the packed batch over each item's table in the ``window``
    pool (as the backend's ``prepare`` builds them over the main tables)."""
    slots: list[int] = []
    prefill: list[PrefillRun] = []
    decode_rows: list[DecodeRow] = []
    offset = 0
    for item in items:
        add_rows(item, offset, item.window_block_ids[window], bs, slots, prefill, decode_rows)
        offset += len(item.token_ids)
    return slots, prefill, decode_rows


class WindowLayout:
    """Builds the :class:`WindowMetadata` of the layers sharing one attention window (None: full
    attention)."""

    def __init__(
        self,
        window: int | None,
        sink: int,
        tokens_per_block: int,
        device: torch.device,
        dtype: torch.dtype,
        native_decode: PagedDecodeKernel | None,
    ) -> None:
        self.window = window
        self.sink = sink
        self.tokens_per_block = tokens_per_block
        self.device = device
        self.dtype = dtype  # attention computes in the cache's dtype
        self.native_decode = native_decode

    def metadata(
        self, slot_mapping: torch.Tensor, prefill: list[PrefillRun], decode_rows: list[DecodeRow]
    ) -> WindowMetadata:
        meta = WindowMetadata(slot_mapping, [self._prefill_segment(*p) for p in prefill])
        if self._native_decode_fits(decode_rows):
            meta.native_decode = self.native_decode_rows(decode_rows)
        else:
            meta.decode_groups = self.decode_groups(decode_rows)
        return meta

    def _prefill_segment(self, start: int, end: int, prefix: int, table: list[int]) -> PrefillSegment:
        ctx = prefix + (end - start)
        if self.window is not None and ctx > self.window:
            return self._window_prefill_segment(start, end, prefix, table)
        if prefix == 0:
            return PrefillSegment(start, end, 0)
        dev = self.device
        blocks = torch.tensor(table[: cdiv(ctx, self.tokens_per_block)], dtype=torch.long, device=dev)
        query_pos = torch.arange(prefix, ctx, device=dev)
        mask = torch.arange(ctx, device=dev)[None, :] <= query_pos[:, None]
        return PrefillSegment(start, end, prefix, blocks, mask)

    # -- attention window ---------------------------------------------------------------------------------

    def _attended_blocks(self, first_query: int, ctx: int) -> list[int]:
        """Logical blocks holding a key that some query in positions ``[first_query, ctx)`` attends."""
        bs = self.tokens_per_block
        first = max(0, first_query - self.window + 1) // bs
        return [*range(min(cdiv(self.sink, bs), first)), *range(first, cdiv(ctx, bs))]

    def _attends(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Whether query position ``q`` attends key position ``k`` (broadcast): causal, within the window
        or a sink; padding keys are negative and never attended."""
        return (k >= 0) & (k <= q) & ((k < self.sink) | (k > q - self.window))

    def _window_mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``[queries, keys]`` bool, every query against every key."""
        return self._attends(query_pos[:, None], key_pos[None, :])

    def _key_positions(self, blocks: torch.Tensor) -> torch.Tensor:
        """Positions of every slot of the given logical blocks (a negative block gives negative slots)."""
        bs = self.tokens_per_block
        pos = blocks[..., None] * bs + torch.arange(bs, device=self.device)
        pos = pos.masked_fill(blocks[..., None] < 0, -1)
        return pos.flatten(-2)

    def _window_prefill_segment(self, start: int, end: int, prefix: int, table: list[int]) -> PrefillSegment:
        dev = self.device
        ctx = prefix + (end - start)
        query_pos = torch.arange(prefix, ctx, device=dev)
        if prefix == 0:
            return PrefillSegment(start, end, 0, None, self._window_mask(query_pos, query_pos))
        logical = self._attended_blocks(prefix, ctx)
        blocks = torch.tensor([table[b] for b in logical], dtype=torch.long, device=dev)
        key_pos = self._key_positions(torch.tensor(logical, device=dev))
        return PrefillSegment(start, end, prefix, blocks, self._window_mask(query_pos, key_pos), key_pos)

    def _window_decode_groups(self, rows: list[DecodeRow]) -> list[DecodeGroup]:
        """Like :meth:`decode_groups`, but each query reads only its sink and window blocks."""
        bs = self.tokens_per_block
        spans = sorted(((r, self._attended_blocks(r[1] - 1, r[1])) for r in rows), key=lambda x: len(x[1]))
        groups, current = [], []
        for row, logical in spans:
            if current and (len(current) + 1) * len(logical) * bs > DECODE_GROUP_TOKENS:
                groups.append(self._window_decode_group(current))
                current = []
            current.append((row, logical))
        groups.append(self._window_decode_group(current))
        return groups

    def _window_decode_group(self, rows: list[tuple[DecodeRow, list[int]]]) -> DecodeGroup:
        dev = self.device
        num_blocks = len(rows[-1][1])
        flat: list[int] = []
        padded: list[list[int]] = []
        for (_, _, table), logical in rows:
            ids = [table[b] for b in logical]
            flat.extend(ids + [ids[0]] * (num_blocks - len(ids)))  # padding reads a valid block, masked
            padded.append(logical + [-1] * (num_blocks - len(logical)))
        key_pos = self._key_positions(torch.tensor(padded, device=dev))  # [B, num_blocks * bs]
        query_pos = torch.tensor([r[0][1] - 1 for r in rows], device=dev)[:, None]
        ok = self._attends(query_pos, key_pos)  # each row's query against its own keys
        bias = torch.zeros(ok.shape, dtype=self.dtype, device=dev).masked_fill_(~ok, float("-inf"))
        return DecodeGroup(
            token_index=torch.tensor([r[0][0] for r in rows], dtype=torch.long, device=dev),
            block_ids=torch.tensor(flat, dtype=torch.long, device=dev),
            num_blocks=num_blocks,
            row_bias=bias,
            query_pos=query_pos[:, 0],
            key_pos=key_pos,
        )

    # -- decode -----------------------------------------------------------------------------------------

    def _native_decode_fits(self, rows: list[DecodeRow]) -> bool:
        if self.native_decode is None or not rows:
            return False
        # The kernel honours a window on its own; sinks (keys kept before the window) it does not know.
        return self.window is None or self.sink == 0 or max(r[1] for r in rows) <= self.window

    def native_decode_rows(self, rows: list[DecodeRow]) -> DecodeRows:
        """Every decode row for the compiled kernel: one padded block table, read in place."""
        bs = self.tokens_per_block
        dev = self.device
        max_len = max(r[1] for r in rows)
        width = cdiv(max_len, bs)
        table: list[int] = []
        for _, ctx, blocks in rows:
            used = blocks[: cdiv(ctx, bs)]
            table.extend(used)
            table.extend([0] * (width - len(used)))  # never read: the kernel stops at the row's length
        return DecodeRows(
            token_index=torch.tensor([r[0] for r in rows], dtype=torch.long, device=dev),
            block_table=torch.tensor(table, dtype=torch.long, device=dev).view(len(rows), width),
            lengths=torch.tensor([r[1] for r in rows], dtype=torch.long, device=dev),
            max_len=max_len,
            window=self.window,
        )

    def decode_groups(self, rows: list[DecodeRow]) -> list[DecodeGroup]:
        """Sort single-token queries by context length and cut them into groups of bounded padded size."""
        if not rows:
            return []
        if self.window is not None and max(r[1] for r in rows) > self.window:
            return self._window_decode_groups(rows)
        bs = self.tokens_per_block
        rows = sorted(rows, key=lambda r: r[1])
        groups = []
        current: list[DecodeRow] = []
        for row in rows:
            padded = cdiv(row[1], bs) * bs
            if current and (len(current) + 1) * padded > DECODE_GROUP_TOKENS:
                groups.append(self._decode_group(current))
                current = []
            current.append(row)
        groups.append(self._decode_group(current))
        return groups

    def _decode_group(self, rows: list[DecodeRow]) -> DecodeGroup:
        bs = self.tokens_per_block
        dev = self.device
        num_blocks = cdiv(rows[-1][1], bs)  # rows are sorted: the last is the longest
        flat: list[int] = []
        for _, ctx, table in rows:
            used = table[: cdiv(ctx, bs)]
            flat.extend(used)
            flat.extend([used[0]] * (num_blocks - len(used)))  # padding reads a valid block, then is masked
        lengths = torch.tensor([r[1] for r in rows], device=dev)
        bias = torch.zeros(len(rows), num_blocks * bs, dtype=self.dtype, device=dev)
        bias.masked_fill_(
            torch.arange(num_blocks * bs, device=dev)[None, :] >= lengths[:, None], float("-inf")
        )
        return DecodeGroup(
            token_index=torch.tensor([r[0] for r in rows], dtype=torch.long, device=dev),
            block_ids=torch.tensor(flat, dtype=torch.long, device=dev),
            num_blocks=num_blocks,
            row_bias=bias,
            query_pos=lengths - 1,
        )
