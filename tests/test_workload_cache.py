"""The KV cache sized from the work where the work is known: a benchmark's dataset bounds what a run can
ever hold, and every engine of one ``bm compare`` (one per variant) or ``bm sweep`` gets the same cache."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.bench.sizing import size_cache, workload_cache
from bm.cli.main import app
from bm.config import load_config, resolve_engine
from bm.report.data import variant_dir
from bm.workloads import Workload
from bm.workloads.request import Row
from tests.conftest import compare_dataset

runner = CliRunner()


def _workload(lengths: list[tuple[int, int]], **fields) -> Workload:
    rows = [
        Row(
            where=f"line {i + 1}", index=i, input_ids=list(range(3, 3 + p)), max_tokens=n, fields=dict(fields)
        )
        for i, (p, n) in enumerate(lengths)
    ]
    return Workload(kind="bm", source="test", requests=rows)


def _config(**overrides):
    return resolve_engine(load_config(None, {"kv_cache.tokens_per_block": 16, **overrides}), "cpu")


def test_the_cache_holds_concurrency_times_the_longest_request_in_whole_blocks_plus_one():
    work = _workload([(100, 20), (30, 200), (7, 7)])
    needed = workload_cache(work, [_config()])
    # three requests at once (fewer than max_batch_size); longest prompt 100 + longest output 200
    # (a static batch pads to both), rounded up to 16-token blocks, plus one block
    assert needed.concurrency == 3
    assert needed.tokens_per_sequence == (-(-300 // 16) + 1) * 16
    assert needed.max_tokens == 3 * needed.tokens_per_sequence


def test_concurrency_is_capped_by_the_batch_and_the_client():
    work = _workload([(10, 10)] * 300)
    assert workload_cache(work, [_config()]).concurrency == 128  # CPU's max_batch_size
    assert workload_cache(work, [_config(**{"bench.max_concurrency": 5})]).concurrency == 5
    # the largest of several configs (a sweep's points) sizes the one cache they share
    both = workload_cache(work, [_config(**{"engine.max_batch_size": 8}), _config()])
    assert both.concurrency == 128


def test_samples_and_beams_multiply_the_tables():
    assert workload_cache(_workload([(10, 10)], num_return_sequences=3), [_config()]).samples == 3
    assert workload_cache(_workload([(10, 10)], beam_width=4), [_config()]).samples == 4


def test_a_cache_size_the_user_set_wins():
    needed = workload_cache(_workload([(10, 10)]), [_config()])
    mine = _config(**{"kv_cache.max_tokens": 4096})
    assert size_cache(mine, needed).kv_cache.max_tokens == 4096
    assert size_cache(_config(), needed).kv_cache.max_tokens == needed.max_tokens


def test_unresolved_budgets_are_refused_rather_than_guessed():
    with pytest.raises(ValueError, match="resolve_engine"):
        workload_cache(_workload([(10, 10)]), [load_config(None, {})])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return compare_dataset(tmp_path_factory.mktemp("data"))


def test_two_variants_of_one_compare_get_equal_kv_caches_sized_for_the_dataset(dataset, tmp_path):
    out = tmp_path / "cmp"
    args = ["compare", str(dataset), "-o", str(out), "--ignore-eos", "--quiet", "-s", "model.device=cpu"]
    result = runner.invoke(app, [*args, "--schemes", "inflight,inflight_fused"])
    assert result.exit_code == 0, result.output
    blocks = {}
    for name in ("inflight", "inflight_fused"):
        stats = [
            json.loads(line) for line in (variant_dir(out, name) / "stats.jsonl").read_text().splitlines()
        ]
        blocks[name] = {s["Max KV cache blocks"] for s in stats}
    assert blocks["inflight"] == blocks["inflight_fused"] and len(blocks["inflight"]) == 1
    # 6 requests of at most 24 + 5 tokens: one block of 32, plus one, each
    assert blocks["inflight"] == {6 * 2}
    doc = json.loads((out / "compare.json").read_text())
    assert doc["config"]["kv_cache"]["max_tokens"] == 6 * 2 * 32
    assert doc["config"]["engine"]["max_batch_size"] == 128  # resolved for the CPU, as it ran
