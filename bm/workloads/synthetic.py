"""Synthetic requests: random lengths around a mean, optionally behind shared prefixes.

Lengths follow ``vllm bench``'s random dataset: uniform integers in ``[len*(1-r), len*(1+r)]`` (at least
1). With ``prefix_len > 0``, request ``i`` starts with prefix ``i mod num_prefix_groups`` of
``prefix_len`` tokens (put in front of its random part), expressed as one hash block so that prefixes are
built exactly like a Mooncake trace's shared blocks.
"""

from __future__ import annotations

import random

from bm.config import BenchConfig
from bm.workloads.request import Row, Workload

DEFAULT_NUM_REQUESTS = 1000  # as vllm bench's --num-prompts


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low = max(1, int(mean * (1 - ratio)))
    high = max(low, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def load_synthetic(bench: BenchConfig) -> Workload:
    count = bench.num_requests or DEFAULT_NUM_REQUESTS
    rng = random.Random(f"bm-synthetic-lengths-{bench.seed}")
    requests = []
    for i in range(count):
        random_part = _length(rng, bench.input_len, bench.range_ratio)
        output_len = _length(rng, bench.output_len, bench.range_ratio)
        requests.append(
            Row(
                where=f"synthetic request {i}",
                index=i,
                user_id=i,
                input_len=bench.prefix_len + random_part,
                max_tokens=output_len,
                hash_ids=[i % bench.num_prefix_groups] if bench.prefix_len else None,
            )
        )
    return Workload("synthetic", "synthetic", requests, hash_block_size=bench.prefix_len)
