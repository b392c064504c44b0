"""The paged KV cache's bookkeeping: block ids, reference counts and block tables (no tensors, no torch)."""

from bm.kv.block_pool import BlockPool, IntegrityError, OutOfBlocksError
from bm.kv.manager import KVCacheManager, KVRequest, beam_key, cdiv

__all__ = [
    "BlockPool",
    "IntegrityError",
    "KVCacheManager",
    "KVRequest",
    "OutOfBlocksError",
    "beam_key",
    "cdiv",
]
