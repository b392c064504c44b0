"""Issue 53: ``bm bench``'s memory grew with the run's length (the whole Azure conversation trace through
the simulator rose from 1.4 to 2.4 GB over 511,872 iterations): every stats row stayed as a dict and
every record with its token gaps. A run now streams them to its journal and keeps tallies of a few
bytes per request and per iteration, and its metrics are exactly those of a run that kept everything."""

from __future__ import annotations

import gc
import json
import math
import random
import tracemalloc

import pandas as pd
import pytest

from bm.bench import engine_metrics, records_frame, run_bench, run_metrics
from bm.bench.metrics import RECORD_COLUMNS
from bm.bench.simulated import load_sim_model
from bm.bench.tally import RequestTally, StatsTally
from bm.config import load_config
from bm.workloads import arrival_times, load_workload
from tests.conftest import make_config
from tests.recorder import Recorder

TINY = {
    "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 512, "max_position_embeddings": 4096,
}  # fmt: skip
SLO = {"bench.slo_ttft_ms": 40.0, "bench.slo_tpot_ms": 8.0, "bench.slo_e2el_ms": 400.0}


def sim_run(tmp_path, recorder: Recorder | None = None, **sets):
    """A simulated run and what its journal got; a small cache under max_utilization pauses requests."""
    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY))
    overrides = {
        "engine.executor": "sim", "sim.hardware": "a100-80gb", "model.config": str(model_config),
        "bench.dataset_kind": "synthetic", "bench.num_requests": 80, "bench.input_len": 96,
        "bench.output_len": 40, "bench.range_ratio": 0.9, "bench.request_rate": 200.0,
        "engine.scheduler_policy": "max_utilization", "kv_cache.max_tokens": 1024,
        "kv_cache.tokens_per_block": 16,
    } | SLO | sets  # fmt: skip
    config = load_config(None, overrides)
    model = load_sim_model(config)
    workload = load_workload(config.bench, vocab_size=model.vocab_size, encode=None)
    recorder = Recorder() if recorder is None else recorder
    return run_bench(config, model, workload, journal=recorder), recorder


class Discard(Recorder):
    """A journal that writes nowhere (the run's files, as far as memory goes)."""

    def add_stats(self, rows):
        pass

    def add_requests(self, records):
        pass


def kept_everything(result, recorder: Recorder) -> dict:
    """The metrics as a run that kept every record and stats row computed them (the frames, before the
    tallies): the reference the streamed run must equal."""
    frame = records_frame(recorder.in_order())
    bench = result.config.bench
    slo = {"ttft": bench.slo_ttft_ms, "tpot": bench.slo_tpot_ms, "e2el": bench.slo_e2el_ms}
    stats = pd.DataFrame.from_records(recorder.stats)
    return run_metrics(frame, result.duration_s, slo) | engine_metrics(stats, frame)


def assert_same(streamed: dict, reference: dict) -> None:
    """Every reference metric present and equal to the last bit (NaN and None alike: both mean none)."""
    for key, value in reference.items():
        mine = streamed[key]
        if isinstance(value, float) and math.isnan(value):
            assert mine is None or math.isnan(mine), key
        else:
            assert mine == value and type(mine) is type(value), (key, mine, value)


def test_a_simulated_run_reports_exactly_the_metrics_a_run_that_kept_every_record_reports(tmp_path):
    result, recorder = sim_run(tmp_path)
    reference = kept_everything(result, recorder)
    assert reference["num_paused_requests"] > 0 and reference["request_goodput"] is not None
    assert reference["completed"] == 80 and reference["num_iterations"] > 200
    assert_same(result.metrics, reference)


def test_a_real_run_reports_exactly_the_metrics_a_run_that_kept_every_record_reports(tiny_model):
    section = {"dataset_kind": "synthetic", "num_requests": 12, "input_len": 8, "output_len": 6,
               "range_ratio": 0.5, "request_rate": 400.0, "ignore_eos": True, "slo_ttft_ms": 50.0}  # fmt: skip
    config = make_config(bench=section)
    workload = load_workload(config.bench, vocab_size=tiny_model.vocab_size, encode=None)
    recorder = Recorder()
    result = run_bench(config, tiny_model, workload, arrival_times(workload, config.bench), journal=recorder)
    reference = kept_everything(result, recorder)
    assert reference["completed"] == 12 and reference["num_iterations"] > 0
    assert_same(result.metrics, reference)


