"""Block reuse in the KV layer on its own: prefix hits, eviction order, collisions, and random sequences of
operations under which every invariant of the cache must hold (pure Python, no model)."""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from bm.kv import NO_BLOCK, KVCacheManager


@dataclass
class Seq:
    """The slice of a request the KV manager reads."""

    request_id: int
    tokens: list[int]
    max_new: int = 4
    is_generation_phase: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens_at_completion(self) -> int:
        return len(self.tokens) + self.max_new

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def start(kv: KVCacheManager, seq: Seq) -> int:
    """What the engine does for a new request: take the cached prefix, compute the rest, register it."""
    reused = kv.take_cached_prefix(seq, kv.find_cached_prefix(seq))
    kv.allocate(seq.request_id, seq.num_tokens)
    kv.cache_computed_blocks(seq, seq.num_tokens)
    return reused


def test_a_freed_prefix_is_taken_by_reference_and_skips_its_blocks():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4, enable_block_reuse=True)
    first = Seq(1, list(range(10, 20)))  # two full blocks and a partial one
    assert start(kv, first) == 0
    head = kv.block_ids(1)[:2]
    kv.free(1)
    assert kv.pool.num_cached_blocks == 2  # the partial block was never registered: it is free
    second = Seq(2, [*range(10, 18), 99, 98])
    match = kv.find_cached_prefix(second)
    assert match.block_ids == tuple(head) and match.num_tokens == 8 and match.num_missed_blocks == 1
    assert start(kv, second) == 8
    assert kv.block_ids(2)[:2] == head and kv.pool.num_cached_blocks == 0
    assert (kv.num_reused_blocks, kv.num_missed_blocks) == (2, 4)
    kv.check_integrity()


def test_live_blocks_are_shared_and_counted_once():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2, enable_block_reuse=True)
    start(kv, Seq(1, [1, 2, 3, 4, 5]))
    match = kv.find_cached_prefix(Seq(2, [1, 2, 3, 4, 9]))
    assert match.num_blocks == 2 and match.num_cached == 0  # held by request 1: costs no free block
    assert match.cost(3) == 1
    start(kv, Seq(2, [1, 2, 3, 4, 9]))
    assert [kv.pool.ref_count(b) for b in kv.block_ids(2)] == [2, 2, 1]
    assert (
        kv.get_reserved_resource([Seq(1, [1, 2, 3, 4, 5]), Seq(2, [1, 2, 3, 4, 9])]) == 4 + 2 + 2
    )  # held once, plus 5 - 3 more each
    kv.check_integrity()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4, enable_block_reuse=True)
    start(kv, Seq(1, list(range(8))))
    kv.free(1)
    match = kv.find_cached_prefix(Seq(2, list(range(8))))
    assert match.num_tokens == 4  # the last block holds the token whose logits are sampled


def test_partial_blocks_are_never_registered():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4, enable_block_reuse=True)
    seq = Seq(1, [1, 2, 3])
    start(kv, seq)
    assert kv.pool.key(kv.block_ids(1)[0]) is None
    seq.tokens.append(4)
    kv.append(1)
    kv.cache_computed_blocks(seq, 4)
    assert kv.pool.key(kv.block_ids(1)[0]) is not None


def test_eviction_takes_least_recent_first_and_tails_before_heads():
    kv = KVCacheManager(num_blocks=6, tokens_per_block=2, enable_block_reuse=True)
    start(kv, Seq(1, [1, 1, 2, 2, 3, 3, 0]))  # three full blocks + partial
    old = kv.block_ids(1)[:3]
    kv.free(1)
    start(kv, Seq(2, [7, 7, 8]))
    newer = kv.block_ids(2)[:1]
    kv.free(2)
    # empty blocks go first; then request 1's tail, its middle, its head, and only then request 2's
    taken = kv.allocate(3, 12)
    assert taken[-4:] == [old[2], old[1], old[0], newer[0]]
    assert kv.pool.num_evicted_blocks == 4
    kv.check_integrity()


def test_a_hash_collision_never_hands_over_other_tokens():
    with mock.patch("bm.kv.prefix_cache.chain_hash", lambda parent, tokens, extra=(): 42):
        kv = KVCacheManager(num_blocks=8, tokens_per_block=2, enable_block_reuse=True)
        start(kv, Seq(1, [1, 2, 3]))
        kv.free(1)
        assert kv.find_cached_prefix(Seq(2, [5, 6, 7])).num_blocks == 0
        assert kv.find_cached_prefix(Seq(3, [1, 2, 7])).num_blocks == 1
        # the second block of [1, 2, 1, 2] collides with its first: the chain stops, nothing is shared
        start(kv, Seq(4, [1, 2, 1, 2, 0]))
        assert kv.find_cached_prefix(Seq(5, [1, 2, 1, 2, 9])).num_blocks == 1
        kv.check_integrity()


def test_without_reuse_nothing_is_cached_or_matched():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=2)
    start(kv, Seq(1, [1, 2, 3]))
    kv.free(1)
    assert kv.pool.num_cached_blocks == 0 and kv.find_cached_prefix(Seq(2, [1, 2, 3])).num_blocks == 0


def test_window_releases_blocks_behind_it_but_keeps_sink_blocks():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=2, max_attention_window=4, sink_token_length=2)
    kv.allocate(1, 11)
    # the next query at position 11 sees keys 8..11 and the sink tokens 0..1
    assert kv.release_outside_window(1, 11) == 3
    table = kv.block_ids(1)
    assert table[0] != NO_BLOCK and table[1:4] == [NO_BLOCK] * 3 and NO_BLOCK not in table[4:]
    assert kv.num_held_blocks(1) == 3 and kv.free(1) == 3
    kv.check_integrity()
    assert kv.get_num_free_blocks() == 16


