"""Typos at the edge (issue 26, defect 5): refused at once, with the closest known name suggested."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import ConfigError, model_override
from bm.suggest import closest, did_you_mean
from bm.workloads.jsonl import read_request_file
from tests.conftest import REPO
from tests.hang import HANG_S

runner = CliRunner()


def test_closest_names_the_near_spellings_best_first_and_nothing_when_far():
    assert closest("promt", ["prompt", "input_ids", "messages"]) == ["prompt"]
    assert closest("Prompt", ["prompt"]) == ["prompt"]
    assert closest("smollm2", ["smollm2-135m", "tiny-random"]) == ["smollm2-135m"]
    assert closest("zzzz", ["prompt", "messages"]) == []
    assert did_you_mean("zzzz", ["prompt"]) == ""
    assert did_you_mean("tempreature", ["temperature", "end_id"]) == "; did you mean 'temperature'?"


def test_an_unknown_field_suggests_the_closest_and_does_not_list_every_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"promt": "hi"}\n{"prompt": "hi", "colour": 1}\n')
    first, second = read_request_file(path)
    assert first.error == "line 1: unknown field 'promt'; did you mean 'prompt'?"
    # no close name: a pointer to the field reference, not the 39 names
    assert "unknown field 'colour'" in second.error and "docs/request-fields.md" in second.error
    assert "input_ids" not in second.error and len(second.error) < 120


@pytest.mark.parametrize("typo, preset", [("smollm2", "smollm2-135m"), ("tiny-randm", "tiny-random")])
def test_a_model_typo_is_refused_naming_the_closest_preset(typo, preset):
    with pytest.raises(ConfigError, match=rf"--model '{typo}': .*did you mean '{preset}'\?"):
        model_override(typo)


def test_model_names_resolve_to_a_preset_or_an_existing_directory(tmp_path):
    assert model_override("tiny-random") == ("model.preset", "tiny-random")
    assert model_override(str(tmp_path)) == ("model.path", str(tmp_path))


def test_bm_run_refuses_a_model_typo_before_torch_is_imported(tmp_path):
    """The refusal costs no model load: torch is never imported (a typo used to take seconds)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from bm.cli.main import app\n"
        f"r = CliRunner().invoke(app, ['run', {str(prompts)!r}, '--model', 'smollm2', '-o', {str(tmp_path / 'o')!r}])\n"
        "print(r.exit_code, 'torch' in sys.modules)\n"
        "print(r.output)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=HANG_S, check=True
    )
    code, torch_loaded = done.stdout.split("\n", 1)[0].split()
    assert (code, torch_loaded) == ("2", "False"), done.stdout + done.stderr
    assert "did you mean 'smollm2-135m'?" in done.stdout


def test_the_simulator_given_a_preset_points_to_its_shape_config(tmp_path):
    result = runner.invoke(
        app,
        ["bench", str(REPO / "datasets/bench/trtllm.jsonl"), "--executor", "sim", "--model", "smollm2-135m",
         "-o", str(tmp_path / "o"), "--quiet"],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--model-config" in result.output and "smollm2-135m-shape.json" in result.output


def test_a_config_key_typo_suggests_the_key():
    from bm.config import load_config

    with pytest.raises(ConfigError, match=r"engine\.max_batch: unknown key; did you mean 'max_batch_size'"):
        load_config(None, {"engine.max_batch": 3})
    with pytest.raises(
        ConfigError, match=r"kv_cahce\.max_tokens: unknown section; did you mean 'kv_cache'\?"
    ):
        load_config(None, {"kv_cahce.max_tokens": 3})
