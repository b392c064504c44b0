"""The paged KV cache's bookkeeping: block ids, reference counts and block tables (no tensors, no torch)."""

from bm.kv.block_hash import BlockKey, chain_hash
from bm.kv.block_pool import BlockPool, IntegrityError, OutOfBlocksError
from bm.kv.manager import KVCacheManager
from bm.kv.tables import NO_BLOCK, RequestBlocks
from bm.kv.types import (
    NO_MATCH,
    KVRequest,
    PrefixMatch,
    PreparedResources,
    ResourcePlan,
    ResourceUpdate,
    cdiv,
)
from bm.kv.window_groups import WindowedTables, WindowGroup

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
    "ResourceUpdate",
    "WindowGroup",
    "WindowedTables",
    "cdiv",
    "chain_hash",
]
