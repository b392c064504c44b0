"""A packed forward on the Triton path: one metadata layout, filled once, shared by every layer.

:class:`PagedForward` is what :class:`bm.runtime.model_runner.ModelRunner` delegates to when its
attention runs on the Triton kernels (on CUDA, or when forced with ``BM_ATTENTION=triton``). Layers with
another attention window read the same tables with their own window; layers whose window keeps blocks
in a pool of its own read that pool's tables. Decode-only steps go through :class:`DecodeGraphs`
(static buffers, replayed CUDA graphs) when the ``model.cuda_graphs`` switch allows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from bm.runtime.attention import AttentionMetadata, batch_metadata, segment_rows
from bm.runtime.triton.batch import BatchBuilder, Inputs, PagedBatch


@dataclass(frozen=True)
class WindowPlan:
    """Which window each attention layer has, and which windows keep blocks in a pool of their own."""

    windows: dict[int, int | None]  # layer_idx -> window (None: full attention)
    sink_tokens: int
    pooled: frozenset[int]

    @property
    def default(self) -> int | None:
        return self.windows[min(self.windows)]

    def metadata(self, kv_caches: list, inputs: Inputs) -> AttentionMetadata:
        """One AttentionMetadata for the first layer's window, with per-layer views for the others."""
        by_window: dict[int | None, AttentionMetadata] = {}
        for window in dict.fromkeys(self.windows.values()):
            base = inputs.pooled[window] if window in self.pooled else inputs.batch
            batch = base.with_window(window, self.sink_tokens)
            by_window[window] = AttentionMetadata(kv_caches, batch.slot_mapping, paged=batch)
        meta = by_window[self.default]
        others = {layer: by_window[w] for layer, w in self.windows.items() if w != self.default}
        meta.layers = others or None
        return meta


def kept_rows(segments: Sequence) -> list[int]:
    """Packed indices whose logits a forward returns (as ModelRunner.forward documents)."""
    keep: list[int] = []
    offset = 0
    for seg in segments:
        keep.extend(segment_rows(seg, offset))
        offset += len(seg.token_ids)
    return keep


class PagedForward:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        plan: WindowPlan,
        device: torch.device,
        tokens_per_block: int,
        max_seq_len: int,
        cuda_graphs: str,
        embed: Callable[[Sequence, torch.Tensor, Mapping[int, torch.Tensor]], torch.Tensor],
    ) -> None:
        from bm.runtime.triton.graphs import DecodeGraphs, graphs_enabled

        self.model = model
        self.kv_caches = kv_caches
        self.plan = plan
        self.builder = BatchBuilder(device, tokens_per_block)
        self._embed = embed
        self.graphs: DecodeGraphs | None = None
        if graphs_enabled(cuda_graphs, device):
            self.graphs = DecodeGraphs(self, device, tokens_per_block, max_seq_len)

    def forward(
        self,
        segments: Sequence,
        prompt_tables: Mapping[int, torch.Tensor] | None = None,
        static_ok: bool = True,
    ) -> torch.Tensor:
        """Float32 logits of the kept rows, as :meth:`ModelRunner.forward` returns them."""
        if self.graphs is not None and static_ok and not prompt_tables and self.graphs.serves(segments):
            return self.graphs.run(segments)
        pooled = {w: [seg.window_block_ids[w] for seg in segments] for w in self.plan.pooled}
        inputs = self.builder.build(
            [seg.token_ids for seg in segments],
            [seg.start_pos for seg in segments],
            [seg.block_ids for seg in segments],
            kept_rows(segments),
            pooled,
        )
        model_inputs: dict[str, torch.Tensor] = {"input_ids": inputs.input_ids}
        if prompt_tables:
            model_inputs = {"inputs_embeds": self._embed(segments, inputs.input_ids, prompt_tables)}
        return self.run_model(model_inputs, inputs.positions, inputs.logits_index, inputs).float()

    def run_model(
        self,
        model_inputs: dict[str, torch.Tensor],
        positions: torch.Tensor,
        logits_index: torch.Tensor,
        inputs: Inputs,
    ) -> torch.Tensor:
        """The model over one packed batch: ``[num_kept, vocab]`` logits in the model's dtype."""
        meta = self.plan.metadata(self.kv_caches, inputs)
        with batch_metadata(meta):
            out = self.model(
                **model_inputs, position_ids=positions, use_cache=False, logits_to_keep=logits_index
            )
        return out.logits[0]


def decode_batch(batch: PagedBatch) -> bool:
    """Whether every sequence of a batch has one query (a decode-only step)."""
    return batch.max_query_len == 1
