"""``--resume`` refuses another run's directory (issue 26, defect 1): the model, the config keys that
change outputs, the run options and bm's version are recorded in run.json and checked before the model
loads, so a finished record of one model is never mixed with another's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import bm
from bm.cli.main import app
from bm.runfiles.identity import NOT_IN_DIGEST, run_identity, run_options
from tests.conftest import REPO, make_config

runner = CliRunner()
TINY_SHAPE = REPO / "configs" / "models" / "tiny-llama.json"


def bm_run(prompts, out, *extra):
    return runner.invoke(
        app,
        ["run", str(prompts), "-o", str(out), "-q", "--max-tokens", "2", "--set", "model.device=cpu", *extra],
    )


@pytest.fixture
def finished_run(tmp_path):
    """A run of the embedded tiny model whose directory a later command tries to resume."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [5 + i, 6, 7]}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    assert bm_run(prompts, out).exit_code == 0
    return prompts, out


def test_run_json_records_the_model_config_digest_version_and_the_run_seed(finished_run):
    _prompts, out = finished_run
    identity = json.loads((out / "run.json").read_text())
    assert identity["model"] == "embedded tiny-llama" and identity["loaded"]
    assert identity["bm_version"] == bm.__version__ and isinstance(identity["seed"], int)  # random
    assert identity["options"]["--max-tokens"] == 2
    assert len(identity["config_sha256"]) == 64 and identity["config"]["model.dtype"] == "auto"
    assert "engine.max_batch_size" in identity["config_not_in_digest"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--model", "smollm2-135m"], "the model changed: embedded tiny-llama -> preset smollm2-135m"),
        (["--model-config", str(TINY_SHAPE)], "the model changed: embedded tiny-llama -> config "),
        (["--set", "engine.max_seq_len=64"], "the config changed: engine.max_seq_len null -> 64"),
        (["--set", "model.dtype=bfloat16"], 'model.dtype "auto" -> "bfloat16"'),
        (["--ignore-eos"], "the run options changed: --ignore-eos false -> true"),
        (["--tool-call-parser", "hermes"], "the run options changed: --tool-call-parser"),
    ],
)
def test_resume_with_another_model_or_config_is_refused_before_the_model_loads(finished_run, extra, named):
    prompts, out = finished_run
    before = (out / "outputs.jsonl").read_text()
    result = bm_run(prompts, out, "--resume", *extra)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert named in message and "use a new -o directory or --overwrite" in message
    assert "loading model" not in result.output  # refused before the load: it cost nothing
    assert (out / "outputs.jsonl").read_text() == before


def test_resume_may_change_what_only_decides_speed(finished_run):
    prompts, out = finished_run
    result = bm_run(
        prompts, out, "--resume", "--set", "engine.max_batch_size=2", "--set", "kv_cache.tokens_per_block=8"
    )
    assert result.exit_code == 0, result.output


def test_resume_into_a_directory_that_records_no_model_is_refused(finished_run):
    prompts, out = finished_run
    old = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({k: old[k] for k in ("prompts", "prompts_sha256")}))
    result = bm_run(prompts, out, "--resume")
    assert result.exit_code == 2 and "does not record the model" in " ".join(result.output.split())


def test_the_config_digest_ignores_speed_keys_and_sees_output_keys(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    options = run_options(64, False, None)

    def digest(**sections):
        return run_identity(prompts, make_config(**sections), options)["config_sha256"]

    base = digest()
    assert digest(engine={"max_batch_size": 3, "scheduler_policy": "max_utilization"}) == base
    assert digest(kv_cache={"enable_block_reuse": True}, model={"prepack": "off"}) == base
    assert digest(engine={"max_beam_width": 2}) != base
    assert digest(kv_cache={"max_attention_window": 64}) != base
    config = make_config().to_dict()  # every excluded name is a real section or key (no typo hides one)
    for name in NOT_IN_DIGEST:
        section, _, key = name.partition(".")
        assert section in config and (not key or key in config[section]), name
