"""The torch backend: bm's C kernels where they apply (the CPU in float32), gather + SDPA elsewhere.

Decode rows (and a verifying step's K + 1 queries) go to ``native/paged_decode.c``, which reads each
request's blocks in place; prefill runs to ``native/prefill_attention.c`` where it computes exactly their
attention; new keys and values are written by the compiled KV write. Without the kernels (no compiler,
another dtype or device, ``BM_NATIVE_KERNELS=0``), or for what they do not do (a query past a window
with sink tokens, windowed prefill masks), decode rows are grouped by context length with their blocks
gathered, and everything is attended with SDPA. Both give the same outputs up to float rounding; on
the CPU in float32 a row's bits never depend on the rest of the batch (tests/test_batch_invariance.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bm.engine.execution.protocol import WorkItem
from bm.kv import cdiv
from bm.runtime.attention import LayerCall
from bm.runtime.backends.base import AttentionBackend, BackendSetup, ForwardInputs, PerLayer, kept_rows
from bm.runtime.backends.torch_layout import (
    DECODE_GROUP_TOKENS,
    DecodeRow,
    PrefillRun,
    WindowLayout,
    WindowMetadata,
    add_rows,
    rows_in_pool,
)
from bm.runtime.backends.torch_ops import decode, prefill
from bm.runtime.kv_quant import (
    as_bytes,
    cache_format,
    dequantize_rows,
    is_quantized,
    quantize_rows,
)
from bm.runtime.model_loader import LoadedModel
from bm.runtime.native import PagedDecodeKernel, paged_decode_kernel

TorchMetadata = PerLayer[WindowMetadata]


class TorchBackend(AttentionBackend[TorchMetadata]):
    """Attention with bm's C kernels and torch ops; serves every model on every device."""

    name = "torch"

    @classmethod
    def serves(cls, loaded: LoadedModel) -> bool:
        return True

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        loaded, bs = setup.loaded, setup.tokens_per_block
        self.kv_dtype = loaded.kv_dtype  # what attention computes in (a quantized cache's rows widen to it)
        # keys and values of the largest decode group, gathered side by side
        widest = max(heads * dim for heads, dim in loaded.kv_shapes.values())
        group_tokens = max(DECODE_GROUP_TOKENS, cdiv(setup.max_seq_len, bs) * bs)
        with torch.inference_mode():
            self.scratch = torch.empty(2 * widest * group_tokens, dtype=loaded.kv_dtype, device=self.device)
        # Decode attention reading blocks in place, where the compiled kernel exists and fits the cache;
        # otherwise (and with attention sinks) the gather-then-SDPA groups. bm's C kernels serve CPU caches
        # only: on a GPU they are not even built (a compile per machine).
        kernel = paged_decode_kernel() if self.device.type == "cpu" else None
        caches = [c for c in self.kv_caches if c is not None]
        supported = kernel is not None and all(kernel.supports(c) for c in caches)
        self.native_decode: PagedDecodeKernel | None = kernel if supported else None
        # one layout per distinct window, the first attention layer's first
        self.layouts = {
            w: WindowLayout(w, self.plan.sinks(w), bs, self.device, loaded.kv_dtype, self.native_decode)
            for w in dict.fromkeys(self.plan.windows.values())
        }

    def prepare(self, items: Sequence[WorkItem]) -> ForwardInputs[TorchMetadata]:
        bs = self.tokens_per_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        prefill_runs: list[PrefillRun] = []
        decode_rows: list[DecodeRow] = []
        offset = 0
        for item in items:
            n = len(item.token_ids)
            ids.extend(item.token_ids)
            if n == 1:
                positions.append(item.start_pos)
            else:
                positions.extend(range(item.start_pos, item.start_pos + n))
            add_rows(item, offset, item.block_ids, bs, slots, prefill_runs, decode_rows)
            sample_index.extend(kept_rows(item, offset))
            offset += n

        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        pooled = self.plan.pooled
        by_window = {
            w: layout.metadata(slot_mapping, prefill_runs, decode_rows)
            for w, layout in self.layouts.items()
            if w not in pooled
        }
        for w in pooled:  # layers with a pool of their own read and write their own tables
            own_slots, own_prefill, own_decode = rows_in_pool(items, w, bs)
            own_mapping = torch.tensor(own_slots, dtype=torch.long, device=dev)
            by_window[w] = self.layouts[w].metadata(own_mapping, own_prefill, own_decode)
        return ForwardInputs(
            torch.tensor([ids], dtype=torch.long, device=dev),
            torch.tensor([positions], dtype=torch.long, device=dev),
            torch.tensor(sample_index, dtype=torch.long, device=dev),
            PerLayer.by_window(self.plan, by_window),
        )

    def forward_layer(self, metadata: TorchMetadata, call: LayerCall) -> torch.Tensor:
        """Store and attend in the KV dtype: a bfloat16 model's cache on the CPU is bfloat16 where the
        AVX-512 attention kernels read it, else float32 (LoadedModel.kv_dtype); where it differs from
        the model's, the call's tensors are converted once here, for both. A quantized cache
        (``kv_cache.dtype: int8 | fp8_e4m3``) stores each row quantized, and the layer then attends the
        call's own keys and values as the cache gives them back too, so a token's attention reads the
        same values whether its keys came from this chunk or from the cache (results do not depend on
        chunking)."""
        dtype = self.kv_dtype
        if dtype != call.query.dtype:
            call.query, call.key, call.value = call.query.to(dtype), call.key.to(dtype), call.value.to(dtype)
        cache = self.kv_caches[call.layer]
        if is_quantized(cache):
            form, (k_scale, v_scale) = cache_format(cache), self.kv_scales[call.layer]
            keys, values = quantize_rows(call.key, form, k_scale), quantize_rows(call.value, form, v_scale)
            _copy_rows(cache, metadata.for_layer(call.layer).slot_mapping, keys, values)
            call.key, call.value = (
                dequantize_rows(keys, dtype, k_scale),
                dequantize_rows(values, dtype, v_scale),
            )
        else:
            self.store_kv(metadata, call.layer, call.key, call.value)
        return self.attend(metadata, call)

    def store_kv(self, metadata: TorchMetadata, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """By slot mapping: the compiled KV write where it takes the tensors (the same copy as
        ``index_copy_``, several times faster on the strided rows the projections leave), else torch's."""
        cache = self.kv_caches[layer]
        slots = metadata.for_layer(layer).slot_mapping
        if self.native_decode is None or not self.native_decode.write_kv(cache, slots, key, value):
            _copy_rows(cache, slots, key, value)

    def attend(self, metadata: TorchMetadata, call: LayerCall) -> torch.Tensor:
        meta = metadata.for_layer(call.layer)
        cache = self.kv_caches[call.layer]
        query, scaling, extras = call.query, call.scaling, call.extras
        scales = self.kv_scales[call.layer]
        num_heads, num_tokens, head_dim = query.shape
        out = query.new_empty(num_tokens, num_heads, head_dim)
        for seg in meta.prefill:
            prefill(out, call, cache, seg, scales)
        for group in meta.decode_groups:
            decode(out, query, cache, group, scaling, self.scratch, extras, scales)
        if meta.native_decode is not None:
            self.native_decode(out, query, cache, meta.native_decode, scaling, extras, scales)
        return out


def _copy_rows(cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Rows ``key`` and ``value`` [kv_heads, T, width] into ``cache``'s flat slots ``slots`` [T] (fp8
    rows as their bytes: torch copies no float8 by index on the CPU)."""
    kv_heads, num_blocks, block_size, width = cache.shape[1:]
    flat = as_bytes(cache).view(2, kv_heads, num_blocks * block_size, width)
    flat[0].index_copy_(1, slots, as_bytes(key))
    flat[1].index_copy_(1, slots, as_bytes(value))
