"""Model presets: names pick a model, a missing model file is one clear usage error, and the tiny random
model stays reachable by name (the real model's own test lives in test_real_model.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import ConfigError, load_config
from bm.runtime import presets

runner = CliRunner()


def test_a_preset_whose_package_is_missing_is_a_usage_error_naming_the_install(tmp_path, monkeypatch):
    missing = presets.GgufPreset("bm-no-such-pkg", "bm_no_such_pkg", "x.gguf", "pip install bm-no-such-pkg")
    monkeypatch.setitem(presets.PRESETS, "smollm2-135m", missing)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = runner.invoke(app, ["run", str(prompts), "--model", "smollm2-135m", "-o", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert "pip install bm-no-such-pkg" in " ".join(result.output.split())
    assert not presets.is_available("smollm2-135m")


def test_tiny_random_is_the_embedded_model_by_name(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "max_tokens": 3}\n')
    by_name, default = tmp_path / "a", tmp_path / "b"
    for out, extra in ((by_name, ["--model", "tiny-random"]), (default, [])):
        result = runner.invoke(
            app, ["run", str(prompts), "-o", str(out), "-q", "--set", "model.device=cpu", *extra]
        )
        assert result.exit_code == 0, result.output
    first, second = (json.loads((d / "outputs.jsonl").read_text()) for d in (by_name, default))
    assert first["output_ids"] == second["output_ids"]
    assert presets.is_available("tiny-random")


def test_a_preset_and_a_checkpoint_path_are_exclusive():
    with pytest.raises(ConfigError, match="exclusive"):
        load_config(None, {"model.preset": "tiny-random", "model.path": "/some/dir"})
    with pytest.raises(ConfigError, match="unknown preset 'gpt-5'"):
        load_config(None, {"model.preset": "gpt-5"})


def test_the_cache_follows_bm_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BM_CACHE_DIR", str(tmp_path / "cache"))
    assert presets.cache_root() == tmp_path / "cache"
