"""The KV bookkeeping on its own: pure Python, no model."""

from __future__ import annotations

import sys

import pytest

from bm.kv import BlockPool, IntegrityError, KVCacheManager, OutOfBlocksError
from bm.scheduling import LlmRequest


def request(rid: int, prompt: int, max_new: int) -> LlmRequest:
    return LlmRequest(request_id=rid, prompt_ids=[5] * prompt, max_new_tokens=max_new)


def test_kv_and_scheduling_import_without_torch():
    import subprocess

    code = "import sys, bm.kv, bm.scheduling; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_allocate_grows_table_by_whole_blocks_and_free_returns_them():
    kv = KVCacheManager(num_blocks=10, tokens_per_block=4)
    assert kv.allocate(1, 5) == kv.block_ids(1) and len(kv.block_ids(1)) == 2
    kv.append(1, 3)  # 8 tokens still fit in two blocks
    assert len(kv.block_ids(1)) == 2 and kv.num_tokens(1) == 8
    kv.append(1)  # the ninth token opens a third block
    assert len(kv.block_ids(1)) == 3
    kv.check_integrity()
    assert kv.get_num_free_blocks() == 7
    assert kv.free(1) == 3
    assert kv.get_num_free_blocks() == 10
    kv.check_integrity()


def test_needed_resource_to_completion_counts_prompt_and_all_output():
    kv = KVCacheManager(num_blocks=100, tokens_per_block=8)
    req = request(7, prompt=10, max_new=7)  # 17 tokens -> 3 blocks
    assert kv.get_needed_resource_to_completion(req) == 3
    kv.allocate(7, 10)
    assert kv.get_remaining_resource_to_completion(req) == 1
    assert kv.get_max_resource_count() == 100


def test_allocating_beyond_the_pool_raises_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, tokens_per_block=4)
    kv.allocate(1, 8)
    assert not kv.can_allocate(2, 1)
    with pytest.raises(OutOfBlocksError):
        kv.allocate(2, 1)
    kv.check_integrity()
    assert kv.block_ids(2) == []


def test_block_ids_are_never_shared_between_live_requests():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=2)
    for rid in range(4):
        kv.allocate(rid, 7)
    kv.free(1)
    kv.allocate(9, 5)
    owned = [b for rid in (0, 2, 3, 9) for b in kv.block_ids(rid)]
    assert len(owned) == len(set(owned))
    kv.check_integrity()


def test_check_integrity_detects_a_block_owned_twice():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=2)
    kv.allocate(1, 2)
    kv.allocate(2, 2)
    kv.block_ids(2)[0] = kv.block_ids(1)[0]  # corrupt on purpose
    with pytest.raises(IntegrityError):
        kv.check_integrity()


def test_pool_release_twice_is_an_error():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(ValueError):
        pool.release([block])
    pool.check_integrity()
