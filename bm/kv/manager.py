"""Per-request block tables over a :class:`BlockPool`: the one owner of KV blocks. Pure Python.

The manager is the only place that knows how many blocks a request needs, now and at completion, so the
capacity policies above it never do block arithmetic of their own. It returns plain lists of block ids;
the runtime turns them into slot mappings and block-table tensors. Blocks change hands only in its steps:
``prepare_resources`` (a plan), ``update_resources`` (what a forward computed) and ``free``.

It keeps every request's tables and applies the steps; what varies with the kind of request is handed to
helpers it holds, each in its own module, so that a plain request's path stays short:

- :class:`~bm.kv.prefix_cache.PrefixCache` (only with block reuse on): matching a prefix against cached
  blocks, taking the match by reference, and registering full blocks once computed;
- :class:`~bm.kv.shared_tables.SharedTables`: beams and n-samples families fork tables that share
  blocks, and copy a shared block before writing into it;
- :mod:`bm.kv.window_groups`: an attention window releases the blocks wholly behind it (they appear as
  :data:`NO_BLOCK`, so positions still index the table); layers with a narrower window than the main
  table's may keep tables over pools of their own, grown, released, rolled back and freed with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bm.kv.block_pool import BlockPool, require
from bm.kv.prefix_cache import PrefixCache
from bm.kv.shared_tables import SharedTables
from bm.kv.tables import NO_BLOCK, RequestBlocks, check_references, held_references
from bm.kv.types import (
    NO_MATCH,
    KVRequest,
    PrefixMatch,
    PreparedResources,
    ResourcePlan,
    ResourceUpdate,
    block_extra_keys_of,
    cdiv,
    sharing_of,
)
from bm.kv.window_groups import SlidingWindow, WindowedTables, WindowGroup


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
        self._window = (
            SlidingWindow(max_attention_window, self.sink_token_length, tokens_per_block)
            if max_attention_window is not None
            else None
        )
        self._requests: dict[int, RequestBlocks] = {}
        self.num_layers = num_layers
        if window_groups and enable_block_reuse:
            raise ValueError(
                "windowed pools keep no prefix cache: block reuse needs one table for all layers"
            )
        self.window_tables = [
            WindowedTables(group, tokens_per_block, window_sink_token_length) for group in window_groups
        ]
        self.prefix_cache = PrefixCache(self.pool, tokens_per_block) if enable_block_reuse else None
        self.shared_tables = SharedTables(self.pool, tokens_per_block)

    @property
    def num_reused_blocks(self) -> int:
        """Blocks taken from the cache over the run (0 without block reuse)."""
        return self.prefix_cache.num_reused_blocks if self.prefix_cache is not None else 0

    @property
    def num_missed_blocks(self) -> int:
        """Blocks of starting contexts that were looked up and had to be computed (0 without reuse)."""
        return self.prefix_cache.num_missed_blocks if self.prefix_cache is not None else 0

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
        """Most blocks a generating request holds under the attention window (None: no window)."""
        return self._window.max_blocks if self._window is not None else None

    def get_needed_resource_to_completion(self, request: KVRequest) -> int:
        """Most blocks the request holds at once from now to its end.

        Without a window that is every block of its final length. With one, a context phase still holds
        its whole context at once at worst (the blocks behind the window are released after each
        forward), and a generation holds at most the window's blocks. A beam or sample request counts
        what its forked tables may hold (:meth:`SharedTables.num_blocks_to_completion`).
        """
        bs = self.tokens_per_block
        full = -(-request.num_tokens_at_completion // bs)
        forked = self.shared_tables.num_blocks_to_completion(request, full)
        if forked is not None:
            return forked
        if self._window is None:
            return full
        bound = self._window.max_blocks
        if not request.is_generation_phase:
            bound = max(bound, -(-request.num_tokens // bs))
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
        tables, bs, plain = self._requests, self.tokens_per_block, self._window is None
        num_held = remaining = 0
        for request in requests:
            blocks = tables.get(request.request_id)
            if blocks is None:
                own = 0
            elif plain and len(blocks.tables) == 1 and not blocks.padding:
                own = len(blocks.tables[0])
            else:
                own = len(blocks.distinct_blocks())
            num_held += own
            if plain and sharing_of(request) == (1, 0, False):  # get_needed_resource_to_completion's full
                remaining += max(0, -(-request.num_tokens_at_completion // bs) - own)
            else:
                remaining += max(0, self.get_needed_resource_to_completion(request) - own)
        if not self.enable_block_reuse:
            return num_held + remaining
        holders = sum(1 for r in requests if r.request_id in self._requests)
        if holders == len(self._requests):
            return self.pool.num_used_blocks + remaining
        held: set[int] = set()
        for request in requests:
            held |= self._distinct_blocks(request.request_id)
        return len(held) + remaining

    def num_blocks_to_allocate(self, request_id: int, num_tokens: int) -> int:
        """Blocks :meth:`prepare_resources` would take for the request to hold ``num_tokens`` tokens in
        total. For a request with beams or sample siblings: over every table, plus a copy for each table
        whose block at the next written position is shared (:meth:`SharedTables.num_blocks_to_allocate`).
        """
        blocks = self._requests.get(request_id)
        if blocks is None:
            return -(-num_tokens // self.tokens_per_block)
        if blocks.is_forked:
            return self.shared_tables.num_blocks_to_allocate(blocks, num_tokens)
        return max(0, -(-num_tokens // self.tokens_per_block) - len(blocks.tables[0]))

    def num_blocks_freed_by(self, request_ids: Iterable[int]) -> int:
        """Blocks that freeing all of ``request_ids`` would return to the pool (free or cached): those no
        other request references."""
        refs = held_references(self._requests, request_ids)
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
        requests, pool, bs, windowed = self._requests, self.pool, self.tokens_per_block, self.window_tables
        for request_id, num_tokens in plan.grow:
            blocks = requests.get(request_id)
            if blocks is None:
                blocks = requests[request_id] = RequestBlocks()
            if blocks.is_forked:  # copy each shared block about to be written, then grow
                prepared.copies.extend(self.shared_tables.grow(blocks, num_tokens))
            else:
                blocks.grow(0, num_tokens, pool, bs)
            if windowed:
                self._grow_windows(request_id, blocks, num_tokens)
        for request_id, num_tokens in plan.pad:
            self.allocate_padding(request_id, num_tokens)
        return prepared

    @property
    def reads_computed_lengths(self) -> bool:
        """Whether :meth:`update_resources` reads ``update.computed`` (block reuse, attention windows)."""
        return self.prefix_cache is not None or self._window is not None or bool(self.window_tables)

    def update_resources(self, update: ResourceUpdate) -> None:
        """Apply what an iteration computed (TensorRT-LLM's ``update_resources``): roll tables back past
        rejected drafts, register newly full blocks and release those behind the window, then fork the
        tables of beams and samples. Kept in that order so block ids, reuse and eviction match step by
        step."""
        for request_id, num_tokens in update.trim:
            self.trim(request_id, num_tokens)
        reuse, window = self.prefix_cache is not None, self._window is not None or bool(self.window_tables)
        if reuse or window:  # most runs neither reuse nor window: a computed token changes no table then
            for request, num_computed in update.computed:
                if reuse:
                    self.cache_computed_blocks(request, num_computed)
                if window:
                    self.release_outside_window(request.request_id, num_computed)
        for request_id, parents in update.forks:
            self.fork_beams(request_id, parents)
        for request_id, sibling_ids, num_tokens in update.samples:
            self.fork_samples(request_id, sibling_ids, num_tokens)

    def allocate(self, request_id: int, num_tokens: int, beam: int = 0) -> list[int]:
        """Grow one table of the request to hold ``num_tokens`` tokens (a context chunk, or one more token);
        returns the table. Raises :class:`OutOfBlocksError` when the pool is short (the scheduler checks)."""
        blocks = self._requests.get(request_id)
        if blocks is None:
            blocks = self._requests[request_id] = RequestBlocks()
        table = blocks.grow(beam, num_tokens, self.pool, self.tokens_per_block)
        self._grow_windows(request_id, blocks, num_tokens)
        return table

    def _grow_windows(self, request_id: int, blocks: RequestBlocks, num_tokens: int) -> None:
        """Grow the request's table in each windowed pool with its main table (one table per request
        there: beams cannot use windowed pools)."""
        for windowed in self.window_tables:
            require(blocks.num_beams == 1, f"request {request_id}: beams cannot use windowed pools")
            windowed.grow(request_id, num_tokens)

    def append(self, request_id: int, num_new_tokens: int = 1) -> list[int]:
        """Room for generated tokens: the same growth as :meth:`allocate`, counted from the current size."""
        return self.allocate(request_id, self.num_tokens(request_id) + num_new_tokens)

    def trim(self, request_id: int, num_tokens: int) -> int:
        """Roll a single-table request back to ``num_tokens`` tokens: the blocks past them (written by
        rejected draft tokens, never registered for reuse) go back to the pool. Returns how many."""
        blocks = self._requests.get(request_id)
        if blocks is None or blocks.num_beams > 1:
            return 0
        num_released = blocks.trim(num_tokens, self.pool, self.tokens_per_block)
        for windowed in self.window_tables:
            windowed.trim(request_id, num_tokens)
        return num_released

    def allocate_padding(self, request_id: int, num_tokens: int) -> list[int]:
        """V1: grow the request's pad-token table to hold ``num_tokens`` pad tokens."""
        blocks = self._requests.get(request_id)
        if blocks is None:
            blocks = self._requests[request_id] = RequestBlocks()
        return blocks.grow_padding(num_tokens, self.pool, self.tokens_per_block)

    def free(self, request_id: int) -> int:
        """Release every block of the request (the resource manager's ``free_resources``), tail first
        (:meth:`RequestBlocks.release`); returns how many references it dropped. Unknown ids free nothing.
        """
        blocks = self._requests.pop(request_id, None)
        if blocks is None:
            return 0
        for windowed in self.window_tables:
            windowed.free(request_id)
        return blocks.release(self.pool)

    # -- block reuse (the prefix cache) ---------------------------------------------------------------

    def block_extra_keys(self, request: KVRequest) -> tuple:
        """Keys beside the tokens that change a block's values (a prompt table's digest, a LoRA task id)."""
        return block_extra_keys_of(request)

    def find_cached_prefix(self, request: KVRequest, releasing: Iterable[int] = ()) -> PrefixMatch:
        """The longest verified chain of cached blocks matching the request's tokens; takes nothing
        (:meth:`PrefixCache.find`). ``releasing``: requests the same plan frees first (paused), whose
        blocks then count as cached rather than held. A request holding blocks already matches nothing.
        """
        if self.prefix_cache is None or request.request_id in self._requests:
            return NO_MATCH
        return self.prefix_cache.find(request, held_references(self._requests, releasing))

    def take_cached_prefix(self, request: KVRequest, match: PrefixMatch) -> int:
        """Start the request's table with the matched blocks (by reference); returns the tokens reused.
        ``match`` must come from :meth:`find_cached_prefix` with no allocation in between."""
        if self.prefix_cache is None:
            return 0
        rid = request.request_id
        require(rid not in self._requests, f"request {rid} already holds blocks; a prefix is taken at start")
        self._requests[rid] = self.prefix_cache.take(match)
        return match.num_tokens

    def cache_computed_blocks(self, request: KVRequest, num_computed_tokens: int) -> int:
        """Register the request's newly full, computed blocks for reuse; returns how many were added
        (:meth:`PrefixCache.register_computed`)."""
        blocks = self._requests.get(request.request_id)
        if self.prefix_cache is None or blocks is None:
            return 0
        return self.prefix_cache.register_computed(request, blocks, num_computed_tokens)

    # -- attention window -----------------------------------------------------------------------------

    def release_outside_window(self, request_id: int, num_computed_tokens: int) -> int:
        """Release blocks no later query of the request attends (:meth:`SlidingWindow.release`); returns
        how many (of the main table). Beam requests keep every block. Each windowed pool's table releases
        behind its own window."""
        for windowed in self.window_tables:
            windowed.release_outside_window(request_id, num_computed_tokens)
        blocks = self._requests.get(request_id)
        if self._window is None or blocks is None or blocks.num_beams > 1 or not blocks.tables[0]:
            return 0
        released, blocks.num_released = self._window.release(
            blocks.tables[0], blocks.num_released, num_computed_tokens
        )
        self.pool.release(released)
        return len(released)

    # -- beams and samples: forked tables (the shared tables) ------------------------------------------

    def fork_beams(self, request_id: int, parents: list[int]) -> None:
        """Beam ``i`` now continues beam ``parents[i]``: its table becomes a shared copy of the parent's
        (:meth:`SharedTables.fork_beams`; blocks are copied on write, when the tables grow)."""
        self.shared_tables.fork_beams(self._requests[request_id], parents)

    def copy_on_write(self, request_id: int, beam: int, position: int) -> tuple[int, int] | None:
        """Before beam ``beam`` writes ``position``: if its block is shared, give its table its own copy;
        returns ``(source, destination)`` block ids whose contents the runtime must copy, or None."""
        return self.shared_tables.copy_on_write(self._requests[request_id].tables[beam], position)

    def fork_samples(self, request_id: int, sibling_ids: Sequence[int], num_tokens: int) -> None:
        """Each of ``sibling_ids`` starts with a table sharing the request's first ``num_tokens`` tokens
        and its registered chain (:meth:`SharedTables.fork_sample`): the prompt is computed once."""
        source = self._requests[request_id]
        self.shared_tables.found_family(source, request_id)
        for sibling_id in sibling_ids:
            require(sibling_id not in self._requests, f"request {sibling_id} already holds blocks")
            self._requests[sibling_id] = self.shared_tables.fork_sample(source, num_tokens)

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
        """The whole cache agrees with itself: pool accounting holds (free + cached + used == total),
        every table covers its tokens, no table lists a block twice, each block's reference count is the
        number of tables holding it, and every helper's own invariants hold: which tables may share a
        block (:meth:`SharedTables.check_integrity`), registered chains (:meth:`PrefixCache.
        check_integrity`) and the windowed pools' tables."""
        self.pool.check_integrity()
        self.shared_tables.check_integrity(self._requests, self.enable_block_reuse)
        check_references(self._requests, self.pool, self.tokens_per_block)
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity(self._requests)
        if self.window_tables:
            num_tokens = {rid: blocks.num_tokens[0] for rid, blocks in self._requests.items()}
            for windowed in self.window_tables:
                windowed.check_integrity(num_tokens)
