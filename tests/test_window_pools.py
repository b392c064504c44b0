"""Per-window block accounting without a model: layers with a narrower window keep blocks in a pool of their
own, release the blocks behind their window after each forward, and that pool never runs short of what the
schedulers (which see only the main pool) let through."""

from __future__ import annotations

import pytest

from bm.config import config_from_dict
from bm.engine.execution.fake_executor import FakeExecutor, fake_token
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.engine.step.limits import cache_pools, window_layout
from bm.kv import NO_BLOCK, IntegrityError, KVCacheManager, WindowGroup
from bm.kv.window_groups import split_blocks, window_pool_bound

VOCAB = 500
GEMMA3 = (8, 8, 8, 8, 8, None)  # five sliding layers (window 8) for every full one


def manager(num_blocks: int = 32, window_blocks: int = 12, sinks: int = 0) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        4,
        num_layers=1,
        window_groups=[WindowGroup(8, 5, window_blocks)],
        window_sink_token_length=sinks,
    )


def test_windowed_table_releases_blocks_wholly_behind_the_window_and_the_main_table_keeps_all():
    kv = manager()
    kv.allocate(1, 20)  # 5 blocks in each table
    (windowed,) = kv.window_tables
    assert windowed.pool.num_used_blocks == 5
    # the next query sits at 20 and attends keys 13..20: blocks 0..2 (keys 0..11) are behind it
    assert kv.release_outside_window(1, 20) == 0  # the main table (full attention) releases nothing
    assert windowed.block_ids(1)[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in windowed.block_ids(1)[3:]
    assert windowed.pool.num_used_blocks == 2 and kv.num_held_blocks(1) == 5
    assert kv.num_layer_blocks_in_use() == 5 * 1 + 2 * 5
    assert kv.num_layer_blocks_saved_by_window() == 3 * 5
    kv.check_integrity()
    kv.free(1)
    assert windowed.pool.num_used_blocks == 0 and kv.num_layer_blocks_saved_by_window() == 0
    kv.check_integrity()


def test_one_table_for_every_layer_counts_its_released_blocks_once_per_layer():
    kv = KVCacheManager(32, 4, max_attention_window=8, num_layers=3)
    kv.allocate(1, 20)
    assert kv.release_outside_window(1, 20) == 3
    assert kv.num_layer_blocks_in_use() == 2 * 3 and kv.num_layer_blocks_saved_by_window() == 3 * 3


def test_windowed_table_keeps_sink_blocks_and_a_block_the_window_still_straddles():
    kv = manager(sinks=4)
    kv.allocate(1, 22)
    kv.release_outside_window(1, 22)  # keys 15..22 attended: block 3 (12..15) straddles, block 0 is a sink
    assert kv.window_block_ids(1)[8] == [0, NO_BLOCK, NO_BLOCK, 3, 4, 5]
    kv.check_integrity()


def test_rolled_back_drafts_leave_both_tables_at_the_kept_length():
    kv = manager()
    kv.allocate(1, 17)
    kv.release_outside_window(1, 17)
    kv.allocate(1, 24)  # three drafts' room
    kv.trim(1, 18)
    assert len(kv.block_ids(1)) == 5 and len(kv.window_block_ids(1)[8]) == 5
    kv.check_integrity()


def test_a_windowed_pool_refuses_block_reuse_and_beams():
    with pytest.raises(ValueError, match="block reuse"):
        KVCacheManager(8, 4, enable_block_reuse=True, window_groups=[WindowGroup(8, 1, 4)])
    kv = manager()
    kv.allocate(1, 4)
    kv.fork_beams(1, [0, 0])
    with pytest.raises(IntegrityError, match="beams"):
        kv.allocate(1, 8, beam=1)


def test_integrity_check_catches_a_windowed_table_out_of_step_with_the_main_one():
    kv = manager()
    kv.allocate(1, 8)
    kv.window_tables[0].grow(1, 12)
    with pytest.raises(IntegrityError, match="main table's 8"):
        kv.check_integrity()


def test_memory_split_grows_the_main_pool_by_what_windowed_layers_cannot_use():
    # 60 one-layer blocks of memory (10 all-layer blocks x 6 layers); the windowed layers can use 6 blocks
    assert split_blocks(10, 1, [(5, 6)], max_main_blocks=1000) == (30, [6])
    assert split_blocks(10, 1, [(5, 6)], max_main_blocks=20) == (20, [6])  # the rest is memory saved
    assert split_blocks(10, 1, [(5, 50)], max_main_blocks=1000) == (10, [10])  # no room to gain
    # one request of at most 8 tokens a step on a window of 8 in blocks of 4: 2 + (8 + 8) / 4
    assert window_pool_bound(8, 0, 4, max_num_requests=1, max_num_tokens=8) == 6


def config(**engine) -> object:
    return config_from_dict(
        {
            "engine": {"max_batch_size": 3, "max_num_tokens": 16, "enable_chunked_context": True, **engine},
            "kv_cache": {"tokens_per_block": 4, "max_tokens": 160},
        }
    )


def test_pools_are_split_only_where_each_request_keeps_one_table_and_no_prefix_is_shared():
    executor = FakeExecutor(VOCAB, max_position_embeddings=512, layer_windows=GEMMA3)
    for cfg, split in [
        (config(), True),
        (config(max_beam_width=2), False),
        (config(batching_scheme="v1"), False),
    ]:
        layout = window_layout(cfg, executor.limits, 512)
        assert bool(cache_pools(cfg, layout, 40, 3, 512).window_groups) == split
    reuse = config_from_dict({"kv_cache": {"enable_block_reuse": True}})
    assert not cache_pools(reuse, window_layout(reuse, executor.limits, 512), 40, 3, 512).window_groups


def run(core: EngineCore, requests: list[Request], max_steps: int = 3000) -> tuple[dict, list]:
    pending = list(requests)
    finals, stats = {}, []
    for _ in range(max_steps):
        if pending:  # one request joins each step, mid-generation of the others
            assert core.add_request(pending.pop(0)) is None
        if not core.num_active and not pending:
            break
        out = core.step()
        if out.stats is not None:
            stats.append(out.stats)
        finals.update({r.request_id: r for r in out.responses if r.final})
    assert len(finals) == len(requests)
    return finals, stats


@pytest.mark.parametrize(
    ("engine", "max_tokens"),
    [
        ({}, 96),
        ({"scheduler_policy": "max_utilization", "max_batch_size": 4}, 96),
        ({"enable_chunked_context": False, "max_num_tokens": 80}, 256),
        ({"speculative": {"method": "ngram", "num_draft_tokens": 3, "max_ngram": 2}}, 96),
        ({"context_chunking_policy": "equal_progress"}, 96),
    ],
    ids=["no-evict", "max-utilization", "unchunked", "drafts", "equal-progress"],
)
def test_windowed_pools_never_run_short_and_outputs_do_not_change(engine, max_tokens):
    """Long requests on a window of 8 with blocks of 4 under every policy: the windowed pools (sized
    from the bound, never consulted by the scheduler) always have room, every position's window is still
    there when it is read (the fake executor checks), and outputs are the fake model's."""
    cfg = config(**engine)
    cfg.kv_cache.max_tokens = max_tokens
    executor = FakeExecutor(VOCAB, max_position_embeddings=512, layer_windows=GEMMA3)
    core = EngineCore(cfg, executor, check_integrity=True)
    kv = core.kv_cache_manager
    assert kv.window_tables and kv.get_max_resource_count() > max_tokens // 4  # the main pool grew
    requests = [
        Request(i, [3 + (i * 7 + j) % 40 for j in range(20 + (i * 17) % 60)], 10 + (i * 11) % 40)
        for i in range(9)
    ]
    finals, stats = run(core, requests)
    for r in requests:
        n = len(r.input_ids)
        expected = [fake_token(r.request_id, n + k, 0, VOCAB) for k in range(r.request_output_len)]
        assert finals[r.request_id].error == "" and finals[r.request_id].output_ids == expected
    peak_used = max(s.used_layer_blocks for s in stats)
    peak_full = max(s.used_layer_blocks + s.saved_layer_blocks for s in stats)
    assert peak_used < peak_full
    if engine.get("scheduler_policy") == "max_utilization":
        assert sum(s.paused_requests for s in stats) > 0  # pausing frees windowed tables too
    if "speculative" in engine:
        assert sum(s.draft_tokens - s.accepted_draft_tokens for s in stats) > 0  # some were rolled back
