"""benchmarks/gpu_check.py runs on CPU (``--device cpu --small``), so the device check cannot rot."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_gpu_check_runs_on_cpu_small_and_writes_one_json_file(tmp_path, monkeypatch):
    monkeypatch.delenv("BM_ATTENTION", raising=False)
    out = tmp_path / "gpu_check.json"
    report = load_benchmark("gpu_check").main(["--device", "cpu", "--small", "--no-hf-cb", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    oracle = report["oracle_fp32"]
    assert oracle["equal_requests"] == oracle["requests"] > 0
    assert report["bf16"]["tokens"] > 0 and report["bf16"]["max_logit_diff"] >= 0
    small = report["throughput"]["small"]
    assert small["bm"]["output_tokens"] == small["hf-generate"]["output_tokens"] > 0
    assert small["startup_s"] > 0 and small["bm_first_run"]["output_tokens"] == small["bm"]["output_tokens"]
    assert small["roofline"]["fraction_of_roofline"] > 0
    # the same steps queued, tokens read once at the end (the host ahead of the device, as under overlap)
    assert small["roofline"]["queued_step_ms"] > 0 and small["roofline"]["fraction_of_roofline_queued"] > 0
    assert "small_at_least_50%_of_roofline" in report["goals"]
    assert report["goals"]["bm_equals_hf_fp32_on_every_request"]
    # what users run, through the CLI in subprocesses (benchmarks/gpu_user_path.py)
    cli = report["cli_run"]
    assert cli["finished"] and cli["output_tok_s"] > 0 and cli["num_iterations"] > 0
    assert cli["engine"]["enable_chunked_context"] is True  # the defaults, as a user gets them
    assert cli["startup"]["total_s"] >= cli["startup"]["load_model_s"] > 0
    assert cli["sim"]["h100-sxm"]["finished"] and cli["sim"]["h100-sxm"]["predicted_over_real"] > 0
    bench = report["bench_harness_workload"]
    assert bench["finished"] and bench["bench_over_harness"] > 0
    assert report["load_8b"]["finished"] and report["load_8b"]["parameters"] > 0
    compare = report["compare"]
    assert compare["finished"] and compare["equal_caches"]
    assert report["goals"]["cli_run_finishes"] and report["goals"]["compare_variants_get_equal_caches"]


def test_gpu_check_runs_only_the_sections_asked_and_names_only_their_goals(tmp_path, monkeypatch):
    """A short second device run: --sections picks what runs; goals come from what ran (no KeyError)."""
    monkeypatch.delenv("BM_ATTENTION", raising=False)
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--small", "--no-hf", "--sections", "bf16,compare", "--out", str(out)]
    report = load_benchmark("gpu_check").main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert "oracle_fp32" not in report and "throughput" not in report and "cli_run" not in report
    assert report["bf16"]["tokens"] > 0 and report["compare"]["finished"]
    assert report["goals"] == {"compare_variants_get_equal_caches": True}


def test_issue_40s_goals_are_named_per_shape_and_the_steady_floor_per_kind_of_gpu():
    """70% of the roofline for the 1B shape, 60% for SmolLM2's, for the bare and the queued step each; the
    steady floor only on an H100 or H200."""
    check = load_benchmark("gpu_check")
    roofline = {"fraction_of_roofline": 0.65, "fraction_of_roofline_queued": 0.72}
    figures = {"roofline": roofline, "bm": {"output_tok_s": 23_000}}
    report = {"environment": {"device": "NVIDIA H100 80GB HBM3"},
              "throughput": {"llama-1b": figures, "smollm2-135m": figures}}  # fmt: skip
    goals = check.goals(report)
    assert goals["llama-1b_at_least_70%_of_roofline"] is False  # the bare step, named apart
    assert goals["llama-1b_queued_step_at_least_70%_of_roofline"] is True
    assert goals["smollm2-135m_at_least_60%_of_roofline"] is True
    assert goals["llama-1b_steady_at_least_22000_output_tok_s"] is True
    assert not any(k.startswith("smollm2-135m_steady") for k in goals)
    report["environment"]["device"] = "NVIDIA H200"
    assert check.goals(report)["llama-1b_steady_at_least_26300_output_tok_s"] is False
    report["environment"]["device"] = "NVIDIA A100-SXM4-80GB"
    assert not any("steady" in k for k in check.goals(report))


def test_gpu_check_runs_its_throughput_with_fp8_weights_and_an_fp8_cache(tmp_path):
    """The device run's quantized part (``--quantization fp8 --kv-cache-dtype fp8_e4m3``): every decoder
    linear holds e4m3 codes, the cache is fp8, and the roofline counts their bytes."""
    out = tmp_path / "gpu_check_fp8.json"
    args = [
        "--device",
        "cpu",
        "--small",
        "--no-hf",
        "--no-hf-cb",
        "--sections",
        "throughput",
        "--out",
        str(out),
    ]
    report = load_benchmark("gpu_check").main(
        [*args, "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]
    )
    small = report["throughput"]["small"]
    assert (
        small["weights"] == {"quantization": "fp8", "quantized_linears": 7 * 2}
        and small["kv_cache_dtype"] == "fp8_e4m3"
    )
    assert small["bm"]["output_tokens"] > 0
    roofline = small["roofline"]
    full = load_benchmark("gpu_check").main([*args, "--out", str(tmp_path / "full.json")])["throughput"][
        "small"
    ]["roofline"]
    assert roofline["kv_bytes"] * 4 == full["kv_bytes"]  # float32's 4 bytes a value, fp8's 1
    assert roofline["weight_bytes"] < full["weight_bytes"]
