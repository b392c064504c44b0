"""One metadata layout per forward for the Triton attention path, filled through pinned buffers.

Every query of a packed forward is described by four arrays, whatever its kind (decode row, whole
prompt, chunk after a cached prefix, a verifying step's drafts):

- ``cu_seqlens`` int32 ``[B + 1]``: where each sequence's queries start in the packed batch;
- ``seq_lens`` int32 ``[B]``: keys each sequence has after this forward (cached + new);
- ``block_table`` int32 ``[B, W]``: each sequence's physical blocks, read in place by the kernel;
- ``slot_mapping`` int32 ``[T]``: the flat cache slot of each new token (-1: a padding row, not stored).

The host builds them as Python lists, writes them into one pinned buffer and sends it to the device
with a single non-blocking copy (with ``input_ids``, positions and the kept-logits index alongside), so
a forward costs one host-to-device transfer that overlaps the previous step's tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedBatch:
    """The attention metadata of one forward (one attention window's view of it)."""

    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_tokens: int
    max_query_len: int
    # the longest sequence the kernels may meet: the batch's own longest, or a CUDA graph's static
    # table's capacity (a graph replays what it captured: its split-KV choice must serve any context)
    max_seq_len: int
    window: int | None = None  # a query at p attends keys in (p - window, p] ...
    sink_tokens: int = 0  # ... and the first sink_tokens positions

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def with_window(self, window: int | None, sink_tokens: int) -> PagedBatch:
        """The same batch for layers with another attention window (their tables are the same)."""
        return PagedBatch(
            self.cu_seqlens, self.seq_lens, self.block_table, self.slot_mapping,
            self.num_tokens, self.max_query_len, self.max_seq_len, window,
            sink_tokens if window is not None else 0,
        )  # fmt: skip


class StagingBuffer:
    """A growable host buffer (pinned where the device is CUDA) and its device twin.

    :meth:`send` copies the first ``n`` values without blocking the host. Before the host buffer is
    written again, the previous copy must have finished reading it: an event recorded after the copy
    is waited on first (free in practice, since every step syncs on its sampled tokens anyway).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=dtype)
        self._numpy_dtype = self._host.numpy().dtype
        self._dev = self._host
        self._copied: torch.cuda.Event | None = None

    def send(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device, as a 1-D tensor (a view of the device buffer)."""
        n = len(values)
        if self.device.type == "cpu":
            # through numpy, as below: 0.15 against 0.50 ms for torch.tensor on 9,000 ints
            return torch.from_numpy(np.array(values, dtype=self._numpy_dtype))
        if self._copied is not None:
            self._copied.synchronize()
        if n > self._host.numel():
            size = max(1024, 1 << (n - 1).bit_length())
            self._host = torch.empty(size, dtype=self.dtype, pin_memory=self.pinned)
            self._dev = torch.empty(size, dtype=self.dtype, device=self.device)
        # numpy converts a list of ints about 4x faster than torch.tensor (0.12 against 0.42 ms for the
        # 9,000 values of a 256-request decode step's tables)
        self._host.numpy()[:n] = values
        out = self._dev[:n]
        out.copy_(self._host[:n], non_blocking=True)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out


@dataclass
class Inputs:
    """A forward's token inputs and its attention metadata, on the device."""

    input_ids: torch.Tensor  # [1, T] int64
    positions: torch.Tensor  # [1, T] int64
    logits_index: torch.Tensor  # [num_kept] int64
    batch: PagedBatch
    # batches over windowed pools (their own tables and slots), by window
    pooled: dict[int, PagedBatch]


class BatchBuilder:
    """Builds :class:`Inputs` for a list of sequences through two staging buffers (int64 and int32)."""

    def __init__(self, device: torch.device, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._longs = StagingBuffer(device, torch.long)
        self._ints = StagingBuffer(device, torch.int32)

    def build(
        self,
        tokens: Sequence[Sequence[int]],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        keep: Sequence[int],
        pooled_tables: dict[int, Sequence[Sequence[int]]] | None = None,
    ) -> Inputs:
        """``tokens[i]`` fed at positions ``starts[i]...`` of the sequence whose blocks are ``tables[i]``;
        ``keep``: packed indices whose logits are returned. ``pooled_tables``: window -> every sequence's
        table in that window's pool."""
        bs = self.tokens_per_block
        ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        lens: list[int] = []
        for toks, start in zip(tokens, starts, strict=True):
            ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
            cu.append(cu[-1] + len(toks))
            lens.append(start + len(toks))
        width = max(cdiv(n, bs) for n in lens)
        # Every array starts 16-byte aligned in the packed buffers: Triton compiles a kernel variant per
        # pointer alignment, and offsets that followed the batch size made steps of different sizes
        # meet different variants (a compile each, mid-run).
        ints: list[int] = []
        starts_at = [_aligned(ints, cu, 4), _aligned(ints, lens, 4)]
        table_parts = [tables, *(pooled_tables or {}).values()]
        for part in table_parts:
            rows = [
                v for table, n in zip(part, lens, strict=True) for v in _padded_row(table, cdiv(n, bs), width)
            ]
            starts_at += [_aligned(ints, rows, 4), _aligned(ints, _slots(part, positions, cu, bs), 4)]
        num, num_seqs = len(ids), len(lens)
        max_q = max(len(t) for t in tokens)
        flat_longs: list[int] = []
        long_at = [_aligned(flat_longs, values, 2) for values in (ids, positions, keep)]
        longs = self._longs.send(flat_longs)
        flat = self._ints.send(ints)
        cu_t = flat[starts_at[0] : starts_at[0] + num_seqs + 1]
        lens_t = flat[starts_at[1] : starts_at[1] + num_seqs]
        batches: list[PagedBatch] = []
        for i in range(len(table_parts)):
            table_at, slots_at = starts_at[2 + 2 * i], starts_at[3 + 2 * i]
            table_t = flat[table_at : table_at + num_seqs * width].view(num_seqs, width)
            slots_t = flat[slots_at : slots_at + num]
            batches.append(PagedBatch(cu_t, lens_t, table_t, slots_t, num, max_q, max(lens)))
        return Inputs(
            longs[long_at[0] : long_at[0] + num].view(1, num),
            longs[long_at[1] : long_at[1] + num].view(1, num),
            longs[long_at[2] : long_at[2] + len(keep)],
            batches[0],
            dict(zip(pooled_tables or {}, batches[1:], strict=True)),
        )


def _aligned(flat: list[int], values: Sequence[int], multiple: int) -> int:
    """Append ``values`` to ``flat`` starting at a multiple of ``multiple`` elements; returns the start."""
    flat.extend([0] * (-len(flat) % multiple))
    start = len(flat)
    flat.extend(values)
    return start


def _padded_row(table: Sequence[int], used: int, width: int) -> list[int]:
    """The first ``used`` blocks of a table, padded to ``width`` (padding is never read)."""
    row = list(table[:used])
    return row + [0] * (width - len(row))


def _slots(tables: Sequence[Sequence[int]], positions: list[int], cu: list[int], bs: int) -> list[int]:
    slots: list[int] = []
    for i, table in enumerate(tables):
        slots.extend(table[p // bs] * bs + p % bs for p in positions[cu[i] : cu[i + 1]])
    return slots