def test_needed_to_completion_is_bounded_by_the_window():
    kv = KVCacheManager(num_blocks=64, tokens_per_block=4, max_attention_window=8, sink_token_length=4)
    long_generation = Seq(1, [3] * 30, max_new=500)
    assert kv.get_needed_resource_to_completion(long_generation) == 8  # its whole prompt at once
    long_generation.is_generation_phase = True
    assert kv.get_needed_resource_to_completion(long_generation) == 1 + 2 + 1  # sink + window + straddle
    assert kv.get_needed_resource_to_completion(Seq(2, [3] * 2, max_new=2)) == 1


# -- random sequences of operations ------------------------------------------------------------------------


def weak_hash(parent: int, tokens, extra=()) -> int:
    """A hash with three values: collisions on almost every lookup."""
    return hash((parent, tuple(tokens))) % 3


class CacheMachine(RuleBasedStateMachine):
    """Allocate, append, free, reuse and evict at random, on a small pool with a two-token alphabet so
    prefixes repeat. A shadow records which token prefix each block's contents were computed from."""

    window: int | None = None
    sink: int = 0
    total_hits = 0  # across examples: the run must have exercised reuse

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(
            num_blocks=10,
            tokens_per_block=2,
            enable_block_reuse=True,
            max_attention_window=self.window,
            sink_token_length=self.sink,
        )
        self.seqs: dict[int, Seq] = {}
        self.next_id = 0
        self.contents: dict[int, tuple[int, ...]] = {}  # block id -> the prefix its last slot ends

    def _compute(self, seq: Seq, start_pos: int) -> None:
        """Write positions [start_pos, num_tokens) into the request's blocks, as a forward would."""
        bs = self.kv.tokens_per_block
        table = self.kv.block_ids(seq.request_id)
        for pos in range(start_pos, seq.num_tokens):
            self.contents[table[pos // bs]] = tuple(seq.tokens[: pos + 1])
        self.kv.cache_computed_blocks(seq, seq.num_tokens)
        self._check_window(seq)
        self.kv.release_outside_window(seq.request_id, seq.num_tokens)

    def _check_window(self, seq: Seq) -> None:
        """Every block the next query attends is still held."""
        if self.window is None:
            return
        bs, n = self.kv.tokens_per_block, seq.num_tokens
        table = self.kv.block_ids(seq.request_id)
        attended = [*range(min(self.sink, n)), *range(max(0, n - self.window + 1), n)]
        assert all(table[p // bs] != NO_BLOCK for p in attended)

    @rule(tokens=st.lists(st.integers(1, 2), min_size=1, max_size=9))
    def start_request(self, tokens: list[int]) -> None:
        seq = Seq(self.next_id, tokens)
        self.next_id += 1
        kv = self.kv
        match = kv.find_cached_prefix(seq)
        bs = kv.tokens_per_block
        for i, block_id in enumerate(match.block_ids):
            # a hit only when the block was computed from exactly this prefix
            assert self.contents[block_id] == tuple(tokens[: (i + 1) * bs])
        needed = kv.num_blocks_for_tokens(seq.num_tokens)
        if match.cost(needed) > kv.get_num_free_blocks():
            return
        kv.take_cached_prefix(seq, match)
        type(self).total_hits += match.num_blocks
        kv.allocate(seq.request_id, seq.num_tokens)
        self.seqs[seq.request_id] = seq
        self._compute(seq, match.num_tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(1, 2))
    def append_token(self, data, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[rid]
        if not self.kv.can_allocate(rid, seq.num_tokens + 1):
            return
        seq.tokens.append(token)
        self.kv.append(rid)
        self._compute(seq, seq.num_tokens - 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free_request(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(rid)
        del self.seqs[rid]

    @rule(num_blocks=st.integers(1, 4))
    def evict_by_allocating(self, num_blocks: int) -> None:
        """A private table of fresh blocks, which may evict cached ones."""
        kv = self.kv
        if kv.get_num_free_blocks() < num_blocks:
            return
        seq = Seq(self.next_id, [0] * (num_blocks * kv.tokens_per_block))
        self.next_id += 1
        kv.allocate(seq.request_id, seq.num_tokens)
        for b in kv.block_ids(seq.request_id):
            self.contents[b] = ("private", seq.request_id)
        self.seqs[seq.request_id] = seq

    @invariant()
    def cache_is_consistent(self) -> None:
        kv = self.kv
        kv.check_integrity()
        pool = kv.pool
        assert pool.num_empty_blocks + pool.num_used_blocks + pool.num_cached_blocks == pool.num_blocks
        assert all(pool.ref_count(b) >= 0 for b in range(pool.num_blocks))
        lists = [list(pool._free), list(pool._cached)] + [
            [b for b in kv.block_ids(rid) if b != NO_BLOCK] for rid in self.seqs
        ]
        for blocks in lists:
            assert len(blocks) == len(set(blocks))
        assert not set(pool._free) & set(pool._cached)


class WindowCacheMachine(CacheMachine):
    window = 3
    sink = 1


SETTINGS = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


@pytest.mark.parametrize("machine", [CacheMachine, WindowCacheMachine])
def test_random_operations_keep_every_invariant(machine):
    machine.total_hits = 0
    run_state_machine_as_test(machine, settings=SETTINGS)
    assert machine.total_hits > 0


def test_random_operations_keep_every_invariant_under_constant_hash_collisions():
    CacheMachine.total_hits = 0
    with mock.patch("bm.kv.prefix_cache.chain_hash", weak_hash):
        run_state_machine_as_test(CacheMachine, settings=SETTINGS)
    assert CacheMachine.total_hits > 0
