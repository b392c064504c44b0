"""Hub ids (``org/name``) as vLLM users give them, resolved through the local Hugging Face cache and
never downloaded: a cached one runs as its snapshot and keeps its id as the model's name; a missing one
is refused before anything loads, naming the cache looked in and the ``--model DIR`` form. The cache is
a fake one under tmp_path, in the layout huggingface_hub reads (refs/main -> snapshots/<commit>)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import ConfigError, config_from_dict
from bm.runtime import load_model
from tests.conftest import hf_greedy

runner = CliRunner()
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_reference):
    """A Hugging Face cache holding ``bm-test/tiny`` (the embedded tiny model's weights), set as the
    cache through HF_HUB_CACHE; HF_HOME points elsewhere, to show which one is read."""
    cache = tmp_path / "hf-cache"
    repo = cache / "models--bm-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    tiny_reference.save_pretrained(repo / "snapshots" / COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    return cache


def test_a_cached_hub_id_runs_as_its_snapshot_and_keeps_its_id_as_the_name(
    tmp_path, hub_cache, tiny_reference
):
    prompt = [5, 17, 33, 9, 41]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": prompt, "max_tokens": 5}) + "\n")
    out = tmp_path / "out"
    args = ["run", str(prompts), "-o", str(out), "-q", "--ignore-eos", "--set", "model.device=cpu"]
    result = runner.invoke(app, [*args, "--model", "bm-test/tiny"])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "outputs.jsonl").read_text().splitlines()[0])
    assert record["output_ids"] == hf_greedy(tiny_reference, prompt, 5)
    assert json.loads((out / "summary.json").read_text())["model"] == "bm-test/tiny"
    # what bm.LLM("bm-test/tiny") builds and loads: the same resolution, the same name
    loaded = load_model(config_from_dict({"model": {"path": "bm-test/tiny", "device": "cpu"}}).model)
    assert loaded.name == "bm-test/tiny"


def test_a_hub_id_not_in_the_cache_is_refused_naming_the_cache_and_the_local_form(tmp_path, hub_cache):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6]}) + "\n")
    base = ["run", str(prompts), "-o", str(tmp_path / "out"), "-q", "--set", "model.device=cpu"]
    for flags, form in ((["--model", "bm-test/missing"], "--model DIR"),
                        (["--model", "bm-test/tiny", "--tokenizer", "bm-test/no-tok"], "--tokenizer DIR")):  # fmt: skip
        result = runner.invoke(app, [*base, *flags])
        assert result.exit_code == 2, result.output
        said = " ".join(result.stderr.split())
        assert str(hub_cache) in said and form in said and "never downloads" in said, said
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        config_from_dict({"model": {"path": "bm-test/missing"}})
