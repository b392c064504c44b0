"""Owns the model and the KV tensors; turns a list of scheduled work items into one packed forward.

The engine hands over its :class:`~bm.engine.execution.protocol.WorkItem` values as they are (tokens, their
first position, the request's block table, whether to sample after the last token); the runner reads only
those fields, so a forward of its own (warm-up, benchmarks, tests) builds them with :func:`work_item`.
Its attention backend (chosen once, :mod:`bm.runtime.backends`) builds the packed inputs and its own
attention metadata once per forward; the runner runs the model with that metadata current for every
layer and returns logits only where a token will be sampled. Layers with different attention windows
(Gemma 2/3, Qwen2's ``max_window_layers``) get one metadata per window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bm.engine.execution.protocol import WorkItem, WorkKind
from bm.kv.window_layout import AttentionWindowLayout
from bm.runtime.attention import ATTENTION_NAME, forward_context, register
from bm.runtime.backends import (
    AttentionBackend,
    BackendSetup,
    ForwardInputs,
    InputFill,
    WindowPlan,
    backend_class,
)
from bm.runtime.host_memory import reserved_zeros, tune_host_allocator
from bm.runtime.kv_quant import SCALE_BYTES, stored_row
from bm.runtime.model_loader import LoadedModel
from bm.runtime.transfer import to_device


def work_item(
    token_ids: list[int],
    start_pos: int,
    block_ids: list[int],
    sample: bool = True,
    **fields: Any,
) -> WorkItem:
    """A work item for a forward the runner computes with no request behind it (warm-up, benchmarks,
    tests): tokens ``token_ids`` at positions ``start_pos...`` over ``block_ids``; ``fields`` sets the
    other :class:`~bm.engine.execution.protocol.WorkItem` fields the runner reads (``keep_all``,
    ``num_draft``, ``window_block_ids``, ``decode_from``)."""
    return WorkItem(None, WorkKind.CONTEXT, token_ids, start_pos, block_ids, sample, **fields)


class ModelRunner:
    """The model, its KV block tensors and the attention backend over them: one packed forward a call."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        tokens_per_block: int,
        max_seq_len: int,
        max_attention_window: int | Sequence[int | None] | AttentionWindowLayout | None = None,
        sink_token_length: int = 0,
        window_pools: Mapping[int, int] | None = None,
        cache_dtype: str = "auto",
    ) -> None:
        """``max_attention_window``: one window for every layer, one per layer (by layer index), or a
        layout. A query at position p of a windowed layer attends keys in (p - window, p] and the first
        ``sink_token_length`` positions; blocks wholly outside every layer's window may be gone
        (``NO_BLOCK`` in tables). ``window_pools``: windows whose layers keep blocks in a pool of their
        own (window -> its blocks); work items then carry ``window_block_ids`` for them.
        ``cache_dtype``: ``kv_cache.dtype`` (auto: the model's KV dtype; int8 or fp8_e4m3:
        bm.runtime.kv_quant rows)."""
        odd = sorted({dim for _, dim in loaded.kv_shapes.values() if dim % SCALE_BYTES})
        if cache_dtype == "int8" and odd:
            raise ValueError(
                f"kv_cache.dtype: int8 keeps each row's float32 scale after its values, aligned only for head "
                f"sizes that are multiples of 4; this model has heads of {odd[0]}: use kv_cache.dtype: "
                "fp8_e4m3 or auto"
            )
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
        with torch.inference_mode():
            self.kv_caches: list[torch.Tensor | None] = [None] * num_layers
            for layer, (heads, dim) in loaded.kv_shapes.items():
                blocks = self.window_pools.get(layout.windows[layer], num_blocks)
                dtype, width = stored_row(dim, loaded.kv_dtype, cache_dtype)
                shape = (2, heads, blocks, tokens_per_block, width)
                if loaded.device.type == "cpu":  # pages mapped as a run first writes them (host_memory)
                    self.kv_caches[layer] = reserved_zeros(shape, dtype)
                else:
                    self.kv_caches[layer] = torch.zeros(shape, dtype=dtype, device=loaded.device)
        self.plan = WindowPlan(
            {layer: layout.windows[layer] for layer in sorted(loaded.kv_shapes)},
            layout.sink_token_length,
            frozenset(self.window_pools),
        )
        setup = BackendSetup(
            loaded, self.kv_caches, self.plan, tokens_per_block, max_seq_len, self._run_model
        )
        self.backend: AttentionBackend = backend_class(loaded)(setup)

    @property
    def attention_backend(self) -> str:
        """The backend's name (``torch``, ``triton``), for reports."""
        return self.backend.name

    @property
    def cache_bytes(self) -> int:
        """Bytes the KV tensors take (what a new engine over the same executor may take over)."""
        return sum(c.numel() * c.element_size() for c in self.kv_caches if c is not None)

    @property
    def block_bytes(self) -> int:
        """Bytes one block id takes across every layer's pool."""
        return sum(c[:, :, 0].numel() * c.element_size() for c in self.kv_caches if c is not None)

    def touch_blocks(self, num_blocks: int) -> int:
        """Write zeros over the first ``num_blocks`` blocks of every layer's pool (fewer where a window's
        pool is smaller); returns the bytes written. On a CPU the pool's pages are mapped at their first
        write (host_memory.reserved_zeros), so this moves that cost to now; the blocks are free (the
        engine is being built) and their contents are never read before a request writes them."""
        written = 0
        with torch.inference_mode():
            for cache in self.kv_caches:
                if cache is not None:
                    region = cache[:, :, : min(num_blocks, cache.shape[2])]
                    region.zero_()
                    written += region.numel() * region.element_size()
        return written

    @property
    def window(self) -> int | None:
        """The first attention layer's window (every layer's, unless the layout is mixed)."""
        return self.plan.default

    @torch.inference_mode()
    def forward(
        self,
        items: Sequence[WorkItem],
        prompt_tables: Mapping[int, torch.Tensor] | None = None,
        static_ok: bool = True,
        fill: InputFill | None = None,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """Run every item in one packed forward; return float32 logits ``[num_kept, vocab]``: one row per
        sampled item, one per token for a ``keep_all`` item, or ``num_draft + 1`` for an item ending in
        drafts, in item order.

        ``float_logits=False``: the logits in the model's dtype instead, possibly a view of a CUDA graph's
        static output that the next step overwrites. A greedy step's argmax needs no float32 copy (the
        conversion is exact, so the argmax is the same): on the 1B shape's 256-row decode step that copy
        moved ~200 MB, about 0.1 ms on an H100.

        ``prompt_tables``: item index -> its prompt-tuning table; there a token id ``vocab + i`` embeds
        as the table's row ``i`` (the rest of the batch embeds as usual, in the same forward).
        ``static_ok``: a decode-only step may replay a CUDA graph (False while LoRA adapters are in use).
        ``fill``: input tokens the previous launch left on the device (overlap scheduling), written over
        their rows' placeholders before the model runs."""
        if static_ok and not prompt_tables:
            logits = self.backend.try_static_decode(items, fill)
            if logits is not None:
                return logits.to(torch.float32, copy=True) if float_logits else logits
        inputs = self.backend.prepare(items)
        if fill is not None:
            fill.apply(inputs.input_ids)
        embeds = self._embed(items, inputs.input_ids, prompt_tables) if prompt_tables else None
        logits = self._run_model(inputs, embeds)
        return logits.float() if float_logits else logits

    def _run_model(self, inputs: ForwardInputs[Any], embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The model over one packed batch with its attention metadata current: ``[num_kept, vocab]``
        logits in the model's dtype. ``embeds`` replaces the token ids' embedding where given."""
        model_inputs = {"input_ids": inputs.input_ids} if embeds is None else {"inputs_embeds": embeds}
        with forward_context(self.backend, inputs.metadata):
            out = self.model(
                **model_inputs,
                position_ids=inputs.positions,
                use_cache=False,
                logits_to_keep=inputs.logits_index,
            )
        return out.logits[0]

    def _embed(
        self, items: Sequence[WorkItem], input_ids: torch.Tensor, tables: Mapping[int, torch.Tensor]
    ) -> torch.Tensor:
        """Token embeddings ``[1, T, hidden]`` with virtual ids (>= vocab) replaced by table rows.

        Where the virtual ids sit is read off the items' token ids on the host (a pending token, -1, is
        never one), not off ``input_ids`` on the device: finding them there (``nonzero``) made the host
        wait for the step in flight on CUDA, every step with a prompt-tuning table."""
        embedding = self.model.get_input_embeddings()
        vocab = self.loaded.vocab_size  # the embedding may hold padding rows past it
        ids = input_ids[0]
        embeds = embedding(ids.masked_fill(ids >= vocab, 0))
        offset = 0
        for i, item in enumerate(items):
            table = tables.get(i)
            if table is not None:
                virtual = [(offset + j, t - vocab) for j, t in enumerate(item.token_ids) if t >= vocab]
                if virtual:
                    where = to_device(virtual, torch.long, embeds.device)
                    embeds[where[:, 0]] = table.index_select(0, where[:, 1]).to(embeds.dtype)
            offset += len(item.token_ids)
        return embeds[None]

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``source -> destination`` in every layer (a beam forking a shared block)."""
        if not copies:
            return
        assert not self.window_pools, "beams share one table for every layer: no windowed pools"
        src = to_device([c[0] for c in copies], torch.long, self.device)
        dst = to_device([c[1] for c in copies], torch.long, self.device)
        for cache in self.kv_caches:
            if cache is not None:
                cache.index_copy_(2, dst, cache.index_select(2, src))
