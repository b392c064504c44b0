"""Identity of a full KV block's contents, for block reuse. Pure Python.

A block's keys and values depend on its own tokens and on every token before it, so its identity is a
chain: the parent block's hash plus this block's token ids (plus extra keys, such as a LoRA task id, that
change the values computed for the same tokens). The hash only finds a candidate quickly; a hit is
accepted only when the stored tokens, extra keys and parent registration all match (see
:meth:`BlockKey.matches`), so a hash collision can never hand a request someone else's keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The parent "hash" of a sequence's first block.
ROOT_HASH = 0


def chain_hash(parent_hash: int, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Hash of a block given its parent's hash; deterministic across runs (ints and tuples only)."""
    return hash((parent_hash, tuple(token_ids), extra_keys))


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What a cached block holds, as registered in the pool's hash table.

    ``serial`` is unique per registration and never reused, and ``parent_serial`` names the registration
    of the block before it (-1 for a first block). Walking a prompt from its first block and requiring
    each hit's ``parent_serial`` to equal the previous hit's ``serial`` proves the whole prefix equal,
    token for token, without trusting any hash.
    """

    block_hash: int
    parent_serial: int
    token_ids: tuple[int, ...]
    extra_keys: tuple
    serial: int

    def matches(self, token_ids: tuple[int, ...], extra_keys: tuple, parent_serial: int) -> bool:
        return (
            self.parent_serial == parent_serial
            and self.token_ids == token_ids
            and self.extra_keys == extra_keys
        )
