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
    assert results["short_finish_reasons"] == {"stop": 3}
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


def word_tokenizer(directory, num_ids: int):
    """A checkpoint-style tokenizer directory whose vocabulary spans ``num_ids`` ids (one per word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, num_ids - 1)}}
    vocab["[UNK]"] = num_ids - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    fast.save_pretrained(directory)
    return directory


def test_a_tokenizer_with_more_ids_than_the_model_is_refused_before_the_run_naming_both_sizes(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", 300)  # the embedded model's vocabulary is 259
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"w{5 + i} w290", "max_tokens": 2}) + "\n" for i in range(4))
    )
    out = tmp_path / "out"
    result = bench(prompts, "--model", "tiny-random", "--set", f"model.tokenizer={tokenizer}", "-o", out)
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert "has 300 token ids, but the model (embedded tiny-llama) has a vocabulary of 259" in said
    assert "--set model.tokenizer=DIR" in said
    assert not (out / "results.json").exists()


def test_bm_run_refuses_the_same_tokenizer_before_any_line_runs(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", 300)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w290"}) + "\n")
    out = tmp_path / "out"
    args = [
        "run",
        str(prompts),
        "--model",
        "tiny-random",
        "--set",
        f"model.tokenizer={tokenizer}",
        "-o",
        str(out),
    ]
    result = runner.invoke(app, [*args, "-q", "--set", "model.device=cpu"])
    assert result.exit_code == 2, result.output
    assert "has 300 token ids, but the model" in " ".join(result.stderr.split())
    assert not (out / "outputs.jsonl").exists()


def test_a_tokenizer_that_fits_the_vocabulary_loads(tmp_path):
    from bm.config import ModelConfig
    from bm.model_fit import check_tokenizer_fits, tokenizer_size

    tokenizer = word_tokenizer(tmp_path / "tok", 200)
    cfg = ModelConfig(tokenizer=str(tokenizer))
    from transformers import AutoTokenizer

    from bm.runtime.tokenizer import ByteTokenizer, HFTokenizer

    wrapped = HFTokenizer(AutoTokenizer.from_pretrained(tokenizer))
    assert tokenizer_size(wrapped) == 200 and tokenizer_size(ByteTokenizer()) == 259
    check_tokenizer_fits(wrapped, 259, cfg, "m")  # fewer ids than the vocabulary: a padded vocabulary
    check_tokenizer_fits(None, 8, cfg, "m")  # no tokenizer: token ids only
    with pytest.raises(ConfigError, match=r"has 200 token ids, but the model \(m\) has a vocabulary of 199"):
        check_tokenizer_fits(wrapped, 199, cfg, "m")


TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
CHAT = [
    {"id": "a", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
    {"id": "b", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    {"id": "c", "messages": [{"role": "user", "content": "stop here"}], "stop": ["zz"], "max_tokens": 2},
]


@pytest.fixture
def chat(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    return path, template


def test_bench_replays_chat_messages_lines_through_the_chat_template_as_bm_run_renders_them(tmp_path, chat):
    path, template = chat
    out = tmp_path / "bench"
    result = bench(path, "--model", "tiny-random", "--chat-template", template, "--output-len", 4, "-o", out)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert (results["completed"], results["failed"]) == (3, 0)
    records = {r["id"]: r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())}
    assert [records[k]["output_tokens"] for k in "abc"] == [3, 4, 2]  # a chat row keeps its max_tokens
    ran = runner.invoke(
        app,
        ["run", str(path), "--model", "tiny-random", "--chat-template", str(template), "-o", str(tmp_path / "run"),
         "-q", "--set", "model.device=cpu"],
    )  # fmt: skip
    assert ran.exit_code == 0, ran.output
    lines = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    assert {r["id"]: r["num_prompt_tokens"] for r in lines} == {k: records[k]["input_tokens"] for k in "abc"}


def test_bench_replays_openai_chat_batch_lines(tmp_path, chat):
    _, template = chat
    path = tmp_path / "batch.jsonl"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    path.write_text(
        json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
    )
    out = tmp_path / "out"
    result = bench(path, "--model", "tiny-random", "--chat-template", template, "-o", out)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["dataset"]["kind"] == "openai-batch"
    assert results["completed"] == 1 and results["total_output_tokens"] == 3


def test_chat_rows_without_a_chat_template_are_refused_naming_the_flag(tmp_path, chat):
    path, _ = chat
    out = tmp_path / "out"
    result = bench(path, "--model", "tiny-random", "-o", out)  # the byte tokenizer has no template
    assert result.exit_code == 2, result.output  # no row can run: refused, not replayed as empty tables
    said = " ".join(result.stderr.split())
    assert "none of its 3 rows can run; the first: line 1: messages: this model has no chat template" in said
    assert "--chat-template FILE" in said and not (out / "results.json").exists()


def test_a_chat_template_that_is_not_a_file_is_refused_before_the_model_loads(tmp_path, chat):
    path, _ = chat
    result = bench(path, "--model", "tiny-random", "--chat-template", tmp_path / "none.jinja")
    assert result.exit_code == 2
    assert "--chat-template" in result.stderr and "no such file" in result.stderr
    assert "loading model" not in result.output
