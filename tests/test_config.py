"""Config validation: every bad input names the key and what is allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bm.config import ConfigError, config_from_dict, config_reference, load_config, parse_override
from bm.runtime.default_model import TINY_LLAMA_CONFIG
from tests.conftest import REPO


def test_defaults_follow_the_seed():
    cfg = config_from_dict({})
    assert cfg.kv_cache.free_memory_fraction == 0.9
    assert cfg.kv_cache.max_tokens is None
    assert cfg.engine.batching_scheme == "inflight_fused"
    assert cfg.engine.scheduler_policy == "guaranteed_no_evict"


def test_unknown_key_names_the_key_and_the_allowed_ones():
    with pytest.raises(
        ConfigError,
        match=r"engine\.max_batch: unknown key; did you mean 'max_batch_size'\?; allowed keys in engine: .*max_batch_size",
    ):
        config_from_dict({"engine": {"max_batch": 4}})


def test_unknown_section_is_rejected():
    with pytest.raises(ConfigError, match=r"kvcache: unknown section"):
        config_from_dict({"kvcache": {}})


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"engine": {"max_batch_size": 0}}, r"engine\.max_batch_size: must be >= 1"),
        ({"engine": {"max_num_tokens": "many"}}, r"engine\.max_num_tokens: expected an integer"),
        ({"kv_cache": {"free_memory_fraction": 1.5}}, r"kv_cache\.free_memory_fraction: must be in \(0, 1\]"),
        (
            {"engine": {"batching_scheme": "static"}},
            r"engine\.batching_scheme: unknown value 'static'; allowed: ",
        ),
        (
            {"model": {"dtype": "int8"}},
            r"model\.dtype: unknown value 'int8'; allowed: auto, bfloat16, float16, float32",
        ),
        ({"model": {"device": "tpu"}}, r"model\.device: unknown device 'tpu'"),
        (
            {"kv_cache": {"max_tokens": 4, "tokens_per_block": 8}},
            r"kv_cache\.max_tokens \(4\) is smaller than one block",
        ),
        ({"model": {"path": "a", "config": "b"}}, r"model\.path and model\.config are exclusive"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict(data)


def test_scheme_and_policy_accept_the_seed_spellings_case_insensitively():
    cfg = config_from_dict(
        {"engine": {"batching_scheme": "InflightFusedBatching", "scheduler_policy": "GUARANTEED_NO_EVICT"}}
    )
    assert cfg.engine.batching_scheme == "inflight_fused"
    assert cfg.engine.scheduler_policy == "guaranteed_no_evict"


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_file_with_overrides_and_relative_model_path(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    (tmp_path / "c.yaml").write_text("model:\n  config: m.json\nengine:\n  max_batch_size: 4\n")
    cfg = load_config(tmp_path / "c.yaml", dict([parse_override("engine.max_num_tokens=99")]))
    assert cfg.model.config == str(tmp_path / "m.json")
    assert (cfg.engine.max_batch_size, cfg.engine.max_num_tokens) == (4, 99)


def test_override_syntax_errors_are_explained():
    with pytest.raises(ConfigError, match=r"expected SECTION\.KEY=VALUE"):
        parse_override("max_batch_size")


def test_reference_lists_every_knob():
    text = config_reference()
    for key in ("tokens_per_block", "max_tokens", "free_memory_fraction", "max_batch_size", "max_num_tokens"):
        assert key in text


def test_shipped_yaml_configs_are_valid():
    paths = sorted((REPO / "configs").glob("*.yaml"))
    assert {p.name for p in paths} >= {"default.yaml", "bench.yaml"}
    for path in paths:
        config = load_config(path)  # raises on any invalid value
        # a model config a shipped file names resolves to a file that is there
        assert config.model.config is None or Path(config.model.config).exists(), path
    assert load_config(REPO / "configs" / "bench.yaml").engine.max_batch_size == 128


def test_shipped_tiny_llama_config_equals_the_embedded_default():
    shipped = json.loads((REPO / "configs" / "models" / "tiny-llama.json").read_text())
    assert shipped == TINY_LLAMA_CONFIG
