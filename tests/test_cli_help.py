"""Every ``--help`` reads at 80 columns, and ``-q`` silences transformers' progress bars."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from bm.cli.main import app
from tests.conftest import REPO
from tests.hang import HANG_S

runner = CliRunner()
ROOT = get_command(app)


def command_paths() -> list[list[str]]:
    """Every command and subcommand of ``bm``, as the words that reach it."""
    paths: list[list[str]] = [[]]
    for name, command in ROOT.commands.items():
        paths.append([name])
        paths += [[name, sub] for sub in getattr(command, "commands", {})]
    return paths


def help_at_80_columns(words: list[str]) -> str:
    result = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def flat(text: str) -> str:
    """The help as one line of words, panel borders removed, so wrapped phrases can be matched."""
    return " ".join(text.replace("│", " ").split())


@pytest.mark.parametrize("words", command_paths(), ids=lambda w: " ".join(w) or "bm")
def test_help_at_80_columns_cuts_no_option_name_or_text(words):
    text = help_at_80_columns(words)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    command = ROOT
    for word in words:
        command = command.commands[word]
    for param in command.params:
        longs = [name for name in getattr(param, "opts", []) if name.startswith("--")]
        if longs and not getattr(param, "hidden", False):  # hidden: another tool's name, or a protocol
            assert longs[0] in text, f"{longs[0]} missing from {' '.join(words)} --help"


def test_other_names_of_an_option_are_listed_and_still_accepted():
    text = flat(help_at_80_columns(["bench"]))
    assert "Also --num-prompts." in text and "Also --request-rate." in text and "Also --dataset-name." in text
    bench = ROOT.commands["bench"]
    num_requests = next(p for p in bench.params if p.name == "num_requests")
    assert {"--num-requests", "--num-prompts", "-n"} <= set(num_requests.opts)  # rendering changed nothing
    assert "--no-ignore-eos" in text  # the --no- forms are mentioned once, below the panels


def test_bench_help_is_a_page_not_a_reference():
    text = help_at_80_columns(["bench"])
    assert len(text.splitlines()) <= 120
    assert "see bm run --help" in text


def test_help_text_in_brackets_is_printed_not_read_as_markup():
    text = flat(help_at_80_columns(["run"]))
    assert "[bm-out/run-TIME]" in text


def test_quiet_run_prints_no_loading_weights_bar(tiny_reference, tmp_path):
    checkpoint = tmp_path / "ckpt"
    tiny_reference.save_pretrained(checkpoint)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7], "max_tokens": 2}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)

    def run(*extra: str) -> str:
        args = [sys.executable, "-m", "bm", "run", str(prompts), "--model", str(checkpoint), "--set", "kv_cache.max_tokens=256"]  # fmt: skip
        done = subprocess.run([*args, *extra], capture_output=True, text=True, env=env, timeout=HANG_S)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    assert "Loading weights" in run("-o", str(tmp_path / "loud"))  # the bar this test is about
    assert "Loading weights" not in run("-o", str(tmp_path / "quiet"), "-q")


def test_run_help_lists_only_the_config_sections_bm_run_reads():
    text = help_at_80_columns(["run"])
    for section in ("model:", "engine:", "kv_cache:"):
        assert f" {section}" in text
    for section in ("bench:", "sim:", "sweep:"):
        assert f" {section}" not in text
    assert "range_ratio" not in text and "slo" not in flat(text).split()
    # it was 297: every key of every section, blank lines between; 180 before the --ray flags (a line each),
    # 188 before --served-model-name and --lora-modules (two lines each) and their config keys (a line each),
    # 194 before --generation-config (two lines) and model.generation_config (two lines, and its rewrap),
    # 200 before kv_cache.dtype (a line), 201 before model.quantization (two lines) and vLLM's --quantization
    # in the list of vLLM flags (a line)
    assert len(text.splitlines()) <= 204


def test_config_defaults_in_help_print_as_plain_values():
    text = flat(help_at_80_columns(["run"]))
    assert "batching_scheme (default inflight_fused)" in text
    assert "enable_block_reuse (default false)" in text
    assert "dtype (default auto)" in text and "<BatchingScheme" not in text


def test_help_epilog_in_brackets_is_printed_not_read_as_markup():
    import typer

    from bm.cli.help import CompactHelp
    from bm.config import config_reference

    demo = typer.Typer()

    @demo.command(cls=CompactHelp, epilog=config_reference(["bench"]))
    def only(flag: bool = typer.Option(False, "--flag")) -> None:
        """A command whose epilog holds the bench keys."""

    result = runner.invoke(demo, ["--help"], env={"COLUMNS": "80"})
    assert "[len*(1-r), len*(1+r)]" in flat(result.output)
