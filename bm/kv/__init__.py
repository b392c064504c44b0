"""The paged KV cache's bookkeeping: block ids, reference counts and block tables (no tensors, no torch)."""

from bm.kv.block_hash import BlockKey, chain_hash
from bm.kv.block_pool import BlockPool, IntegrityError, OutOfBlocksError
from bm.kv.manager import (
    NO_MATCH,
    KVCacheManager,
    KVRequest,
    PrefixMatch,
    PreparedResources,
    ResourcePlan,
    cdiv,
)
from bm.kv.tables import NO_BLOCK, RequestBlocks

__all__ = [
    "NO_BLOCK",
    "NO_MATCH",
    "BlockKey",
    "BlockPool",
    "IntegrityError",
    "KVCacheManager",
    "KVRequest",
    "OutOfBlocksError",
    "PrefixMatch",
    "PreparedResources",
    "RequestBlocks",
    "ResourcePlan",
    "cdiv",
    "chain_hash",
]
