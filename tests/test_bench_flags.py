"""`vllm bench` and trtllm-bench flags on `bm bench`, `bm compare` and `bm sweep` (issue 54, item 3): each
maps onto bm's option or key, or stops the command with one message naming bm's equivalent, so a pasted
benchmark command runs or fails on the flag bm cannot honour, never on its second flag."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from bm.cli.bench import resolve_config
from bm.cli.main import app
from bm.cli.vllm_flags import BENCH_FLAGS, BENCH_HINTS
from bm.config import ConfigError

ROOT = get_command(app)
BENCHES = ["bench", "compare", "sweep"]
runner = CliRunner()


def parsed(command: str, args: list[str]) -> dict:
    """The parameters ``bm COMMAND ARGS`` reaches its function with (nothing runs)."""
    return ROOT.commands[command].make_context(command, list(args)).params


def configured(command: str, args: list[str]):
    params = parsed(command, args)
    return resolve_config(None, params["set_"], params, params["slo"])


def said(result) -> str:
    return " ".join(result.output.replace("│", " ").split())


# flag and value -> (section, key, the value the config holds)
CASES = [
    (["--random-input-len", "64"], ("bench", "input_len", 64)),
    (["--random-output-len", "16"], ("bench", "output_len", 16)),
    (["--random-range-ratio", "0.25"], ("bench", "range_ratio", 0.25)),
    (["--random-prefix-len", "8"], ("bench", "prefix_len", 8)),
    (["--custom-output-len", "32"], ("bench", "output_len", 32)),
    (["--dataset-path", "d.jsonl"], ("bench", "dataset", "d.jsonl")),
    (["--dataset", "d.jsonl"], ("bench", "dataset", "d.jsonl")),  # trtllm-bench's
    (["--result-dir", "res"], ("bench", "out_dir", "res")),
    (["--percentile-metrics", "ttft,tpot,itl"], ("bench", "percentile_metrics", ("ttft", "tpot", "itl"))),
    (["--metric-percentiles", "99"], ("bench", "metric_percentiles", (99.0,))),
    (["--metric-percentiles", "25,50,99.9"], ("bench", "metric_percentiles", (25.0, 50.0, 99.9))),
    (["--goodput", "ttft:500"], ("bench", "slo_ttft_ms", 500.0)),
    (["--goodput", "ttft:500", "tpot:50"], ("bench", "slo_tpot_ms", 50.0)),
    (["--goodput=e2el:2000"], ("bench", "slo_e2el_ms", 2000.0)),
    (["--num_requests", "12"], ("bench", "num_requests", 12)),
    (["--max_batch_size", "64"], ("engine", "max_batch_size", 64)),
    (["--max_num_tokens", "4096"], ("engine", "max_num_tokens", 4096)),
    (["--kv_cache_free_gpu_mem_fraction", "0.8"], ("kv_cache", "free_memory_fraction", 0.8)),
    (["--model_path", "configs"], ("model", "path", "configs")),
    # spelled as bm spells them (bm's options or their aliases): pinned so a rename cannot drop them
    (["--dataset-name", "random"], ("bench", "dataset_kind", "synthetic")),
    (["--dataset-name", "custom"], ("bench", "dataset_kind", "bm")),
    (["--num-prompts", "7"], ("bench", "num_requests", 7)),
    (["--request-rate", "4"], ("bench", "request_rate", 4.0)),
    (["--request-rate", "inf"], ("bench", "request_rate", None)),
    (["--max-concurrency", "3"], ("bench", "max_concurrency", 3)),
]


@pytest.mark.parametrize("command", BENCHES)
@pytest.mark.parametrize(("args", "expected"), CASES, ids=lambda c: c[0] if isinstance(c, list) else "")
def test_vllm_bench_and_trtllm_bench_flags_set_bms_keys(command, args, expected):
    section, key, value = expected
    assert getattr(getattr(configured(command, args), section), key) == value


@pytest.mark.parametrize("flag", ["--save-result", "--save-detailed", "--disable-detokenize", "--streaming"])
def test_a_flag_asking_for_what_bm_always_does_is_taken(flag):
    assert configured("bench", [flag]) == configured("bench", [])


def test_disable_tqdm_is_quiet():
    assert parsed("bench", ["--disable-tqdm"])["quiet"] is True


def test_goodput_takes_every_metric_word_and_leaves_the_dataset_argument():
    params = parsed("bench", ["--goodput", "ttft:500", "tpot:50", "data.jsonl"])
    assert params["slo"] == ["ttft:500", "tpot:50"] and str(params["dataset"]) == "data.jsonl"


def test_a_dataset_given_twice_is_refused():
    with pytest.raises(ConfigError, match="two datasets"):
        configured("bench", ["a.jsonl", "--dataset-path", "b.jsonl"])


@pytest.mark.parametrize("flag", sorted(BENCH_HINTS))
def test_a_benchmark_flag_bm_cannot_honour_names_bms_equivalent(flag):
    result = runner.invoke(app, ["bench", flag, "x"], env={"COLUMNS": "80"})
    assert result.exit_code == 2
    owner, hint = BENCH_HINTS[flag]
    assert f"{flag} is {owner}; {' '.join(hint.split())}" in said(result)
    assert "Possible options" not in said(result) and "No such option" not in said(result)


def test_a_benchmark_flag_on_bm_run_says_bm_run_does_not_take_it():
    result = runner.invoke(app, ["run", "p.jsonl", "--num_requests", "3"], env={"COLUMNS": "80"})
    assert result.exit_code == 2
    assert "--num_requests (trtllm-bench's) means --num-requests, which bm run does not take" in said(result)
    result = runner.invoke(app, ["run", "p.jsonl", "--save-result"], env={"COLUMNS": "80"})
    assert "--save-result is vLLM's benchmark flag, which bm run does not take" in said(result)


def test_every_mapped_benchmark_flag_targets_an_option_bench_takes():
    options = {name for p in ROOT.commands["bench"].params for name in getattr(p, "opts", ())}
    for name, flag in BENCH_FLAGS.items():
        assert name not in options, name  # never shadows one of bm's own
        assert flag.drop or flag.key is not None or flag.option in options, name


def test_a_pasted_vllm_bench_serve_command_runs_and_reports_what_it_asked(tmp_path):
    out = tmp_path / "res"
    words = shlex.split(
        "bench --model tiny-random --dataset-name random --random-input-len 24 --random-output-len 6 "
        "--random-range-ratio 0.5 --random-prefix-len 4 --num-prompts 5 --request-rate inf "
        "--max-concurrency 4 --seed 3 --percentile-metrics ttft,tpot,itl --metric-percentiles 25,99 "
        "--goodput ttft:100000 tpot:100000 --save-result --save-detailed --disable-tqdm"
    )  # a vllm bench serve command as pasted, its server flags left out
    result = runner.invoke(app, [*words, "--result-dir", str(out), "--set", "model.device=cpu"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["completed"] == 5 and results["max_concurrency"] == 4
    assert results["slo_ms"] == {"ttft": 100000.0, "tpot": 100000.0}
    assert results["request_goodput"] == results["request_throughput"]
    for key in ("p25_ttft_ms", "p99_ttft_ms", "p25_itl_ms", "p50_e2el_ms", "p90_queue_time_ms"):
        assert results[key] is not None, key  # asked percentiles beside bm's standard ones
    table = result.output[result.output.index("Latency (ms)") :]
    header = table.splitlines()[2]
    assert "p25" in header and "p99" in header and "p90" not in header
    assert "TTFT" in table and "E2EL │" not in table and "Queue │" not in table


def test_a_pasted_trtllm_bench_command_runs(tmp_path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"task_id": i, "input_ids": [5, 6, 7 + i], "output_tokens": 3}) + "\n"
            for i in range(4)
        )
    )
    out = tmp_path / "out"
    words = ["bench", "--model", "tiny-random", "--dataset", str(dataset), "--num_requests", "3"]
    words += ["--max_batch_size", "2", "--streaming", "--concurrency", "2", "--warmup", "1", "-o", str(out)]
    result = runner.invoke(app, [*words, "-q", "--set", "model.device=cpu"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["completed"] == 3 and results["total_output_tokens"] == 9
    assert results["config"]["engine"]["max_batch_size"] == 2


def test_percentile_metrics_are_the_latencies_bm_reports():
    from bm.bench.metrics import LATENCIES
    from bm.config.bench import LATENCY_METRICS

    assert LATENCY_METRICS == LATENCIES


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--percentile-metrics", "ttft,latency"], "unknown metric 'latency'; bm reports ttft, tpot, itl"),
        (["--metric-percentiles", "0"], "'0' is not a percentile in (0, 100]"),
        (["--metric-percentiles", "p99"], "'p99' is not a percentile"),
    ],
)
def test_a_bad_percentile_option_names_the_key_and_what_it_takes(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        configured("bench", args)
