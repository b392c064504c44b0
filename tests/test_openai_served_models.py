"""What an OpenAI batch line's ``body.model`` may name, as vLLM serves it: the base model under its
served names (``--served-model-name``, default the model as named) or a PEFT adapter by its
``--lora-modules`` name; anything else is a 404 for that line, never another model's answer."""

from __future__ import annotations

import json

import pytest

from bm.config import ConfigError, config_from_dict, load_config
from tests.batch_cli import invoke_batch

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def completion(custom_id: str, **body) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": 4, **body}
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}


def output_lines(out) -> dict[str, dict]:
    lines = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    return {line["custom_id"]: line for line in lines}


def test_served_names_answer_an_unknown_model_gets_404_naming_the_names_and_the_flags(tmp_path):
    lines = [
        completion("first", model="my-model"),
        completion("alias", model="gpt-4o-mini"),
        completion("unnamed"),
        completion("unknown", model="llama-3-70b"),
    ]
    flags = ("--served-model-name", "my-model", "--served-model-name", "gpt-4o-mini")
    result, out = invoke_batch(tmp_path, lines, *flags)
    assert result.exit_code == 0, result.output
    got = output_lines(out)
    for custom_id, name in (("first", "my-model"), ("alias", "gpt-4o-mini"), ("unnamed", "my-model")):
        assert got[custom_id]["response"]["status_code"] == 200
        assert got[custom_id]["response"]["body"]["model"] == name  # the name that served it
    refused = got["unknown"]["response"]
    assert refused["status_code"] == 404
    error = refused["body"]["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    for needed in ("'llama-3-70b'", "'my-model'", "'gpt-4o-mini'", "--served-model-name", "--lora-modules"):
        assert needed in error["message"]


def test_the_model_as_named_is_the_default_served_name_and_the_embedded_model_is_said_once(tmp_path):
    lines = [completion("a", model="embedded tiny-llama"), completion("b"), completion("c", model="x")]
    result, out = invoke_batch(tmp_path, lines)
    assert result.exit_code == 0, result.output
    got = output_lines(out)
    assert got["a"]["response"]["body"]["model"] == "embedded tiny-llama"
    assert got["b"]["response"]["body"]["model"] == "embedded tiny-llama"
    assert got["c"]["response"]["status_code"] == 404
    said = " ".join(result.stderr.split())
    assert said.count("embedded random-weight tiny model") == 1
    assert "--model DIR" in said


def test_lora_modules_name_a_peft_directory_checked_before_the_model_loads(tmp_path):
    not_adapter = tmp_path / "not-adapter"
    not_adapter.mkdir()
    result, _out = invoke_batch(tmp_path, [completion("a")], "--lora-modules", f"sql={not_adapter}")
    assert result.exit_code == 2
    said = " ".join(result.stderr.split())
    assert "model.lora_modules.sql" in said and "adapter_config.json" in said
    assert "loading model" not in result.stdout
    result, _out = invoke_batch(tmp_path, [completion("a")], "--lora-modules", "sql")
    assert result.exit_code == 2
    assert "expected NAME=DIR" in " ".join(result.stderr.split())


def test_served_name_and_lora_module_config_keys_are_checked_as_the_flags_are(tmp_path):
    adapter = tmp_path / "sql-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cfg = config_from_dict({"model": {"served_model_name": "m", "lora_modules": {"sql": str(adapter)}}})
    assert cfg.model.served_names == ["m"] and cfg.model.lora_modules == {"sql": str(adapter)}
    with pytest.raises(ConfigError, match="served name of the base model"):
        config_from_dict({"model": {"served_model_name": ["sql"], "lora_modules": {"sql": str(adapter)}}})
    with pytest.raises(ConfigError, match="given twice"):
        config_from_dict({"model": {"served_model_name": ["m", "m"]}})
    with pytest.raises(ConfigError, match="not a directory"):
        config_from_dict({"model": {"lora_modules": {"sql": str(tmp_path / "missing")}}})
    # in a config file, an adapter directory is relative to the file, as model.path is
    config_file = tmp_path / "bm.yaml"
    config_file.write_text("model:\n  lora_modules:\n    sql: sql-lora\n")
    assert load_config(config_file).model.lora_modules == {"sql": str(adapter)}
