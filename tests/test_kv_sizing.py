"""The KV pool's size on a CPU, and how much of it a run touches: the rule, pinned with fixed numbers."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from bm.config import KvCacheConfig
from bm.kv.block_pool import BlockPool
from bm.runtime.kv_sizing import KVCacheSizeError, num_kv_blocks

# SmolLM2-135M in fp32: 30 layers x (keys + values) x 3 KV heads x 64 dims x 4 bytes
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
GIB = 2**30


def _cpu_model(kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN) -> SimpleNamespace:
    return SimpleNamespace(
        kv_bytes_per_token=kv_bytes_per_token,
        kv_cache_bytes_per_token=lambda dtype: kv_bytes_per_token,
        device=torch.device("cpu"),
    )


def test_default_pool_is_the_smaller_of_nine_tenths_of_free_memory_and_what_the_engine_can_hold():
    assert SMOLLM2_KV_BYTES_PER_TOKEN * 32 == 1_474_560  # one 32-token block
    kv = KvCacheConfig()
    # 20 GiB free: 0.9 x 20 GiB / 1,474,560 B = 13,107 blocks, below 128 requests x 8,192 tokens / 32 = 32,768
    assert num_kv_blocks(_cpu_model(), kv, max_useful_tokens=128 * 8192, free_bytes=20 * GIB) == 13_107
    # 100 GiB free: the engine's limits cap it (128 requests x 8,192 tokens)
    assert num_kv_blocks(_cpu_model(), kv, max_useful_tokens=128 * 8192, free_bytes=100 * GIB) == 32_768
    # a partial block of useful tokens still counts as one
    assert num_kv_blocks(_cpu_model(), kv, max_useful_tokens=33, free_bytes=20 * GIB) == 2


def test_max_tokens_and_free_memory_fraction_cap_the_pool_the_smaller_winning():
    kv = KvCacheConfig(max_tokens=16_384)
    assert num_kv_blocks(_cpu_model(), kv, max_useful_tokens=10**9, free_bytes=20 * GIB) == 512
    kv = KvCacheConfig(free_memory_fraction=0.1)
    assert num_kv_blocks(_cpu_model(), kv, max_useful_tokens=10**9, free_bytes=20 * GIB) == 1_456


def test_too_little_memory_for_one_block_is_an_error_naming_the_knob():
    with pytest.raises(KVCacheSizeError, match="free_memory_fraction"):
        num_kv_blocks(_cpu_model(), KvCacheConfig(), max_useful_tokens=10**6, free_bytes=1_000_000)


def test_a_long_run_on_a_large_pool_touches_only_its_peak_concurrent_blocks():
    """Empty blocks go last released, first taken: over 2,000 requests through a 13,107-block pool
    (SmolLM2's default on 20 GiB free) at most 64 running at once, the ids handed out are exactly 0 up to the
    most blocks in use at one moment, so the untouched rest of the pool's memory is never mapped."""
    pool = BlockPool(13_107)
    rng = random.Random(0)
    running: list[list[int]] = []
    peak = highest = 0
    for _ in range(2_000):
        if len(running) == 64:
            pool.release(running.pop(rng.randrange(len(running))))
        running.append(pool.allocate(rng.randint(1, 40)))
        peak = max(peak, pool.num_used_blocks)
        highest = max(highest, *running[-1])
    assert highest + 1 == peak < 64 * 40  # ids 0 .. peak - 1, never beyond


def test_a_fresh_pool_hands_out_ascending_ids_and_reuses_the_latest_released_first():
    pool = BlockPool(100)
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([0, 1])
    assert pool.allocate(3) == [1, 0, 3]
