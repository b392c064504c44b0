"""Reuse-aware admission: hold a new request back while another computes the prefix it could reuse.

TensorRT-LLM's "beneficial to skip". With block reuse on, a request's first full block that is not in
the cache yet identifies the prefix it would compute itself. When a context running this iteration (an
unfinished chunked context, or one the policy admitted just before) is computing that same block, the
request waits one iteration and then takes those blocks from the cache instead of computing them twice.
Only the key is computed here, from the cache's public lookups; nothing is taken or changed.
"""

from __future__ import annotations

from collections.abc import Iterable

from bm.kv import KVCacheManager, chain_hash
from bm.kv.block_hash import ROOT_HASH
from bm.kv.types import takes_cached_prefix
from bm.scheduling.request import LlmRequest


def first_new_block(kv: KVCacheManager, request: LlmRequest) -> tuple[int, int] | None:
    """``(index, chain hash)`` of the request's first full block not in the cache; None when all are.

    Every full block of the known tokens counts (the last token included), as in TRT-LLM, so a request
    whose whole prompt is cached in full blocks contributes nothing new. Beam requests, and requests
    that compute their whole prompt, never reuse.
    """
    if not kv.enable_block_reuse or not takes_cached_prefix(request):
        return None
    bs = kv.tokens_per_block
    extra = kv.block_extra_keys(request)
    parent_hash, parent_serial = ROOT_HASH, -1
    for i in range(request.num_tokens // bs):
        tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
        block_hash = chain_hash(parent_hash, tokens, extra)
        found = kv.pool.lookup(block_hash)
        if found is None or not found[1].matches(tokens, extra, parent_serial):
            return i, block_hash
        parent_hash, parent_serial = found[1].block_hash, found[1].serial
    return None


class ContributedBlocks:
    """The first new blocks of the contexts that run this iteration, as they are decided."""

    def __init__(self, kv: KVCacheManager, running_contexts: Iterable[LlmRequest] = ()) -> None:
        self.kv = kv
        self._keys: set[tuple[int, int]] = set()
        for request in running_contexts:
            self.beneficial_to_skip(request)

    def beneficial_to_skip(self, request: LlmRequest) -> bool:
        """True when an earlier context computes this request's first new block now; else it is
        recorded as this request's contribution (whether or not the request then fits)."""
        key = first_new_block(self.kv, request)
        if key is None:
            return False
        if key in self._keys:
            return True
        self._keys.add(key)
        return False
