"""The KV cache a benchmark needs, read off its dataset: what ``bm bench``, ``bm compare`` and ``bm sweep``
size the cache by when ``kv_cache.max_tokens`` is not set.

Sized from memory alone, the cache took 90% of an H100's free memory (68 GB) for a workload that can
never hold more than about 330k tokens at once, and two engines in one process saw different free
memory and got different caches. A benchmark knows its requests: at most ``concurrency`` of them hold
blocks at once, none longer than the longest prompt plus the longest output, so that many tokens (each
sequence rounded up to whole blocks, plus one block of headroom, times the widest request's samples or
beams) is all a run can use. The memory bound still applies on top (the smaller wins). Plain Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from bm.config import BmConfig
from bm.kv import cdiv
from bm.workloads import Workload


@dataclass(frozen=True)
class WorkloadCache:
    """What a dataset needs of the cache, for a note to the user and results.json."""

    concurrency: int  # sequences that can hold blocks at once
    tokens_per_sequence: int  # the longest prompt + output, rounded up to blocks, plus one block
    samples: int  # the widest request's samples or beams (each its own table)

    @property
    def max_tokens(self) -> int:
        return self.concurrency * self.tokens_per_sequence * self.samples

    def describe(self) -> str:
        """One line under 80 columns, e.g. ``KV cache: 6,144 tokens for the dataset (64 x 96)``."""
        samples = f" x {self.samples}" if self.samples > 1 else ""
        return (
            f"KV cache: {self.max_tokens:,} tokens for the dataset ({self.concurrency} x "
            f"{self.tokens_per_sequence:,}{samples}; kv_cache.max_tokens overrides)"
        )


def workload_cache(workload: Workload, configs: Iterable[BmConfig]) -> WorkloadCache | None:
    """The cache every config of ``configs`` (resolved: budgets set) needs for ``workload``; the largest
    over them, so the variants of one comparison and the points of one sweep share one cache. None when
    no row can run."""
    rows = [r for r in workload.requests if r.ok]
    if not rows:
        return None
    longest_prompt = max(_prompt_len(r) for r in rows)
    longest_output = max(r.max_tokens or 0 for r in rows)
    samples = max(_samples(r.fields) for r in rows)
    best: WorkloadCache | None = None
    for config in configs:
        engine, bench = config.engine, config.bench
        active = engine.max_num_active_requests or engine.max_batch_size
        if active is None:
            raise ValueError("workload_cache needs resolved engine budgets (bm.config.resolve_engine)")
        concurrency = min(len(rows), active, bench.max_concurrency or len(rows))
        block = config.kv_cache.tokens_per_block
        # a V1 static batch pads every prompt to its longest and runs to its longest output
        per_sequence = (cdiv(longest_prompt + longest_output, block) + 1) * block
        found = WorkloadCache(concurrency, per_sequence, samples)
        if best is None or found.max_tokens > best.max_tokens:
            best = found
    return best


def size_cache(config: BmConfig, needed: WorkloadCache | None) -> BmConfig:
    """``config`` with ``kv_cache.max_tokens`` set to what the dataset needs, unless the user set it."""
    if needed is None or config.kv_cache.max_tokens is not None:
        return config
    return replace(config, kv_cache=replace(config.kv_cache, max_tokens=needed.max_tokens))


def _prompt_len(row: object) -> int:
    ids = getattr(row, "input_ids", None)
    if ids is not None:
        return len(ids)
    return getattr(row, "num_prompt_tokens", None) or getattr(row, "input_len", 0)


def _samples(fields: dict) -> int:
    """Tables a request holds at once: its beams, or its samples (``n``)."""
    values = [fields.get("beam_width"), fields.get("num_return_sequences"), fields.get("n")]
    return max([1] + [v for v in values if isinstance(v, int) and not isinstance(v, bool)])
