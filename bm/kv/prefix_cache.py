"""Block reuse: which cached blocks a starting request can take, and registering the full blocks a running
request has computed so that later ones can. Pure Python.

A full block's identity is its content chain (:mod:`bm.kv.block_hash`). The hash table itself lives in
the :class:`BlockPool`, because eviction is the pool's decision and must drop a block's registration with
it; this class walks a request's tokens block by block against that table, and keeps each request's
registered chain (``RequestBlocks.chain``) so that registration resumes where it stopped. The manager
holds one only when block reuse is on, so a run without reuse never reaches this code.
"""

from __future__ import annotations

from collections.abc import Mapping

from bm.kv.block_hash import ROOT_HASH, BlockKey, chain_hash
from bm.kv.block_pool import BlockPool, require
from bm.kv.tables import NO_BLOCK, RequestBlocks
from bm.kv.types import (
    NO_MATCH,
    KVRequest,
    PrefixMatch,
    beam_width_of,
    block_extra_keys_of,
    takes_cached_prefix,
)


class PrefixCache:
    """Prefix matching, taking a match, and registering computed blocks, over one pool; with the run's
    counts of blocks taken from the cache and blocks that had to be computed."""

    def __init__(self, pool: BlockPool, tokens_per_block: int) -> None:
        self.pool = pool
        self.tokens_per_block = tokens_per_block
        self.num_reused_blocks = 0
        self.num_missed_blocks = 0

    def find(self, request: KVRequest, released: Mapping[int, int]) -> PrefixMatch:
        """The longest verified chain of cached blocks matching the request's tokens; takes nothing.

        At most ``num_tokens - 1`` tokens match, so a request whose whole context is cached still
        computes its last token (the one whose logits are sampled). ``released``: references that
        requests the same plan frees first hold on each block, which then count as cached, not held.
        Beam requests match nothing: their beams fork the table (see the README); nor does a request
        that computes its whole prompt (:func:`~bm.kv.types.takes_cached_prefix`).
        """
        if not takes_cached_prefix(request):
            return NO_MATCH
        bs = self.tokens_per_block
        extra = block_extra_keys_of(request)
        block_ids: list[int] = []
        keys: list[BlockKey] = []
        num_cached = 0
        parent_hash, parent_serial = ROOT_HASH, -1
        for i in range((request.num_tokens - 1) // bs):
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            found = self.pool.lookup(chain_hash(parent_hash, tokens, extra))
            if found is None or not found[1].matches(tokens, extra, parent_serial):
                break
            block_id, key = found
            block_ids.append(block_id)
            keys.append(key)
            num_cached += self.pool.ref_count(block_id) == released.get(block_id, 0)
            parent_hash, parent_serial = key.block_hash, key.serial
        missed = -(-request.num_tokens // bs) - len(block_ids)
        return PrefixMatch(tuple(block_ids), tuple(keys), len(block_ids) * bs, num_cached, missed)

    def take(self, match: PrefixMatch) -> RequestBlocks:
        """A new request's tables, starting with the matched blocks (taken by reference) and their chain.

        ``match`` must come from :meth:`find` with no allocation in between: a block evicted since would
        hold someone else's keys, so each is checked to be the registration it was matched as.
        """
        for block_id, key in zip(match.block_ids, match.keys, strict=True):
            require(self.pool.key(block_id) is key, f"block {block_id} changed since it was matched")
            self.pool.share_cached(block_id)
        blocks = RequestBlocks()
        blocks.tables[0] = list(match.block_ids)
        blocks.num_tokens[0] = match.num_tokens
        blocks.chain = list(match.keys)
        self.num_reused_blocks += match.num_blocks
        self.num_missed_blocks += match.num_missed_blocks
        return blocks

    def register_computed(self, request: KVRequest, blocks: RequestBlocks, num_computed_tokens: int) -> int:
        """Register the request's newly full, computed blocks for reuse; returns how many were added.

        A block still being filled is never registered, so it is never shared. Beam requests never
        register (their tables fork and copy on write).
        """
        if len(blocks.tables) > 1 or beam_width_of(request) > 1:
            return 0
        table, chain = blocks.tables[0], blocks.chain
        bs = self.tokens_per_block
        extra = block_extra_keys_of(request)
        added = 0
        for i in range(len(chain), min(num_computed_tokens // bs, len(table))):
            parent = chain[-1] if chain else None
            if (chain and parent is None) or table[i] == NO_BLOCK:
                break  # the chain was broken by a hash collision, or the block is already gone
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            parent_hash = parent.block_hash if parent else ROOT_HASH
            parent_serial = parent.serial if parent else -1
            key = self.pool.register(
                table[i], chain_hash(parent_hash, tokens, extra), tokens, extra, parent_serial
            )
            chain.append(key)
            added += key is not None
        return added

    def check_integrity(self, requests: Mapping[int, RequestBlocks]) -> None:
        """Each request's chain is a linked prefix of its table: beams have none, it covers no more blocks
        than the table, each key's parent is the key before it (a collision's None ends it), and each of
        its blocks still held is that registration or a private duplicate of it (never another's)."""
        for request_id, blocks in requests.items():
            chain = blocks.chain
            if not chain:
                continue
            table = blocks.tables[0]
            require(len(blocks.tables) == 1, f"request {request_id}: a chain of registered blocks on beams")
            require(
                len(chain) <= len(table),
                f"request {request_id}: {len(chain)} registered blocks in a table of {len(table)}",
            )
            parent_serial = -1
            for i, key in enumerate(chain):
                if key is None:
                    require(i == len(chain) - 1, f"request {request_id}: its chain goes on past a collision")
                    break
                require(
                    key.parent_serial == parent_serial,
                    f"request {request_id}: block {i} of its chain does not follow the block before it",
                )
                parent_serial = key.serial
                block_id = table[i]
                if block_id != NO_BLOCK:
                    registered = self.pool.key(block_id)
                    require(
                        registered is None or registered is key,
                        f"request {request_id}: block {block_id} is registered as other contents than "
                        "its chain says",
                    )
