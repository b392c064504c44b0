"""How many KV blocks to allocate: ``max_tokens`` and/or ``free_memory_fraction``, the smaller wins."""

from __future__ import annotations

from bm.config import KvCacheConfig
from bm.runtime.model_loader import LoadedModel, available_memory_bytes


class KVCacheSizeError(ValueError):
    pass


def num_kv_blocks(
    loaded: LoadedModel,
    kv: KvCacheConfig,
    max_useful_tokens: int | None = None,
    free_bytes: int | None = None,
) -> int:
    """Blocks for the pool, measured against the memory free after the model has loaded.

    ``max_useful_tokens`` (every admissible request at its longest) caps the pool: on a CPU, 90% of RAM
    for a small model would be blocks no schedule can ever fill, and bookkeeping for nothing.
    """
    bytes_per_block = loaded.kv_cache_bytes_per_token(kv.dtype) * kv.tokens_per_block
    if free_bytes is None:
        free_bytes = available_memory_bytes(loaded.device)
    by_memory = int(free_bytes * kv.free_memory_fraction) // bytes_per_block
    blocks = by_memory
    if kv.max_tokens is not None:
        blocks = min(blocks, kv.max_tokens // kv.tokens_per_block)
    if max_useful_tokens is not None and blocks > 0:
        blocks = min(blocks, max(1, -(-max_useful_tokens // kv.tokens_per_block)))
    if blocks < 1:
        raise KVCacheSizeError(
            f"the KV cache would hold no block: {free_bytes / 2**20:.0f} MiB free x free_memory_fraction "
            f"{kv.free_memory_fraction} is less than one block of {bytes_per_block} bytes; "
            "raise kv_cache.free_memory_fraction or free some memory"
        )
    return blocks
