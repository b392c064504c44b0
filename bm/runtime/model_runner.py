"""Owns the model and the KV tensors; turns a list of scheduled work items into one packed forward.

The engine hands over its :class:`~bm.engine.executor.WorkItem` values as they are (tokens, their first
position, the request's block table, whether to sample after the last token); the runner reads only
those fields, so a forward of its own (warm-up, benchmarks, tests) builds them with :func:`work_item`.
The runner builds the packed inputs and the attention metadata
once per forward, shares them with every layer, and returns logits only where a token will be sampled.
Layers with different attention windows (Gemma 2/3, Qwen2's ``max_window_layers``) get one metadata per
window, built by a :class:`_Layout` each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bm.engine.executor import WorkItem, WorkKind
from bm.kv import cdiv
from bm.kv.window_layout import AttentionWindowLayout
from bm.runtime.attention import (
    ATTENTION_NAME,
    AttentionMetadata,
    DecodeGroup,
    NativeDecode,
    PrefillSegment,
    batch_metadata,
    register,
    segment_rows,
)
from bm.runtime.host_memory import tune_host_allocator
from bm.runtime.model_loader import LoadedModel
from bm.runtime.native import PagedDecodeKernel, paged_decode_kernel
from bm.runtime.triton import ENV_SWITCH as ATTENTION_SWITCH
from bm.runtime.triton import triton_available

# Padded tokens per decode group: keeps one group's gathered keys (kv_heads x tokens x head_dim) small
# enough to stay in cache between the gather and the matmul that reads it.
DECODE_GROUP_TOKENS = 8192
# Pools below this size are zero-filled; larger ones rely on the OS handing out zeroed pages, so memory is
# committed only as blocks are used (a masked slot is then 0 or a finite old value, never NaN).
_ZERO_FILL_LIMIT_BYTES = 256 << 20


def work_item(
    token_ids: list[int],
    start_pos: int,
    block_ids: list[int],
    sample: bool = True,
    **fields: Any,
) -> WorkItem:
    """A work item for a forward the runner computes with no request behind it (warm-up, benchmarks,
    tests): tokens ``token_ids`` at positions ``start_pos...`` over ``block_ids``; ``fields`` sets the
    other :class:`~bm.engine.executor.WorkItem` fields the runner reads (``keep_all``, ``num_draft``,
    ``window_block_ids``, ``decode_from``)."""
    return WorkItem(None, WorkKind.CONTEXT, token_ids, start_pos, block_ids, sample, **fields)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        tokens_per_block: int,
        max_seq_len: int,
        max_attention_window: int | Sequence[int | None] | AttentionWindowLayout | None = None,
        sink_token_length: int = 0,
        window_pools: Mapping[int, int] | None = None,
    ) -> None:
        """``max_attention_window``: one window for every layer, one per layer (by layer index), or a
        layout. A query at position p of a windowed layer attends keys in (p - window, p] and the first
        ``sink_token_length`` positions; blocks wholly outside every layer's window may be gone
        (``NO_BLOCK`` in tables). ``window_pools``: windows whose layers keep blocks in a pool of their
        own (window -> its blocks); segments then carry ``window_block_ids`` for them."""
        num_layers = max(loaded.kv_shapes) + 1
        if isinstance(max_attention_window, AttentionWindowLayout):
            layout = max_attention_window
        elif max_attention_window is None or isinstance(max_attention_window, int):
            layout = AttentionWindowLayout((max_attention_window,) * num_layers, sink_token_length)
        else:
            layout = AttentionWindowLayout(tuple(max_attention_window), sink_token_length)
        if len(layout.windows) < num_layers:
            raise ValueError(
                f"attention windows for {len(layout.windows)} layers; the model has {num_layers}"
            )
        self.layout = layout
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.window_pools = dict(window_pools or {})
        register()
        if loaded.device.type == "cpu":
            tune_host_allocator()
        # The runner takes the model over: from now on it runs with bm's paged attention.
        self.model.set_attn_implementation(ATTENTION_NAME)
        total_bytes = loaded.kv_bytes_per_token * num_blocks * tokens_per_block  # an upper bound
        zero = loaded.device.type != "cpu" or total_bytes <= _ZERO_FILL_LIMIT_BYTES
        alloc = torch.zeros if zero else torch.empty
        widest = max(heads * dim for heads, dim in loaded.kv_shapes.values())
        group_tokens = max(DECODE_GROUP_TOKENS, cdiv(max_seq_len, tokens_per_block) * tokens_per_block)
        self.attention_backend = attention_backend(loaded)
        with torch.inference_mode():
            self.kv_caches: list[torch.Tensor | None] = [None] * num_layers
            for layer, (heads, dim) in loaded.kv_shapes.items():
                blocks = self.window_pools.get(layout.windows[layer], num_blocks)
                shape = (2, heads, blocks, tokens_per_block, dim)
                self.kv_caches[layer] = alloc(shape, dtype=loaded.kv_dtype, device=loaded.device)
            # keys and values of the largest decode group, gathered side by side (torch path only)
            scratch = 0 if self.attention_backend == "triton" else 2 * widest * group_tokens
            self.scratch = torch.empty(scratch, dtype=loaded.kv_dtype, device=loaded.device)
        # Decode attention reading blocks in place, where the compiled kernel exists and fits the cache;
        # otherwise (and with attention sinks) the gather-then-SDPA groups of _Layout.
        # bm's C kernels serve CPU caches only: on a GPU they are not even built (a compile per machine)
        kernel = paged_decode_kernel() if loaded.device.type == "cpu" else None
        caches = [c for c in self.kv_caches if c is not None]
        supported = kernel is not None and all(PagedDecodeKernel.supports(c) for c in caches)
        self.native_decode = kernel if supported else None
        windows = [layout.windows[layer] for layer in sorted(loaded.kv_shapes)]
        # one layout per distinct window, the first attention layer's first: its metadata is the default
        self._layouts = {
            w: _Layout(self, w, layout.sink_token_length if w is not None else 0)
            for w in dict.fromkeys(windows)
        }
        default = windows[0]
        self._other_layers = {
            layer: layout.windows[layer] for layer in loaded.kv_shapes if layout.windows[layer] != default
        }
        self._default_window = default
        self.paged = None  # the Triton path (bm.runtime.triton.forward), when it serves this runner
        if self.attention_backend == "triton":
            self.paged = self._paged_forward(max_seq_len)

    def _paged_forward(self, max_seq_len: int):  # -> bm.runtime.triton.forward.PagedForward
        from bm.runtime.triton.forward import PagedForward, WindowPlan

        plan = WindowPlan(
            {layer: self.layout.windows[layer] for layer in sorted(self.loaded.kv_shapes)},
            self.layout.sink_token_length,
            frozenset(self.window_pools),
        )
        return PagedForward(
            self.model, self.kv_caches, plan, self.device, self.tokens_per_block, max_seq_len,
            self.loaded.cuda_graphs, self._embed,
        )  # fmt: skip

    @property
    def cache_bytes(self) -> int:
        """Bytes the KV tensors take (what a new engine over the same executor may take over)."""
        return sum(c.numel() * c.element_size() for c in self.kv_caches if c is not None)

    @property
    def window(self) -> int | None:
        """The first attention layer's window (every layer's, unless the layout is mixed)."""
        return self._default_window

    @torch.inference_mode()
    def forward(
        self,
        segments: Sequence[WorkItem],
        prompt_tables: Mapping[int, torch.Tensor] | None = None,
        static_ok: bool = True,
    ) -> torch.Tensor:
        """Run every segment in one packed forward; return float32 logits ``[num_kept, vocab]``: one row per
        sampled segment, one per token for a ``keep_all`` segment, or ``num_draft + 1`` for a segment
        ending in drafts, in segment order.

        ``prompt_tables``: segment index -> its prompt-tuning table; there a token id ``vocab + i`` embeds
        as the table's row ``i`` (the rest of the batch embeds as usual, in the same forward).
        ``static_ok``: a decode-only step may replay a CUDA graph (False while LoRA adapters are in use)."""
        if self.paged is not None:
            return self.paged.forward(segments, prompt_tables, static_ok)
        input_ids, positions, meta, sample_index = self._prepare(segments)
        inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
        if prompt_tables:
            inputs = {"inputs_embeds": self._embed(segments, input_ids, prompt_tables)}
        with batch_metadata(meta):
            out = self.model(**inputs, position_ids=positions, use_cache=False, logits_to_keep=sample_index)
        return out.logits[0].float()

    def _embed(
        self, segments: Sequence[WorkItem], input_ids: torch.Tensor, tables: Mapping[int, torch.Tensor]
    ) -> torch.Tensor:
        """Token embeddings ``[1, T, hidden]`` with virtual ids (>= vocab) replaced by table rows."""
        embedding = self.model.get_input_embeddings()
        vocab = self.loaded.vocab_size  # the embedding may hold padding rows past it
        ids = input_ids[0]
        embeds = embedding(ids.masked_fill(ids >= vocab, 0))
        offset = 0
        for i, seg in enumerate(segments):
            n = len(seg.token_ids)
            table = tables.get(i)
            if table is not None:
                piece = ids[offset : offset + n]
                virtual = (piece >= vocab).nonzero()[:, 0]
                if virtual.numel():
                    rows = table.index_select(0, piece[virtual] - vocab)
                    embeds[offset + virtual] = rows.to(embeds.dtype)
            offset += n
        return embeds[None]

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``source -> destination`` in every layer (a beam forking a shared block)."""
        if not copies:
            return
        assert not self.window_pools, "beams share one table for every layer: no windowed pools"
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            if cache is not None:
                cache.index_copy_(2, dst, cache.index_select(2, src))

    def _prepare(
        self, segments: Sequence[WorkItem]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.tokens_per_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        prefill: list[tuple[int, int, int, list[int]]] = []
        decode_rows: list[tuple[int, int, list[int]]] = []  # (packed index, context length, blocks)
        offset = 0
        for seg in segments:
            n = len(seg.token_ids)
            start = seg.start_pos
            table = seg.block_ids
            ids.extend(seg.token_ids)
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            _place(seg, offset, table, prefill, decode_rows)
            sample_index.extend(segment_rows(seg, offset))
            offset += n

        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        by_window = {
            w: layout.metadata(self.kv_caches, slot_mapping, self.scratch, prefill, decode_rows)
            for w, layout in self._layouts.items()
            if w not in self.window_pools
        }
        for w in self.window_pools:  # layers with a pool of their own read and write their own tables
            own_slots, own_prefill, own_decode = _rows_for(segments, w, bs)
            own_mapping = torch.tensor(own_slots, dtype=torch.long, device=dev)
            by_window[w] = self._layouts[w].metadata(
                self.kv_caches, own_mapping, self.scratch, own_prefill, own_decode
            )
        meta = by_window[self._default_window]
        if self._other_layers:
            meta.layers = {layer: by_window[w] for layer, w in self._other_layers.items()}
        return (
            torch.tensor([ids], dtype=torch.long, device=dev),
            torch.tensor([positions], dtype=torch.long, device=dev),
            meta,
            torch.tensor(sample_index, dtype=torch.long, device=dev),
        )

    # Kept for benchmarks/decode_attention.py: the default layout's decode metadata.
    def _decode_groups(self, rows: list[tuple[int, int, list[int]]]) -> list[DecodeGroup]:
        return self._layouts[self._default_window]._decode_groups(rows)

    def _native_decode_rows(self, rows: list[tuple[int, int, list[int]]]) -> NativeDecode:
        return self._layouts[self._default_window]._native_decode_rows(rows)


def attention_backend(loaded: LoadedModel) -> str:
    """``triton`` (bm's Triton kernels) or ``torch`` (C kernels on CPU, SDPA otherwise).

    Triton on CUDA where triton is installed and every head fits the kernel; the torch path everywhere
    else, and always on CPU, whose C kernels are faster than interpreting Triton. ``BM_ATTENTION=triton``
    or ``=torch`` forces one (tests run the kernels on CPU that way, in Triton's interpreter).
    """
    forced = os.environ.get(ATTENTION_SWITCH, "auto")
    if forced in ("triton", "torch"):
        return forced
    if loaded.device.type != "cuda" or not triton_available():
        return "torch"
    from bm.runtime.triton.ops import supports_head_dim

    return "triton" if all(supports_head_dim(dim) for _, dim in loaded.kv_shapes.values()) else "torch"


def _rows_for(
    segments: Sequence[WorkItem], window: int, bs: int
) -> tuple[list[int], list[tuple[int, int, int, list[int]]], list[tuple[int, int, list[int]]]]:
    """Slots, prefill runs and decode rows of the packed batch, over each segment's table in the
    ``window`` pool (as :meth:`ModelRunner._prepare` builds them over the main tables)."""
    slots: list[int] = []
    prefill: list[tuple[int, int, int, list[int]]] = []
    decode_rows: list[tuple[int, int, list[int]]] = []
    offset = 0
    for seg in segments:
        n = len(seg.token_ids)
        start = seg.start_pos
        table = seg.window_block_ids[window]
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        _place(seg, offset, table, prefill, decode_rows)
        offset += n
    return slots, prefill, decode_rows


def _place(
    seg: WorkItem,
    offset: int,
    table: list[int],
    prefill: list[tuple[int, int, int, list[int]]],
    decode_rows: list[tuple[int, int, list[int]]],
) -> None:
    """Add ``seg``'s queries (from packed index ``offset``) to the decode rows or the prefill runs.

    A context segment that says where its decode rows begin (``decode_from``) is split there: its prompt
    positions always prefill and a resumed request's output always decodes, as each first ran alone, so
    chunking and pausing never change which kernel computes a position."""
    n, start = len(seg.token_ids), seg.start_pos
    if seg.decode_from is not None and not _verify_step(seg, n):
        split = min(n, max(0, seg.decode_from - start))
        if split:
            prefill.append((offset, offset + split, start, table))
        decode_rows.extend((offset + i, start + i + 1, table) for i in range(split, n))
    elif n == 1 or _verify_step(seg, n):
        decode_rows.extend((offset + i, start + i + 1, table) for i in range(n))
    else:
        prefill.append((offset, offset + n, start, table))


def _verify_step(seg: WorkItem, n: int) -> bool:
    """A generation step verifying drafts (its last token and K drafts, after a cached context).

    Its K + 1 queries run as K + 1 decode rows, query i attending the first ``start + i + 1`` keys, all
    read in place by the decode kernel in the same call as the batch's other decode rows. As a prefill
    chunk each would cost its own attention call per layer, with the prefix gathered from the cache,
    which made a verifying step cost several plain decode steps.
    """
    return seg.num_draft > 0 and n == seg.num_draft + 1 and seg.start_pos > 0


class _Layout:
    """Builds the attention metadata of the layers sharing one attention window (None: full attention)."""

    def __init__(self, runner: ModelRunner, window: int | None, sink: int) -> None:
        self.window = window
        self.sink = sink
        self.tokens_per_block = runner.tokens_per_block
        self.device = runner.device
        self.dtype = runner.loaded.kv_dtype  # attention computes in the cache's dtype
        self.native_decode = runner.native_decode

    def metadata(
        self,
        kv_caches: list[torch.Tensor | None],
        slot_mapping: torch.Tensor,
        scratch: torch.Tensor,
        prefill: list[tuple[int, int, int, list[int]]],
        decode_rows: list[tuple[int, int, list[int]]],
    ) -> AttentionMetadata:
        meta = AttentionMetadata(
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            prefill=[self._prefill_segment(*p) for p in prefill],
            scratch=scratch,
            kv_writer=self.native_decode,
        )
        if self._native_decode_fits(decode_rows):
            meta.native_decode = self._native_decode_rows(decode_rows)
        else:
            meta.decode_groups = self._decode_groups(decode_rows)
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

    def _window_decode_groups(self, rows: list[tuple[int, int, list[int]]]) -> list[DecodeGroup]:
        """Like :meth:`_decode_groups`, but each query reads only its sink and window blocks."""
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

    def _window_decode_group(self, rows: list[tuple[tuple[int, int, list[int]], list[int]]]) -> DecodeGroup:
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

    def _native_decode_fits(self, rows: list[tuple[int, int, list[int]]]) -> bool:
        if self.native_decode is None or not rows:
            return False
        # The kernel honours a window on its own; sinks (keys kept before the window) it does not know.
        return self.window is None or self.sink == 0 or max(r[1] for r in rows) <= self.window

    def _native_decode_rows(self, rows: list[tuple[int, int, list[int]]]) -> NativeDecode:
        bs = self.tokens_per_block
        dev = self.device
        max_len = max(r[1] for r in rows)
        width = cdiv(max_len, bs)
        table: list[int] = []
        for _, ctx, blocks in rows:
            used = blocks[: cdiv(ctx, bs)]
            table.extend(used)
            table.extend([0] * (width - len(used)))  # never read: the kernel stops at the row's length
        return NativeDecode(
            kernel=self.native_decode,
            token_index=torch.tensor([r[0] for r in rows], dtype=torch.long, device=dev),
            block_table=torch.tensor(table, dtype=torch.long, device=dev).view(len(rows), width),
            lengths=torch.tensor([r[1] for r in rows], dtype=torch.long, device=dev),
            max_len=max_len,
            window=self.window,
        )

    def _decode_groups(self, rows: list[tuple[int, int, list[int]]]) -> list[DecodeGroup]:
        """Sort single-token queries by context length and cut them into groups of bounded padded size."""
        if not rows:
            return []
        if self.window is not None and max(r[1] for r in rows) > self.window:
            return self._window_decode_groups(rows)
        bs = self.tokens_per_block
        rows = sorted(rows, key=lambda r: r[1])
        groups = []
        current: list[tuple[int, int, list[int]]] = []
        for row in rows:
            padded = cdiv(row[1], bs) * bs
            if current and (len(current) + 1) * padded > DECODE_GROUP_TOKENS:
                groups.append(self._decode_group(current))
                current = []
            current.append(row)
        groups.append(self._decode_group(current))
        return groups

    def _decode_group(self, rows: list[tuple[int, int, list[int]]]) -> DecodeGroup:
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
