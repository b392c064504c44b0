"""Per-request block tables over a :class:`BlockPool`. Pure Python.

The manager is the only place that knows how many blocks a request needs, now and at completion, so the
capacity policies above it never do block arithmetic of their own. It returns plain lists of block ids;
the runtime turns them into slot mappings and block-table tensors.

Two optional behaviours live here too:

- block reuse: full blocks are registered by their content chain once computed, stay cached after their
  request frees them, and a new request whose prefix matches takes them by reference
  (:meth:`KVCacheManager.find_cached_prefix` then :meth:`KVCacheManager.take_cached_prefix`);
- an attention window: blocks wholly older than the window (and not holding sink tokens) are released
  while the request runs, and appear in its table as :data:`NO_BLOCK`, so positions still index it.
  Layers with a narrower window than the main table's may keep tables of their own over pools of their
  own (:mod:`bm.kv.window_groups`), grown, released, rolled back and freed with the main table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bm.kv.block_hash import ROOT_HASH, BlockKey, chain_hash
from bm.kv.block_pool import BlockPool, IntegrityError, require
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


class KVCacheManager:
    """Block tables for active requests; allocation grows a table, completion frees it."""

    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        *,
        enable_block_reuse: bool = False,
        max_attention_window: int | None = None,
        sink_token_length: int = 0,
        num_layers: int = 1,
        window_groups: Sequence[WindowGroup] = (),
        window_sink_token_length: int = 0,
    ) -> None:
        """``num_layers``: the layers the main table serves (stats count blocks per layer with it).
        ``window_groups``: narrower windows whose layers keep tables of their own, over pools of their own
        (with sinks of ``window_sink_token_length`` tokens); they are for single-table requests without
        reuse, so block reuse is refused beside them."""
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if max_attention_window is not None and max_attention_window < 1:
            raise ValueError(f"max_attention_window must be >= 1, got {max_attention_window}")
        self.tokens_per_block = tokens_per_block
        self.pool = BlockPool(num_blocks)
        self.enable_block_reuse = enable_block_reuse
        self.max_attention_window = max_attention_window
        self.sink_token_length = sink_token_length if max_attention_window is not None else 0
        self._requests: dict[int, RequestBlocks] = {}
        self.num_reused_blocks = 0
        self.num_missed_blocks = 0
        self.num_layers = num_layers
        if window_groups and enable_block_reuse:
            raise ValueError(
                "windowed pools keep no prefix cache: block reuse needs one table for all layers"
            )
        self.window_tables = [
            WindowedTables(group, tokens_per_block, window_sink_token_length) for group in window_groups
        ]

    # -- capacity questions (what the schedulers ask) --------------------------------------------------

    def get_max_resource_count(self) -> int:
        """Total blocks in the pool: the budget a capacity policy divides among requests."""
        return self.pool.num_blocks

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take now: empty ones and cached ones it may reclaim."""
        return self.pool.num_free_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.tokens_per_block)

    def max_window_blocks(self) -> int | None:
        """Most blocks a generating request holds under the attention window (None: no window).

        The window's tokens can straddle one more block than they fill, and sink blocks stay.
        """
        if self.max_attention_window is None:
            return None
        bs = self.tokens_per_block
        return cdiv(self.sink_token_length, bs) + cdiv(self.max_attention_window, bs) + 1

    def get_needed_resource_to_completion(self, request: KVRequest) -> int:
        """Most blocks the request holds at once from now to its end.

        Without a window that is every block of its final length. With one, a context phase still holds
        its whole context at once at worst (the blocks behind the window are released after each
        forward), and a generation holds at most the window's blocks. A beam request counts a full table
        per beam and no window release (beams fork their tables, see :meth:`fork_beams`): an upper bound,
        so a request admitted on it never runs short.
        """
        full = self.num_blocks_for_tokens(request.num_tokens_at_completion)
        beams = getattr(request, "beam_width", 1)
        if beams > 1:
            return full * beams
        samples = 1 + getattr(request, "num_pending_samples", 0)
        if samples > 1 or getattr(request, "shares_blocks", False):
            # n samples: every sample's full table, each with one copy of a shared block (see
            # fork_samples); counted before the fork for all of them, after it by each sibling
            return (full + 1) * samples
        bound = self.max_window_blocks()
        if bound is None:
            return full
        if not request.is_generation_phase:
            bound = max(bound, self.num_blocks_for_tokens(request.num_tokens))
        return min(full, bound)

    def get_remaining_resource_to_completion(self, request: KVRequest) -> int:
        """Blocks still to allocate before the request completes."""
        held = len(self._distinct_blocks(request.request_id))
        return max(0, self.get_needed_resource_to_completion(request) - held)

    def get_reserved_resource(self, requests: Iterable[KVRequest]) -> int:
        """Blocks that started ``requests`` hold (a shared block once) plus all they may still allocate.

        What a no-evict policy must keep back for them; the rest of the pool (cached blocks included,
        which are reclaimable) is open to new requests. A no-evict policy asks this every iteration, so
        the common cases are counted without building sets: a single table with no released blocks
        holds ``len(table)`` distinct blocks; without block reuse no block is shared between requests;
        with it, when ``requests`` are every holder, the blocks they hold are the pool's used blocks.
        """
        requests = list(requests)
        plain = self.max_attention_window is None
        counts: list[int] = []
        remaining = 0
        for request in requests:
            blocks = self._requests.get(request.request_id)
            if blocks is None:
                own = 0
            elif plain and blocks.num_beams == 1 and not blocks.padding:
                own = len(blocks.tables[0])
            else:
                own = len(blocks.distinct_blocks())
            counts.append(own)
            remaining += max(0, self.get_needed_resource_to_completion(request) - own)
        if not self.enable_block_reuse:
            return sum(counts) + remaining
        holders = sum(1 for r in requests if r.request_id in self._requests)
        if holders == len(self._requests):
            return self.pool.num_used_blocks + remaining
        held: set[int] = set()
        for request in requests:
            held |= self._distinct_blocks(request.request_id)
        return len(held) + remaining

    def num_blocks_to_allocate(self, request_id: int, num_tokens: int) -> int:
        """Blocks :meth:`allocate` would take for the request to hold ``num_tokens`` tokens in total.

        For a request with beams: over every beam, plus a copy for each beam whose block at the next
        written position is shared (see :meth:`copy_on_write`).
        """
        blocks = self._requests.get(request_id)
        needed = self.num_blocks_for_tokens(num_tokens)
        if blocks is None or blocks.num_beams == 1:
            held = len(blocks.tables[0]) if blocks is not None else 0
            copy = blocks is not None and blocks.family is not None and self._shared_tail(blocks) is not None
            return max(0, needed - held) + copy
        total = 0
        index = (num_tokens - 1) // self.tokens_per_block
        writers: dict[int, int] = {}  # block written at the next position -> beams writing into it
        for table in blocks.tables:
            total += max(0, needed - len(table))
            if index < len(table):
                writers[table[index]] = writers.get(table[index], 0) + 1
        # every writer of a shared block copies it, except the last when no one else holds it
        for block_id, count in writers.items():
            total += count - (self.pool.ref_count(block_id) == count)
        return total

    def num_blocks_freed_by(self, request_ids: Iterable[int]) -> int:
        """Blocks that freeing all of ``request_ids`` would return to the pool (free or cached): those no
        other request references."""
        refs = self._references(request_ids)
        return sum(1 for b, n in refs.items() if self.pool.ref_count(b) == n)

    def num_freeable_blocks(self, request_id: int) -> int:
        """Blocks that :meth:`free` would return to the pool (those no other request references)."""
        return self.num_blocks_freed_by((request_id,))

    def can_allocate(self, request_id: int, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_blocks_to_allocate(request_id, num_tokens))

    # -- the resource-manager steps -------------------------------------------------------------------

    def prepare_resources(self, plan: ResourcePlan) -> PreparedResources:
        """Apply one iteration's plan: with :meth:`update_resources` and :meth:`free`, the only place
        blocks change hands (drafts grow tables through a plan of their own, after the scheduler's).

        Order matters: paused requests give their blocks back first (their registered blocks become
        cached, so a request starting now can take them), every starting request then takes its cached
        prefix before any allocation could evict it, and tables grow last. Raises
        :class:`OutOfBlocksError` when the plan asks for more than the pool holds (a scheduler bug).
        """
        prepared = PreparedResources()
        for request_id in plan.release:
            self.free(request_id)
        for request, match in plan.starts:
            prepared.reused_tokens[request.request_id] = self.take_cached_prefix(request, match)
        for request_id, num_tokens in plan.grow:
            blocks = self._requests.get(request_id)
            if blocks is not None and blocks.num_beams > 1:
                for beam in range(blocks.num_beams):
                    copy = self.copy_on_write(request_id, beam, num_tokens - 1)
                    if copy is not None:
                        prepared.copies.append(copy)
                    self.allocate(request_id, num_tokens, beam)
            else:
                if blocks is not None and blocks.family is not None:
                    copy = self._copy_shared_tail(request_id, blocks)
                    if copy is not None:
                        prepared.copies.append(copy)
                self.allocate(request_id, num_tokens)
        for request_id, num_tokens in plan.pad:
            self.allocate_padding(request_id, num_tokens)
        return prepared

    def update_resources(self, update: ResourceUpdate) -> None:
        """Apply what an iteration computed (TensorRT-LLM's ``update_resources``): roll tables back past
        rejected drafts, register newly full blocks and release those behind the window, then fork beam
        tables. Kept in that order so block ids, reuse and eviction match step by step."""
        for request_id, num_tokens in update.trim:
            self.trim(request_id, num_tokens)
        for request, num_computed in update.computed:
            self.cache_computed_blocks(request, num_computed)
            self.release_outside_window(request.request_id, num_computed)
        for request_id, parents in update.forks:
            self.fork_beams(request_id, parents)
        for request_id, sibling_ids, num_tokens in update.samples:
            self.fork_samples(request_id, sibling_ids, num_tokens)

    def allocate(self, request_id: int, num_tokens: int, beam: int = 0) -> list[int]:
        """Grow one table of the request to hold ``num_tokens`` tokens (a context chunk, or one more token).

        Returns the full block table. Raises :class:`OutOfBlocksError` when the pool is short; the
        capacity scheduler is expected to have checked.
        """
        blocks = self._requests.get(request_id)
        if blocks is None:
            blocks = self._requests[request_id] = RequestBlocks()
        table = blocks.tables[beam]
        missing = self.num_blocks_for_tokens(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        blocks.num_tokens[beam] = max(num_tokens, blocks.num_tokens[beam])
        for windowed in self.window_tables:
            require(blocks.num_beams == 1, f"request {request_id}: beams cannot use windowed pools")
            windowed.grow(request_id, num_tokens)
        return table

    def append(self, request_id: int, num_new_tokens: int = 1) -> list[int]:
        """Room for generated tokens: the same growth as :meth:`allocate`, counted from the current size."""
        return self.allocate(request_id, self.num_tokens(request_id) + num_new_tokens)

    def trim(self, request_id: int, num_tokens: int) -> int:
        """Roll a single-table request back to ``num_tokens`` tokens: the blocks past them (written by
        rejected draft tokens, never registered for reuse) go back to the pool. Returns how many."""
        blocks = self._requests.get(request_id)
        if blocks is None or blocks.num_beams > 1:
            return 0
        table = blocks.tables[0]
        keep = self.num_blocks_for_tokens(num_tokens)
        extra = [b for b in reversed(table[keep:]) if b != NO_BLOCK]
        del table[keep:]
        self.pool.release(extra)
        blocks.num_tokens[0] = min(blocks.num_tokens[0], num_tokens)
        for windowed in self.window_tables:
            windowed.trim(request_id, num_tokens)
        return len(extra)

    def allocate_padding(self, request_id: int, num_tokens: int) -> list[int]:
        """V1: grow the request's pad-token table to hold ``num_tokens`` pad tokens."""
        blocks = self._requests.get(request_id)
        if blocks is None:
            blocks = self._requests[request_id] = RequestBlocks()
        missing = self.num_blocks_for_tokens(num_tokens) - len(blocks.padding)
        if missing > 0:
            blocks.padding.extend(self.pool.allocate(missing))
        blocks.num_padding_tokens = max(num_tokens, blocks.num_padding_tokens)
        return blocks.padding

    def free(self, request_id: int) -> int:
        """Release every block of the request (the resource manager's ``free_resources``); returns how
        many references it dropped. Unknown ids free nothing.

        Blocks go back tail first, so among a sequence's cached blocks the tail is evicted before the
        head, which more requests are likely to share.
        """
        blocks = self._requests.pop(request_id, None)
        if blocks is None:
            return 0
        for windowed in self.window_tables:
            windowed.free(request_id)
        freed = 0
        for table in [*blocks.tables[1:], blocks.padding, blocks.tables[0]]:
            live = [b for b in reversed(table) if b != NO_BLOCK]
            self.pool.release(live)
            freed += len(live)
        return freed

    # -- block reuse ----------------------------------------------------------------------------------

    def block_extra_keys(self, request: KVRequest) -> tuple:
        """Keys beside the tokens that change a block's values (a prompt table's digest, a LoRA task id)."""
        return tuple(getattr(request, "block_extra_keys", ()))

    def find_cached_prefix(self, request: KVRequest, releasing: Iterable[int] = ()) -> PrefixMatch:
        """The longest verified chain of cached blocks matching the request's tokens; takes nothing.

        At most ``num_tokens - 1`` tokens match, so a request whose whole context is cached still
        computes its last token (the one whose logits are sampled). ``releasing``: requests the same plan
        frees first (paused), whose blocks then count as cached rather than held.
        """
        if (
            not self.enable_block_reuse
            or request.request_id in self._requests
            or getattr(request, "beam_width", 1) > 1  # beams fork their tables: no reuse (see README)
        ):
            return NO_MATCH
        bs = self.tokens_per_block
        extra = self.block_extra_keys(request)
        released = self._references(releasing)
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
        missed = self.num_blocks_for_tokens(request.num_tokens) - len(block_ids)
        return PrefixMatch(tuple(block_ids), tuple(keys), len(block_ids) * bs, num_cached, missed)

    def take_cached_prefix(self, request: KVRequest, match: PrefixMatch) -> int:
        """Start the request's table with the matched blocks (by reference); returns the tokens reused.

        ``match`` must come from :meth:`find_cached_prefix` with no allocation in between.
        """
        if not self.enable_block_reuse:
            return 0
        rid = request.request_id
        require(rid not in self._requests, f"request {rid} already holds blocks; a prefix is taken at start")
        for block_id, key in zip(match.block_ids, match.keys, strict=True):
            require(self.pool.key(block_id) is key, f"block {block_id} changed since it was matched")
            self.pool.share_cached(block_id)
        blocks = self._requests[rid] = RequestBlocks()
        blocks.tables[0] = list(match.block_ids)
        blocks.num_tokens[0] = match.num_tokens
        blocks.chain = list(match.keys)
        self.num_reused_blocks += match.num_blocks
        self.num_missed_blocks += match.num_missed_blocks
        return match.num_tokens

    def cache_computed_blocks(self, request: KVRequest, num_computed_tokens: int) -> int:
        """Register the request's newly full, computed blocks for reuse; returns how many were added.

        A block still being filled is never registered, so it is never shared. Beam requests never
        register (their tables fork and copy on write).
        """
        blocks = self._requests.get(request.request_id)
        if not self.enable_block_reuse or blocks is None or blocks.num_beams > 1:
            return 0
        if getattr(request, "beam_width", 1) > 1:
            return 0
        table, chain = blocks.tables[0], blocks.chain
        bs = self.tokens_per_block
        extra = self.block_extra_keys(request)
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

    # -- attention window -----------------------------------------------------------------------------

    def release_outside_window(self, request_id: int, num_computed_tokens: int) -> int:
        """Release blocks no later query of the request attends; returns how many (of the main table).

        The next query sits at ``num_computed_tokens`` and sees the keys after ``position - window``;
        later queries see less. Blocks holding sink tokens stay. Beam requests keep every block. Each
        windowed pool's table releases behind its own window.
        """
        for windowed in self.window_tables:
            windowed.release_outside_window(request_id, num_computed_tokens)
        window = self.max_attention_window
        blocks = self._requests.get(request_id)
        if window is None or blocks is None or blocks.num_beams > 1 or not blocks.tables[0]:
            return 0
        table = blocks.tables[0]
        bs = self.tokens_per_block
        first_sink_free = cdiv(self.sink_token_length, bs)
        start = max(first_sink_free, blocks.num_released)
        end = max(0, num_computed_tokens - window + 1) // bs
        released = [table[b] for b in range(start, end) if table[b] != NO_BLOCK]
        for b in range(start, end):
            table[b] = NO_BLOCK
        if end > start:
            blocks.num_released = end
        self.pool.release(released)
        return len(released)

    # -- beams: shared blocks, forked on write ---------------------------------------------------------

    def fork_beams(self, request_id: int, parents: list[int]) -> None:
        """Beam ``i`` now continues beam ``parents[i]``: its table becomes a shared copy of the parent's.

        Called after each beam-search step (the first call turns the prompt's single table into one per
        beam). No block is copied here; blocks are shared by reference count until a beam writes into a
        shared one, which :meth:`copy_on_write` then forks.
        """
        blocks = self._requests[request_id]
        tables = [list(blocks.tables[p]) for p in parents]
        num_tokens = [blocks.num_tokens[p] for p in parents]
        for table in tables:
            self.pool.share([b for b in table if b != NO_BLOCK])
        for table in blocks.tables:
            self.pool.release([b for b in reversed(table) if b != NO_BLOCK])
        blocks.tables, blocks.num_tokens = tables, num_tokens

    def copy_on_write(self, request_id: int, beam: int, position: int) -> tuple[int, int] | None:
        """Before beam ``beam`` writes ``position``: if its block is shared, give its table its own copy.

        Returns ``(source, destination)`` block ids whose contents the runtime must copy, or None.
        """
        table = self._requests[request_id].tables[beam]
        index = position // self.tokens_per_block
        if index >= len(table) or self.pool.ref_count(table[index]) == 1:
            return None
        source = table[index]
        (destination,) = self.pool.allocate(1)
        table[index] = destination
        self.pool.release([source])
        return source, destination

    # -- n samples: sibling requests that share a prompt's blocks -------------------------------------

    def fork_samples(self, request_id: int, sibling_ids: Sequence[int], num_tokens: int) -> None:
        """Each of ``sibling_ids`` starts with a table sharing the request's first ``num_tokens`` tokens.

        The prompt is computed once: siblings take its blocks by reference count (no copy here) and
        their registered chain, so block reuse goes on from where the prompt stands. The block holding
        the next written position, when partial, is shared until a sibling (or the request) writes it:
        :meth:`prepare_resources` then copies it first (:meth:`_copy_shared_tail`).
        """
        source = self._requests[request_id]
        require(source.num_beams == 1 and not source.padding, f"request {request_id}: samples need one table")
        keep = self.num_blocks_for_tokens(num_tokens)
        table = source.tables[0][:keep]
        source.family = request_id
        for sibling_id in sibling_ids:
            require(sibling_id not in self._requests, f"request {sibling_id} already holds blocks")
            self.pool.share([b for b in table if b != NO_BLOCK])
            blocks = self._requests[sibling_id] = RequestBlocks()
            blocks.tables[0] = list(table)
            blocks.num_tokens[0] = num_tokens
            blocks.chain = list(source.chain[: num_tokens // self.tokens_per_block])
            blocks.num_released = source.num_released
            blocks.family = request_id

    def _shared_tail(self, blocks: RequestBlocks) -> int | None:
        """The index of the table's block at its next written position when another table shares it."""
        table = blocks.tables[0]
        index = blocks.num_tokens[0] // self.tokens_per_block
        if index < len(table) and table[index] != NO_BLOCK and self.pool.ref_count(table[index]) > 1:
            return index
        return None

    def _copy_shared_tail(self, request_id: int, blocks: RequestBlocks) -> tuple[int, int] | None:
        """Before a sample writes into a block its siblings share: its own copy (``(source, destination)``
        for the runtime to copy), as :meth:`copy_on_write` does for beams."""
        index = self._shared_tail(blocks)
        if index is None:
            return None
        return self.copy_on_write(request_id, 0, index * self.tokens_per_block)

    def _references(self, request_ids: Iterable[int]) -> dict[int, int]:
        """Block id -> references the given requests hold on it."""
        refs: dict[int, int] = {}
        for request_id in request_ids:
            blocks = self._requests.get(request_id)
            if blocks is not None:
                for b in blocks.live_blocks():
                    refs[b] = refs.get(b, 0) + 1
        return refs

    def _distinct_blocks(self, request_id: int) -> set[int]:
        blocks = self._requests.get(request_id)
        return blocks.distinct_blocks() if blocks is not None else set()

    # -- views ----------------------------------------------------------------------------------------

    def block_ids(self, request_id: int, beam: int = 0) -> list[int]:
        blocks = self._requests.get(request_id)
        return blocks.tables[beam] if blocks is not None else []

    def window_block_ids(self, request_id: int) -> dict[int, list[int]] | None:
        """The request's table in each windowed pool, by window (None when there is no windowed pool)."""
        if not self.window_tables:
            return None
        return {w.window: w.block_ids(request_id) for w in self.window_tables}

    def num_layer_blocks_in_use(self) -> int:
        """Blocks in use counted once per layer they hold keys for: full attention's unit, whatever the split."""
        used = self.pool.num_used_blocks * self.num_layers
        return used + sum(w.pool.num_used_blocks * w.group.num_layers for w in self.window_tables)

    def num_layer_blocks_saved_by_window(self) -> int:
        """Table entries released behind an attention window, counted per layer they held: what full
        attention would hold on top of :meth:`num_layer_blocks_in_use`."""
        saved = sum(w.num_released_entries * w.group.num_layers for w in self.window_tables)
        if self.max_attention_window is not None:
            released = sum(t.count(NO_BLOCK) for b in self._requests.values() for t in b.tables)
            saved += released * self.num_layers
        return saved

    def padding_block_ids(self, request_id: int) -> list[int]:
        blocks = self._requests.get(request_id)
        return blocks.padding if blocks is not None else []

    def num_beams(self, request_id: int) -> int:
        blocks = self._requests.get(request_id)
        return blocks.num_beams if blocks is not None else 1

    def num_held_blocks(self, request_id: int) -> int:
        return sum(1 for b in self.block_ids(request_id) if b != NO_BLOCK)

    def num_tokens(self, request_id: int) -> int:
        blocks = self._requests.get(request_id)
        return blocks.num_tokens[0] if blocks is not None else 0

    def has_request(self, request_id: int) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[int]:
        return list(self._requests)

    @property
    def num_requests(self) -> int:
        """Requests holding block tables (a request with beams counts once)."""
        return len(self._requests)

    def check_integrity(self) -> None:
        """Pool accounting holds, every table covers its tokens, no table lists a block twice, and each
        block's reference count is the number of tables holding it (without block reuse, a block is
        shared only between the tables of one request)."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        owner: dict[int, int] = {}
        for request_id, blocks in self._requests.items():
            sized = list(zip(blocks.tables, blocks.num_tokens, strict=True))
            sized.append((blocks.padding, blocks.num_padding_tokens))
            for table, num_tokens in sized:
                require(
                    len(table) == self.num_blocks_for_tokens(num_tokens),
                    f"request {request_id}: a table of {len(table)} blocks for {num_tokens} tokens",
                )
                live = [b for b in table if b != NO_BLOCK]
                if len(live) != len(set(live)):
                    raise IntegrityError(f"request {request_id}: a table lists a block twice: {table}")
            family = blocks.family if blocks.family is not None else request_id
            for block_id in blocks.live_blocks():
                holders[block_id] = holders.get(block_id, 0) + 1
                if owner.setdefault(block_id, family) != family and not self.enable_block_reuse:
                    raise IntegrityError(
                        f"block {block_id} is shared by requests {owner[block_id]} and {request_id} "
                        "without block reuse"
                    )
        for block_id, count in holders.items():
            require(
                self.pool.ref_count(block_id) == count,
                f"block {block_id} has reference count {self.pool.ref_count(block_id)} "
                f"but {count} tables hold it",
            )
        require(
            len(holders) == self.pool.num_used_blocks,
            f"{self.pool.num_used_blocks} blocks in use but {len(holders)} in tables",
        )
        if self.window_tables:
            num_tokens = {rid: blocks.num_tokens[0] for rid, blocks in self._requests.items()}
            for windowed in self.window_tables:
                windowed.check_integrity(num_tokens)
