"""The Triton backend: bm's Triton kernels over the paged cache, one metadata layout per forward.

Every query of a forward (decode rows, whole prompts, chunks after a cached prefix, a verifying step's
drafts) is described by one :class:`~bm.runtime.triton.batch.PagedBatch`, filled through pinned buffers
with one copy (:mod:`bm.runtime.triton.batch`); per layer one launch stores the new keys and values and
one computes the attention of the whole batch (:mod:`bm.runtime.triton.ops`). Layers with another
attention window read the same tables with their own window; layers whose window keeps blocks in a pool
of its own read that pool's tables. Decode-only steps replay CUDA graphs over static buffers
(:mod:`bm.runtime.triton.graphs`) where ``model.cuda_graphs`` allows.

Importing this module does not import triton: the kernels load at their first launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bm.engine.execution.protocol import WorkItem
from bm.runtime.attention import LayerCall
from bm.runtime.backends.base import (
    AttentionBackend,
    BackendSetup,
    ForwardInputs,
    InputFill,
    PerLayer,
    all_kept_rows,
)
from bm.runtime.kv_quant import is_quantized
from bm.runtime.model_loader import LoadedModel
from bm.runtime.triton import triton_available
from bm.runtime.triton.batch import BatchBuilder, Inputs, PagedBatch
from bm.runtime.triton.elementwise import TritonElementwise
from bm.runtime.triton.graphs import BUCKETS, DecodeGraphs, bucket_for, graphs_enabled
from bm.runtime.triton.ops import SplitScratch, device_sm_count, paged_attention, store_kv, supports_head_dim

TritonMetadata = PerLayer[PagedBatch]


class TritonBackend(AttentionBackend[TritonMetadata]):
    """Attention in Triton kernels: CUDA (or Triton's interpreter on the CPU, for the tests)."""

    name = "triton"

    @classmethod
    def serves(cls, loaded: LoadedModel) -> bool:
        """On CUDA, where triton is installed and every head fits the kernel (head size <= 256). Never
        chosen on its own on the CPU, whose C kernels are faster than interpreting Triton."""
        return (
            loaded.device.type == "cuda"
            and triton_available()
            and all(supports_head_dim(dim) for _, dim in loaded.kv_shapes.values())
        )

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        self.builder = BatchBuilder(self.device, self.tokens_per_block)
        self._run_model = setup.run_model
        # split-KV decode (bm.runtime.triton.ops): the SMs its choice fills, and one scratch buffer for
        # its partials, shared by every layer and kept for the CUDA graphs captured over it
        self.sm_count = device_sm_count(self.device)
        self.split_scratch = SplitScratch(self.device)
        # the layer's rotary and KV store as one launch, for the attention forwards that ask for it
        # (made at the first: constructing it loads the kernels, which a stubbed model never launches)
        self._rotary: TritonElementwise | None = None
        self.graphs: DecodeGraphs | None = None
        if graphs_enabled(setup.loaded.cuda_graphs, self.device):
            self.graphs = DecodeGraphs(
                self._run_static,
                sorted(self.plan.pooled),
                self.device,
                self.tokens_per_block,
                setup.max_seq_len,
            )

    def prepare(self, items: Sequence[WorkItem]) -> ForwardInputs[TritonMetadata]:
        pooled = {w: [item.window_block_ids[w] for item in items] for w in self.plan.pooled}
        inputs = self.builder.build(
            [item.token_ids for item in items],
            [item.start_pos for item in items],
            [item.block_ids for item in items],
            all_kept_rows(items),
            pooled,
        )
        return self._forward_inputs(inputs)

    def _forward_inputs(self, inputs: Inputs) -> ForwardInputs[TritonMetadata]:
        """The batch of each window: its table (the main one, or its pool's) seen with its window."""
        plan = self.plan
        by_window = {
            w: (inputs.pooled[w] if w in plan.pooled else inputs.batch).with_window(w, plan.sink_tokens)
            for w in dict.fromkeys(plan.windows.values())
        }
        metadata = PerLayer.by_window(plan, by_window)
        return ForwardInputs(inputs.input_ids, inputs.positions, inputs.logits_index, metadata)

    def _run_static(self, inputs: Inputs) -> torch.Tensor:
        """The model over the static buffers' inputs (run eagerly, or captured into a graph)."""
        return self._run_model(self._forward_inputs(inputs))

    def store_kv(self, metadata: TritonMetadata, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        store_kv(
            self.kv_caches[layer], key, value, metadata.for_layer(layer).slot_mapping, self.kv_scales[layer]
        )

    def rotate_and_store(
        self,
        metadata: TritonMetadata,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """The layer's rotary and KV store in one launch (bm.runtime.attention.rotate_and_store): the
        rotated queries ``[T, heads, d]``, or None where the kernel does not take these tensors (another
        dtype than the full-width cache's, autograd) and the layer rotates and stores as usual. This
        backend's attention reads keys from the cache only, so the rotated keys need no other home (and
        a quantized cache's keys are read as every later step reads them)."""
        cache = self.kv_caches[layer]
        if self._rotary is None:
            self._rotary = TritonElementwise(self.device.type)
        if (cache.dtype != query.dtype and not is_quantized(cache)) or not self._rotary.accepts(
            query, key, value, cos, sin
        ):
            return None
        slots = metadata.for_layer(layer).slot_mapping
        return self._rotary.rotary_store_kv(query, key, value, cos, sin, cache, slots, self.kv_scales[layer])

    def attend(self, metadata: TritonMetadata, call: LayerCall) -> torch.Tensor:
        """One paged attention launch for the whole batch (two for a split-KV decode step); keys are read
        from the cache only."""
        query, extras = call.query, call.extras
        out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])
        paged_attention(
            out, query, self.kv_caches[call.layer], metadata.for_layer(call.layer), call.scaling,
            extras.softcap, extras.alibi, extras.sinks, sm_count=self.sm_count, scratch=self.split_scratch,
            kv_scales=self.kv_scales[call.layer],
        )  # fmt: skip
        return out

    def try_static_decode(
        self, items: Sequence[WorkItem], fill: InputFill | None = None
    ) -> torch.Tensor | None:
        if self.graphs is None or not self.graphs.serves(items):
            return None
        return self.graphs.run(items, fill)

    def static_decode_sizes(self, max_batch_size: int) -> tuple[int, ...]:
        if self.graphs is None:
            return ()
        top = bucket_for(max_batch_size) or BUCKETS[-1]
        return tuple(b for b in BUCKETS if b <= top)
