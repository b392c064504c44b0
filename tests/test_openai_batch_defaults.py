"""An OpenAI batch line's sampling defaults are vLLM run-batch's: the checkpoint's generation_config.json
where it has values, else temperature 1.0 (``--generation-config auto|vllm|DIR`` picks the file as
vLLM's flag does); bm's own lines keep their greedy default; ``--seed`` makes sampled lines repeat."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import ConfigError, ModelConfig, load_config
from bm.runfiles.openai_batch import iter_batch_file
from bm.runfiles.served_models import ServedModels
from bm.workloads.jsonl import iter_request_file
from tests.conftest import hf_greedy, reference_model

runner = CliRunner()
COMPLETIONS = "/v1/completions"
PROMPT = [5, 17, 33, 9, 41]
MAX_TOKENS = 6
GENERATION = {"temperature": 0.7, "top_k": 20}


def line(custom_id: str, **body) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, **body}
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}


@pytest.fixture(scope="module")
def checkpoint(tiny_model, tmp_path_factory):
    """The tiny model saved as a checkpoint whose generation_config.json asks for temperature 0.7 and
    top_k 20 (as Qwen's and Llama's checkpoints ship sampling defaults)."""
    folder = tmp_path_factory.mktemp("sampling_ckpt")
    reference_model(tiny_model).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return folder


def fields_of(path, model: ModelConfig) -> dict[str, dict]:
    """Each batch line's engine fields (as the run would send them), by custom_id."""
    return {x.custom_id: x.parsed.fields for x in iter_batch_file(path, ServedModels.of(model))}


def write_batch(tmp_path, lines) -> object:
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_a_line_without_temperature_takes_the_checkpoints_generation_config_and_vllm_mode_temperature_one(
    tmp_path, checkpoint
):
    path = write_batch(tmp_path, [line("implicit"), line("greedy", temperature=0), line("nulls", top_k=None)])
    auto = fields_of(path, ModelConfig(path=str(checkpoint)))
    assert auto["implicit"]["temperature"] == 0.7 and auto["implicit"]["runtime_top_k"] == 20
    assert auto["nulls"]["runtime_top_k"] == 20  # a null is no value: the default fills it, as vLLM reads it
    assert auto["greedy"]["temperature"] == 0  # the line's own value wins
    vllm = fields_of(path, ModelConfig(path=str(checkpoint), generation_config="vllm"))
    assert vllm["implicit"]["temperature"] == 1.0 and "runtime_top_k" not in vllm["implicit"]
    # no checkpoint file at all (the embedded model): vLLM's temperature 1.0 still, not bm's greedy
    assert fields_of(path, ModelConfig())["implicit"]["temperature"] == 1.0
    # a directory given by name is read instead of the checkpoint's
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "max_new_tokens": 3}))
    named = fields_of(path, ModelConfig(path=str(checkpoint), generation_config=str(other)))
    assert named["implicit"]["temperature"] == 1.0 and named["implicit"]["runtime_top_p"] == 0.5


def test_bm_lines_keep_their_greedy_default(tmp_path, checkpoint):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"input_ids": PROMPT, "max_tokens": 4}) + "\n")
    (row,) = list(iter_request_file(path))
    assert "temperature" not in row.fields and "runtime_top_k" not in row.fields


def test_max_new_tokens_is_the_length_of_a_line_that_gives_no_max_tokens(tmp_path):
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    lines = [line("open"), line("given", max_tokens=5)]
    del lines[0]["body"]["max_tokens"]
    by_id = {
        x.custom_id: x.parsed
        for x in iter_batch_file(
            write_batch(tmp_path, lines), ServedModels.of(ModelConfig(generation_config=str(folder)))
        )
    }
    assert by_id["open"].max_tokens == 3 and not by_id["open"].max_tokens_to_limit
    assert by_id["given"].max_tokens == 5


def test_a_generation_config_bm_cannot_run_or_a_missing_directory_is_refused_before_the_load(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(
        ValueError, match=r"generation_config: .*generation_config.json asks for .*--generation-config vllm"
    ):
        ServedModels.of(ModelConfig(generation_config=str(bad)))
    with pytest.raises(ConfigError, match=r"model.generation_config: .*not a directory; give auto"):
        load_config(None, {"model.generation_config": str(tmp_path / "nope")})
    batch = write_batch(tmp_path, [line("a")])
    result = runner.invoke(
        app, ["run", str(batch), "-o", str(tmp_path / "out"), "--generation-config", str(bad)]
    )
    assert result.exit_code == 2 and "asks for" in result.output


def run_lines(tmp_path, name: str, lines, *flags: str) -> dict[str, list[int]]:
    """``bm run`` over ``lines`` on the checkpoint: each line's output token ids by custom_id."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / f"out-{name}"
    args = ["run", str(path), "-o", str(out), "-q", "--set", "model.device=cpu", *flags]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    records = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    return {r["id"]: r["output_ids"] for r in records}


def test_bm_run_samples_a_line_without_temperature_with_the_checkpoints_values_and_greedy_equals_hf(
    tmp_path, checkpoint, tiny_model
):
    lines = [
        line("implicit", seed=11),
        line("explicit", seed=11, **GENERATION),
        line("temperature-one", seed=11, temperature=1.0),
        line("greedy", temperature=0),
        line("unseeded"),
    ]
    model = ("--model", str(checkpoint), "--seed", "5")
    auto = run_lines(tmp_path, "auto", lines, *model)
    assert auto["implicit"] == auto["explicit"]  # sampled with 0.7 / top_k 20, as if the line said so
    assert auto["greedy"] == hf_greedy(reference_model(tiny_model), PROMPT, MAX_TOKENS)
    vllm = run_lines(tmp_path, "vllm", lines, *model, "--generation-config", "vllm")
    assert vllm["implicit"] == vllm["temperature-one"]  # vLLM's own default: temperature 1.0
    assert vllm["greedy"] == auto["greedy"]
    again = run_lines(tmp_path, "again", lines, *model)
    assert again["unseeded"] == auto["unseeded"]  # the run seed reproduces a sampled unseeded line