def random_record(rng: random.Random, index: int) -> dict:
    """A record as request_record makes one: completed (some with one token), failed or cancelled."""
    record = dict.fromkeys(RECORD_COLUMNS) | {"index": index, "input_tokens": rng.randint(1, 900)}
    record |= {"num_pauses": rng.choice((0, 0, 0, 2)), "itl_ms": [], "output_tokens": 0}
    fate = rng.random()
    if fate < 0.1:
        return record | {"ok": False, "finish_reason": "error", "error": "boom"}
    if fate < 0.15:
        return record | {"ok": False, "finish_reason": "cancelled", "queue_time_ms": rng.random()}
    gaps = [rng.expovariate(0.1) for _ in range(rng.choice((0, rng.randint(1, 300))))]
    ttft = rng.expovariate(0.01)
    e2el = ttft + sum(gaps)
    return record | {
        "ok": True, "finish_reason": "length", "output_tokens": len(gaps) + 1, "itl_ms": gaps,
        "ttft_ms": ttft, "e2el_ms": e2el, "tpot_ms": (e2el - ttft) / len(gaps) if gaps else None,
        "queue_time_ms": rng.random() * 5,
    }  # fmt: skip


def test_the_request_tally_equals_the_frame_to_the_last_bit_on_records_given_in_finishing_order():
    """Float means are pairwise sums, so a value's place matters: thousands of values of every order of
    magnitude, given out of order, must give the frame's figures exactly."""
    rng = random.Random(7)
    records = [random_record(rng, i) for i in range(3000)]
    tally = RequestTally(len(records))
    for record in rng.sample(records, len(records)):  # finishing order
        tally.add(record)
    tally.close()
    slo = {"ttft": 30.0, "tpot": 10.0, "e2el": None}
    assert sum(len(r["itl_ms"]) for r in records) > 100_000
    assert_same(tally.metrics(12.5, slo), run_metrics(records_frame(records), 12.5, slo))
    with pytest.raises(ValueError, match="after the run was over"):
        tally.add(records[0])


def test_the_stats_tally_equals_the_frame_to_the_last_bit():
    rng = random.Random(3)
    rows = []
    for i in range(20_000):
        blocks = rng.choice((0, 977, 977, 977))  # no cache at all: utilization NaN, as in the frame
        rows.append(
            {
                "Iteration Counter": i, "Scheduled Requests": rng.randint(1, 64),
                "Total Context Tokens": rng.randint(0, 8192), "Total Generation Tokens": rng.randint(0, 64),
                "Computed Tokens": rng.randint(0, 9000), "Padded Context Tokens": rng.randint(0, 9),
                "Empty Generation Slots": rng.randint(0, 3), "Max KV cache blocks": blocks,
                "Used KV cache blocks": rng.randint(0, blocks), "Iteration Latency (ms)": round(rng.expovariate(0.05), 3),
                "Paused Requests": rng.randint(0, 4), "Draft Steps": rng.randint(0, 2),
                "Draft Tokens": rng.randint(0, 6), "Accepted Draft Tokens": rng.randint(0, 3),
            }
        )  # fmt: skip
    tally = StatsTally()
    for row in rows:
        tally.add(row)
    frame = pd.DataFrame({"num_pauses": [0, 3, 1]})
    assert_same(tally.metrics(2, 4), engine_metrics(pd.DataFrame.from_records(rows), frame))
    assert tally.nbytes() == 16 * len(rows)


def retained_bytes(tmp_path, output_len: int) -> tuple[int, int, int]:
    """Python memory a finished simulated run still holds with its result (tracemalloc, after a
    collection), with the run's iteration and output token counts."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result, _ = sim_run(tmp_path, Discard(), **{"bench.output_len": output_len, "bench.range_ratio": 0.0})
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held, result.metrics["num_iterations"], result.metrics["total_output_tokens"]


def test_a_run_holds_a_few_bytes_per_iteration_and_token_not_its_stats_rows_and_records(tmp_path):
    """The same requests with ten times the output: the extra memory the longer run still holds is the
    tallies' 16 bytes per iteration and 8 per token gap (and slack), not a dict per stats row (about
    2.3 KB) and a float object per gap, as when the run kept them."""
    retained_bytes(tmp_path, 40)  # once first: what the first run of a process caches is not the run's
    short, short_iterations, short_tokens = retained_bytes(tmp_path, 40)
    long, long_iterations, long_tokens = retained_bytes(tmp_path, 400)
    iterations, tokens = long_iterations - short_iterations, long_tokens - short_tokens
    assert iterations > 2000
    assert long - short < 2 * (16 * iterations + 8 * tokens) + 64_000, (long - short, iterations, tokens)
