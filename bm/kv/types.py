"""The values the KV cache manager trades in: what it needs of a request, prefix matches, and the
per-iteration resource plan it applies. Kept apart so schedulers and the core can name them without the
manager's bookkeeping. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from bm.kv.block_hash import BlockKey


class KVRequest(Protocol):
    """Every field the KV manager and its helpers read of a request (the scheduler's ``LlmRequest``
    satisfies it); nothing in ``bm.kv`` reads a request field this protocol does not name.

    The first five members are required. The last five describe tables shared between beams or samples,
    keys beside the tokens and requests that compute their whole prompt; they are optional, so that a bare sequence (a test's, a tool's) can drive
    the manager: a request type without one reads as its default, and only through the readers below
    (:func:`beam_width_of`, :func:`sharing_of`, :func:`block_extra_keys_of`), the one place the defaults
    are written.
    """

    @property
    def request_id(self) -> int: ...

    @property
    def num_tokens_at_completion(self) -> int:
        """Prompt plus the most tokens it may still generate: the cache footprint at its end."""
        ...

    @property
    def num_tokens(self) -> int:
        """Prompt plus the tokens generated so far (what a context phase computes)."""
        ...

    @property
    def is_generation_phase(self) -> bool: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...

    @property
    def beam_width(self) -> int:
        """Optional, default 1. Beams fork the request's table, so it reserves a full table per beam,
        never takes or registers cached blocks, and keeps the blocks behind an attention window."""
        ...

    @property
    def num_pending_samples(self) -> int:
        """Optional, default 0. n samples: siblings still to fork from this request once its prompt is
        computed; each will need a table of its own (see :class:`bm.kv.shared_tables.SharedTables`)."""
        ...

    @property
    def shares_blocks(self) -> bool:
        """Optional, default False. The table shares blocks with sample siblings, so a write may copy a
        shared block first."""
        ...

    @property
    def block_extra_keys(self) -> tuple:
        """Optional, default ``()``. What changes a block's keys and values beside its tokens (a prompt
        table's digest, a LoRA task id): blocks are shared by reuse only when these are equal too."""
        ...

    @property
    def computes_prompt(self) -> bool:
        """Optional, default False. Every prompt position must be computed (its context logits were
        asked for), so it takes no cached prefix; its blocks are still registered for others."""
        ...


def beam_width_of(request: KVRequest) -> int:
    """``request.beam_width``, 1 for a request type without beams."""
    return getattr(request, "beam_width", 1)


def sharing_of(request: KVRequest) -> tuple[int, int, bool]:
    """``(beam_width, num_pending_samples, shares_blocks)``, each at its default (1, 0, False) for a
    request type without it: read at once, because the capacity policies ask how many tables every
    running request may hold on every iteration."""
    return (
        getattr(request, "beam_width", 1),
        getattr(request, "num_pending_samples", 0),
        getattr(request, "shares_blocks", False),
    )


def takes_cached_prefix(request: KVRequest) -> bool:
    """Whether the request may take cached blocks: not a beam request (beams fork the table) nor one
    whose every prompt position must be computed (context logits: a cached position has none)."""
    return beam_width_of(request) == 1 and not getattr(request, "computes_prompt", False)


def block_extra_keys_of(request: KVRequest) -> tuple:
    """``request.block_extra_keys`` as a tuple, ``()`` for a request type without extra keys."""
    return tuple(getattr(request, "block_extra_keys", ()))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks a request starting now could take, in order from its first block."""

    block_ids: tuple[int, ...] = ()
    keys: tuple[BlockKey, ...] = ()
    num_tokens: int = 0
    # Of the matched blocks, those unreferenced now: taking them uses up reclaimable space.
    num_cached: int = 0
    # Blocks of the request's context that were looked up and had to be computed.
    num_missed_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def cost(self, num_blocks_needed: int) -> int:
        """Free-pool blocks a request needing ``num_blocks_needed`` blocks uses up when it takes this match."""
        return max(0, num_blocks_needed - self.num_blocks) + self.num_cached


NO_MATCH = PrefixMatch()


@dataclass
class ResourcePlan:
    """What one iteration needs of the cache, in the order :meth:`KVCacheManager.prepare_resources` applies
    it: paused requests give everything back, starting requests take their cached prefix, then tables grow.
    """

    release: list[int] = field(default_factory=list)
    starts: list[tuple[KVRequest, PrefixMatch]] = field(default_factory=list)
    grow: list[tuple[int, int]] = field(default_factory=list)  # (request id, tokens each table holds)
    pad: list[tuple[int, int]] = field(default_factory=list)  # V1: (request id, pad tokens held)


@dataclass
class ResourceUpdate:
    """What one iteration's results change in the cache, in the order
    :meth:`KVCacheManager.update_resources` applies it: tables roll back past rejected drafts, newly
    computed blocks are registered for reuse and blocks behind the attention window go back, then beam
    tables fork. The scheduler's plan grows tables; this follows what the executor computed."""

    trim: list[tuple[int, int]] = field(default_factory=list)  # (request id, tokens each table keeps)
    computed: list[tuple[KVRequest, int]] = field(default_factory=list)  # (request, tokens computed)
    forks: list[tuple[int, list[int]]] = field(default_factory=list)  # (request id, parent beam of each)
    # n samples: (request id, its new siblings' ids, tokens each sibling's table starts with)
    samples: list[tuple[int, list[int], int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.trim or self.computed or self.forks or self.samples)


@dataclass
class PreparedResources:
    """What :meth:`KVCacheManager.prepare_resources` did that the caller must know."""

    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks to copy
    reused_tokens: dict[int, int] = field(default_factory=dict)  # request id -> tokens taken from cache
