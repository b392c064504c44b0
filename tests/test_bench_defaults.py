"""`bm bench`'s defaults are those of the tools users compare it with (issue 54, item 3): a dataset's output
lengths are produced exactly, past the model's end token, as `vllm bench throughput` and trtllm-bench
produce them; `--respect-eos` keeps the old behaviour and a run that falls short says by how much."""

from __future__ import annotations

import json

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import ConfigError, load_config, parse_override

runner = CliRunner()
ROOT = get_command(app)
EOS = 2  # the embedded model's end token (its byte tokenizer's eos)


def bench(*args):
    return runner.invoke(app, ["bench", *map(str, args), "--quiet", "--set", "model.device=cpu"])


def configured(command: str, args: list[str]):
    """The config ``bm COMMAND ARGS`` would run with (nothing runs)."""
    params = ROOT.commands[command].make_context(command, list(args)).params
    from bm.cli.bench import resolve_config

    return resolve_config(None, params["set_"], params, params["slo"])


@pytest.fixture
def eos_rows(tmp_path):
    """Rows whose every greedy token is the end token (a +100 logit bias on it): each would stop after
    one token if EOS ended it."""
    path = tmp_path / "eos.jsonl"
    rows = [
        {"input_ids": [5, 6, 7 + i], "max_tokens": 4 + i, "logit_bias": {str(EOS): 100}} for i in range(3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_dataset_gets_exactly_its_output_lengths_by_default_past_the_end_token(tmp_path, eos_rows):
    out = tmp_path / "out"
    result = bench(eos_rows, "-o", out)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["bench"]["ignore_eos"] is True
    assert results["total_output_tokens"] == results["requested_output_tokens"] == 4 + 5 + 6
    assert results["output_tokens_short"] == 0 and results["num_requests_short"] == 0
    assert "short" not in result.output


def test_respect_eos_stops_at_the_end_token_and_says_how_many_tokens_short(tmp_path, eos_rows):
    out = tmp_path / "out"
    result = bench(eos_rows, "--respect-eos", "-o", out)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["total_output_tokens"] == 3  # one token each: the end token itself
    assert results["requested_output_tokens"] == 15
    assert results["output_tokens_short"] == 12 and results["num_requests_short"] == 3
    assert results["short_finish_reasons"] == {"end_id": 3}
    said = " ".join(result.output.split())
    assert "output fell 12 tokens short of the 15 asked: 3 of 3 completed requests" in said
    assert "--respect-eos" in said


@pytest.mark.parametrize(
    ("args", "ignore_eos"),
    [([], True), (["--respect-eos"], False), (["--ignore-eos"], True), (["--no-ignore-eos"], False)],
)
@pytest.mark.parametrize("command", ["bench", "compare", "sweep"])
def test_bench_compare_and_sweep_share_the_ignore_eos_default_and_its_flags(command, args, ignore_eos):
    assert configured(command, args).bench.ignore_eos is ignore_eos


def test_a_config_file_can_still_respect_eos(tmp_path):
    path = tmp_path / "bench.yaml"
    path.write_text("bench:\n  ignore_eos: false\n")
    assert load_config(path).bench.ignore_eos is False
    assert load_config(None).bench.ignore_eos is True


def test_the_simulator_refuses_respect_eos_naming_the_fix():
    overrides = dict(
        parse_override(text)
        for text in (
            "engine.executor=sim",
            "model.config=configs/models/bench-llama-15m.json",
            "bench.ignore_eos=false",
        )
    )
    with pytest.raises(ConfigError, match="drop --respect-eos"):
        load_config(None, overrides)
