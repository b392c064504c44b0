"""The KV manager's helpers on their own (pure Python, no model): the request protocol it reads through,
the prefix cache, the shared tables of beams and samples, and the sliding window's release rule, with
the invariants each adds to ``check_integrity``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bm.kv import NO_BLOCK, IntegrityError, KVCacheManager, KVRequest, ResourcePlan
from bm.kv.block_hash import BlockKey
from bm.kv.types import beam_width_of, block_extra_keys_of, sharing_of
from bm.kv.window_groups import SlidingWindow
from bm.scheduling import LlmRequest, RequestState
from tests.test_block_reuse import Seq as Bare  # a request type with only the required members

KV_PACKAGE = Path(__file__).resolve().parents[1] / "bm" / "kv"
PROTOCOL_MEMBERS = {name for name in vars(KVRequest) if not name.startswith("_")}


class OnlyTheProtocol:
    """A request that answers only what :class:`KVRequest` declares; reading anything else fails the
    test (with an AssertionError, which ``getattr(..., default)`` does not swallow)."""

    def __init__(self, request: LlmRequest) -> None:
        object.__setattr__(self, "_request", request)

    def __getattribute__(self, name: str):
        if name not in PROTOCOL_MEMBERS:
            raise AssertionError(f"bm.kv read {name!r}, which KVRequest does not declare")
        return getattr(object.__getattribute__(self, "_request"), name)


def llm_request(rid: int, prompt: list[int], max_new: int = 4, **fields) -> LlmRequest:
    return LlmRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=max_new, **fields)


# -- the request protocol -----------------------------------------------------------------------------


def test_every_getattr_in_bm_kv_reads_a_member_the_request_protocol_declares():
    reads = []
    for path in sorted(KV_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
                reads.append((path.name, name))
    assert reads, "the optional members are read somewhere"
    assert all(file == "types.py" and name in PROTOCOL_MEMBERS for file, name in reads), reads


def test_the_manager_reads_no_request_field_the_protocol_does_not_declare():
    kv = KVCacheManager(num_blocks=32, tokens_per_block=2, enable_block_reuse=True, max_attention_window=4)
    first = OnlyTheProtocol(llm_request(1, [1, 2, 3, 4, 5]))
    kv.prepare_resources(ResourcePlan(starts=[(first, kv.find_cached_prefix(first))], grow=[(1, 5)]))
    kv.cache_computed_blocks(first, 5)
    kv.release_outside_window(1, 5)
    second = OnlyTheProtocol(llm_request(2, [1, 2, 3, 4, 9]))
    assert kv.find_cached_prefix(second).num_blocks == 2
    for fields in ({}, {"beam_width": 3}, {"num_pending_samples": 2}, {"shares_blocks": True}):
        request = OnlyTheProtocol(
            llm_request(3, [1] * 6, state=RequestState.GENERATION_IN_PROGRESS, **fields)
        )
        assert kv.get_needed_resource_to_completion(request) > 0
    assert kv.get_reserved_resource([first]) > 0
    kv.check_integrity()


def test_a_request_type_without_the_optional_members_reads_as_one_beam_no_samples_no_extra_keys():
    bare = Bare(1, [1, 2, 3])
    assert beam_width_of(bare) == 1 and sharing_of(bare) == (1, 0, False) and block_extra_keys_of(bare) == ()
    # the scheduler's request declares them all, so the defaults never stand in for a real value
    real = llm_request(1, [1, 2, 3], beam_width=2)
    assert all(hasattr(real, name) for name in PROTOCOL_MEMBERS)
    assert beam_width_of(real) == 2 and sharing_of(real) == (2, 0, False)


# -- the prefix cache ---------------------------------------------------------------------------------


def reuse_manager() -> KVCacheManager:
    return KVCacheManager(num_blocks=16, tokens_per_block=2, enable_block_reuse=True)


def start(kv: KVCacheManager, request: Bare) -> None:
    kv.take_cached_prefix(request, kv.find_cached_prefix(request))
    kv.allocate(request.request_id, request.num_tokens)
    kv.cache_computed_blocks(request, request.num_tokens)


def test_the_prefix_cache_is_held_only_with_block_reuse_on():
    assert KVCacheManager(8, 2).prefix_cache is None
    kv = KVCacheManager(8, 2)
    start(kv, Bare(1, [1, 2, 3, 4, 5]))
    assert kv.pool.num_cached_blocks == 0 and (kv.num_reused_blocks, kv.num_missed_blocks) == (0, 0)
    assert reuse_manager().prefix_cache is not None


def test_a_registered_chain_links_each_block_to_the_one_before_it():
    kv = reuse_manager()
    start(kv, Bare(1, [1, 2, 3, 4, 5]))
    start(kv, Bare(2, [1, 2, 3, 4, 7]))  # takes both full blocks of request 1
    chain = kv._requests[2].chain
    assert [key.parent_serial for key in chain] == [-1, chain[0].serial]
    assert kv.block_ids(2)[:2] == kv.block_ids(1)[:2]
    kv.check_integrity()


def test_integrity_check_catches_a_chain_that_skips_a_block():
    kv = reuse_manager()
    start(kv, Bare(1, [1, 2, 3, 4, 5]))
    chain = kv._requests[1].chain
    chain[1] = BlockKey(chain[1].block_hash, -1, chain[1].token_ids, (), chain[1].serial)
    with pytest.raises(IntegrityError, match="does not follow"):
        kv.check_integrity()


def test_integrity_check_catches_a_chain_longer_than_its_table():
    kv = reuse_manager()
    start(kv, Bare(1, [1, 2, 3, 4]))
    kv._requests[1].chain.append(None)
    kv._requests[1].chain.append(None)
    with pytest.raises(IntegrityError, match="registered blocks in a table"):
        kv.check_integrity()


def test_integrity_check_catches_a_block_registered_as_other_contents_than_its_chain():
    kv = reuse_manager()
    start(kv, Bare(1, [1, 2, 3, 4]))
    start(kv, Bare(2, [5, 6, 7, 8, 9]))
    kv._requests[1].chain[0] = kv._requests[2].chain[0]
    with pytest.raises(IntegrityError, match="registered as other contents"):
        kv.check_integrity()


# -- the shared tables of beams and samples -----------------------------------------------------------


def test_samples_share_the_prompt_and_each_copies_the_tail_block_before_writing_it():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4)
    kv.allocate(1, 6)  # a full block and a partial one
    kv.fork_samples(1, [2, 3], 5)  # siblings restart one position back, inside the partial block
    head, tail = kv.block_ids(1)
    assert kv.block_ids(2) == kv.block_ids(3) == [head, tail]
    assert kv.pool.ref_count(head) == kv.pool.ref_count(tail) == 3
    kv.check_integrity()
    assert kv.num_blocks_to_allocate(2, 6) == 1  # no new block, one copy of the shared tail
    prepared = kv.prepare_resources(ResourcePlan(grow=[(2, 6), (3, 6)]))
    assert [source for source, _ in prepared.copies] == [tail, tail]
    assert kv.block_ids(2)[0] == kv.block_ids(3)[0] == head and kv.pool.ref_count(tail) == 1
    assert kv.num_blocks_to_allocate(1, 7) == 0  # the request holds its tail alone again
    kv.check_integrity()
    for rid in (1, 2, 3):
        kv.free(rid)
    assert kv.pool.num_used_blocks == 0
    kv.check_integrity()


def test_beams_grow_through_the_shared_tables_with_the_copies_the_count_promised():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4)
    kv.allocate(7, 6)
    kv.fork_beams(7, [0, 0, 0])
    promised = kv.num_blocks_to_allocate(7, 7)
    free = kv.get_num_free_blocks()
    prepared = kv.prepare_resources(ResourcePlan(grow=[(7, 7)]))
    assert len(prepared.copies) == promised == free - kv.get_num_free_blocks() == 2
    kv.check_integrity()


def test_integrity_check_catches_blocks_shared_across_requests_without_reuse():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2)
    kv.allocate(1, 2)
    kv.allocate(2, 2)
    kv.pool.share(kv.block_ids(1))
    kv.pool.release(kv.block_ids(2))
    kv.block_ids(2)[0] = kv.block_ids(1)[0]  # reference counts agree; only the sharing is wrong
    with pytest.raises(IntegrityError, match="without block reuse"):
        kv.check_integrity()


def test_integrity_check_catches_beams_in_a_sample_family():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2)
    kv.allocate(1, 3)
    kv.fork_samples(1, [2], 2)
    kv.fork_beams(1, [0, 0])
    with pytest.raises(IntegrityError, match="beams in a sample family"):
        kv.check_integrity()


# -- the sliding window -------------------------------------------------------------------------------


def test_the_window_releases_behind_it_past_the_sinks_and_remembers_how_far_it_looked():
    window = SlidingWindow(window=4, sink_token_length=2, tokens_per_block=2)
    assert window.max_blocks == 1 + 2 + 1
    table = [10, 11, 12, 13, 14, 15]
    released, num_released = window.release(table, 0, 11)  # the next query at 11 reads 8.. and the sinks
    assert released == [11, 12, 13] and num_released == 4
    assert table == [10, NO_BLOCK, NO_BLOCK, NO_BLOCK, 14, 15]
    assert window.release(table, num_released, 11) == ([], 4)  # nothing new: unchanged
    assert window.release([20, 21], 0, 3) == ([], 0)  # inside the window: nothing, not even the sinks
