"""vLLM's engine flags on bm's commands: each maps onto the bm config key of the same knob, the same way on
``bm run``, ``bm bench``, ``bm compare`` and ``bm sweep``; a vLLM flag bm has no knob for is refused with
the bm equivalent named, never with click's "Possible options" (which pointed --max-model-len at
--max-tokens)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from bm.cli.main import app
from bm.cli.vllm_flags import VLLM_FLAGS, VLLM_HINTS
from bm.config import load_config, parse_override

ROOT = get_command(app)
COMMANDS = ["run", "bench", "compare", "sweep"]
runner = CliRunner()


def parsed(command: str, args: list[str]) -> dict[str, Any]:
    """The parameters ``bm COMMAND ARGS`` reaches its function with (nothing runs)."""
    positional = ["prompts.jsonl"] if command == "run" else []
    return ROOT.commands[command].make_context(command, [*positional, *args]).params


def configured(command: str, args: list[str]):
    """The config ``bm COMMAND ARGS`` would run with: its ``--set`` overrides, loaded and validated."""
    return load_config(None, dict(parse_override(text) for text in parsed(command, args)["set_"]))


# flag and value -> (section, key, the value the config holds)
CASES = [
    (["--max-model-len", "512"], ("engine", "max_seq_len", 512)),
    (["--gpu-memory-utilization", "0.5"], ("kv_cache", "free_memory_fraction", 0.5)),
    (["--dtype", "float16"], ("model", "dtype", "float16")),
    (["--dtype=bfloat16"], ("model", "dtype", "bfloat16")),
    (["--max-num-seqs", "8"], ("engine", "max_batch_size", 8)),
    (["--max-num-batched-tokens", "1024"], ("engine", "max_num_tokens", 1024)),
    (["--enable-prefix-caching"], ("kv_cache", "enable_block_reuse", True)),
    (["--no-enable-prefix-caching"], ("kv_cache", "enable_block_reuse", False)),
    (["--enable-chunked-prefill"], ("engine", "enable_chunked_context", True)),
    (["--enforce-eager"], ("model", "cuda_graphs", "off")),
    (["--block-size", "16"], ("kv_cache", "tokens_per_block", 16)),
    (["--tokenizer", "tok-dir"], ("model", "tokenizer", "tok-dir")),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("args", "expected"), CASES, ids=lambda c: c[0] if isinstance(c, list) else "")
def test_vllm_flags_map_to_bm_config(command, args, expected):
    section, key, value = expected
    cfg = configured(command, args)
    assert getattr(getattr(cfg, section), key) == value


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("words", [["--tensor-parallel-size", "2"], ["-tp", "2"], ["--tp", "2"]])
def test_tensor_parallel_size_and_tp_set_the_tensor_parallel_option_on_every_command(command, words):
    assert parsed(command, words)["tensor_parallel"] == 2


@pytest.mark.parametrize("command", ["run", "bench"])
def test_data_parallel_size_sets_data_parallel_where_the_command_has_replicas(command):
    assert parsed(command, ["--data-parallel-size", "3"])["data_parallel"] == 3
    assert parsed(command, ["-dp", "2"])["data_parallel"] == 2


def test_every_vllm_flag_names_a_real_config_key():
    cfg = load_config(None, {}).to_dict()
    for name, flag in VLLM_FLAGS.items():
        if flag.key is not None:
            section, key = flag.key.split(".")
            assert key in cfg[section], name


def test_a_vllm_flag_with_a_bad_value_is_refused_naming_the_bm_key(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    result = runner.invoke(app, ["run", str(prompts), "--max-model-len", "-5", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "engine.max_seq_len" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size", "--trust-remote-code"])
def test_a_vllm_flag_bm_cannot_honour_names_the_bm_equivalent(flag):
    result = runner.invoke(app, ["run", "prompts.jsonl", flag, "x"], env={"COLUMNS": "80"})
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())
    assert "Possible options" not in text
    assert f"{flag} is vLLM's" in text
    assert " ".join(VLLM_HINTS[flag].split()) in text


def test_mapped_flag_hint_names_its_bm_key_not_a_lookalike_option():
    # click alone told a vLLM user --max-model-len was perhaps --max-tokens (another knob)
    result = runner.invoke(app, ["run", "prompts.jsonl", "--max-model-len"], env={"COLUMNS": "80"})
    assert result.exit_code == 2
    assert "--max-model-len needs a value (it sets engine.max_seq_len)" in result.output
    assert "--max-tokens" not in result.output


def test_a_vllm_flag_the_command_cannot_take_says_so():
    result = runner.invoke(app, ["compare", "-dp", "2"], env={"COLUMNS": "80"})
    assert result.exit_code == 2
    assert "-dp (vLLM's) means --data-parallel, which bm compare does not take" in result.output


def test_help_lists_the_vllm_flags_a_command_takes():
    text = " ".join(runner.invoke(app, ["run", "--help"], env={"COLUMNS": "80"}).output.split())
    assert "--max-model-len (engine.max_seq_len)" in text
    assert "--tensor-parallel-size/-tp (--tensor-parallel)" in text


def test_vllms_one_flag_many_values_form_of_served_names_and_lora_modules_becomes_repeated_flags(tmp_path):
    """vLLM writes ``--served-model-name a b`` and ``--lora-modules x=DIR y=DIR``; bm's options repeat. A
    served name list stops at the next option or at an existing file (bm run's prompts file)."""
    from bm.cli.vllm_flags import translate_vllm_flags

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("")
    options = {"--served-model-name", "--lora-modules", "--seed"}
    args = ["--served-model-name", "a", "b", str(prompts), "--lora-modules", "x=/p", "y=/q", "--seed", "1"]
    assert translate_vllm_flags(args, "run", options) == [
        *["--served-model-name", "a", "--served-model-name", "b", str(prompts)],
        *["--lora-modules", "x=/p", "--lora-modules", "y=/q", "--seed", "1"],
    ]
    assert translate_vllm_flags(["--lora-modules", "bad"], "run", options) == ["--lora-modules", "bad"]
    assert translate_vllm_flags(["--served-model-name"], "run", options) == ["--served-model-name"]
