"""Chat lines (``messages`` rendered by a chat template), stop strings, and OpenAI Batch API files in and
``batch_output.jsonl`` out, on the embedded tiny model (its byte tokenizer makes token ids predictable)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.runtime import ByteTokenizer

runner = CliRunner()
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def run(*args):
    result = runner.invoke(app, ["run", *map(str, args), "-q", "--set", "model.device=cpu"])
    assert result.exit_code == 0, result.output
    return result


def records_of(out):
    return {r["index"]: r for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}


def run_batch_file(tmp_path, lines, template=TEMPLATE):
    """``bm run`` over OpenAI batch ``lines`` with a chat ``template``: the output lines by custom_id, and
    bm's own records by index."""
    template_path = tmp_path / "chat.jinja"
    template_path.write_text(template)
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    run(batch, "-o", out, "--chat-template", template_path)
    outputs = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    return {line["custom_id"]: line for line in outputs}, records_of(out)


def test_messages_are_rendered_with_the_chat_template_and_generation_prompt(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = "<system>Be brief.\n<user>Hi there\n<assistant>"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"messages": messages, "max_tokens": 6})
        + "\n"
        + json.dumps({"prompt": rendered, "max_tokens": 6})
        + "\n"
    )
    run(prompts, "-o", tmp_path / "out", "--chat-template", template)
    chat, plain = records_of(tmp_path / "out").values()
    assert chat["error"] is None
    assert chat["num_prompt_tokens"] == len(ByteTokenizer().encode(rendered))
    assert chat["output_ids"] == plain["output_ids"]  # the same tokens in, the same greedy tokens out


def test_a_broken_chat_template_is_a_usage_error(tmp_path):
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    result = runner.invoke(app, ["run", str(prompts), "--chat-template", str(template)])
    assert result.exit_code == 2 and "not a valid Jinja template" in result.output


def test_a_stop_string_ends_the_request_and_the_text_before_it(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time", "max_tokens": 48}) + "\n")
    run(prompts, "-o", tmp_path / "free", "--ignore-eos")
    full = records_of(tmp_path / "free")[0]["output_ids"]
    position = next(i for i, t in enumerate(full) if i > 0 and 32 <= t - 3 < 127)  # a printable ASCII byte
    stop = chr(full[position] - 3)
    prompts.write_text(json.dumps({"prompt": "Once upon a time", "max_tokens": 48, "stop": stop}) + "\n")
    run(prompts, "-o", tmp_path / "stopped", "--ignore-eos")
    record = records_of(tmp_path / "stopped")[0]
    assert record["finish_reason"] == "stop"
    assert record["output_ids"] == full[: full.index(full[position]) + 1]
    assert record["text"] == ByteTokenizer().decode(full[: full.index(full[position])])
    assert stop not in record["text"]


BATCH_LINES = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "logprobs": True}},
    {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "Once", "max_tokens": 4, "temperature": 0, "seed": 3, "stop": ["\n"]}},
    {"custom_id": "n-2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "x"}], "n": 2, "max_tokens": 8}},
    {"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "x"}], "tools": []}},
    {"custom_id": "top", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3, "max_tokens": 8}},
    {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    {"custom_id": "typed", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "x", "max_tokens": 2.5}},
    {"custom_id": "new", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Bye"}], "max_completion_tokens": 3}},
    {"custom_id": "prompts", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": ["Once", "Twice", "Thrice"], "max_tokens": 3, "n": 2, "temperature": 1, "seed": 4}},
]  # fmt: skip
REFUSED = {"tools": "body.tools", "embed": "url", "typed": "body.max_tokens"}  # fmt: skip


def test_openai_batch_input_gets_batch_output_in_openais_schema(tmp_path):
    openai_types = pytest.importorskip("openai.types")
    from openai.types.chat import ChatCompletion

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in BATCH_LINES))
    out = tmp_path / "out"
    run(batch, "-o", out, "--chat-template", template, "--served-model-name", "tiny")
    written = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    # one per input line, in the order requests finished (as OpenAI's own): matched by custom_id
    assert sorted(x["custom_id"] for x in written) == sorted(x["custom_id"] for x in BATCH_LINES)
    by_id = {x["custom_id"]: x for x in written}
    lines = [by_id[x["custom_id"]] for x in BATCH_LINES]
    records = records_of(out)
    for i, line in enumerate(lines):
        assert set(line) == {"id", "custom_id", "response", "error"}
        custom_id = line["custom_id"]
        if custom_id in REFUSED:  # never silently ignored: the line is an error naming the field
            assert line["response"]["status_code"] == 400 and line["error"] is None
            message = line["response"]["body"]["error"]["message"]
            assert message.startswith(f"line {i + 1}: ") and REFUSED[custom_id] in message, message
            continue
        response = line["response"]
        assert response["status_code"] == 200 and line["error"] is None
        body = response["body"]
        if BATCH_LINES[i]["url"] == "/v1/chat/completions":
            parsed = ChatCompletion.model_validate(body)
            assert parsed.object == "chat.completion"
            assert parsed.choices[0].message.content == records[i]["text"]
        else:
            parsed = openai_types.Completion.model_validate(body)
            assert parsed.object == "text_completion"
            assert parsed.choices[0].text == records[i]["text"]
        assert parsed.usage.completion_tokens == records[i]["num_output_tokens"]
        assert parsed.usage.prompt_tokens == records[i]["num_prompt_tokens"]
        assert parsed.choices[0].finish_reason in ("stop", "length")
    chat = ChatCompletion.model_validate(lines[0]["response"]["body"])
    assert chat.model == "tiny"
    assert len(chat.choices[0].logprobs.content) == records[0]["num_output_tokens"]
    assert [c.logprob for c in chat.choices[0].logprobs.content] == pytest.approx(
        records[0]["output_log_probs"]
    )
    assert records[7]["num_output_tokens"] <= 3  # max_completion_tokens honoured


def test_an_interrupted_batch_line_reports_a_cancelled_error():
    from bm.runfiles.openai_batch import BatchLine
    from bm.runfiles.openai_batch_output import batch_output_line
    from bm.workloads.request import Row

    line = BatchLine(Row.at_line(1), custom_id="a")
    out = batch_output_line(0, line, {"finish_reason": "cancelled"}, "m", 0)
    assert out["response"] is None and out["error"]["code"] == "cancelled"


def test_a_resumed_batch_file_has_one_output_line_per_input_and_reruns_only_the_unfinished(tmp_path):
    """batch_output.jsonl streams (a line per record, as requests finish); after an interrupt, --resume
    keeps the lines of finished requests and writes the others once, so no custom_id is lost or doubled."""
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    batch = tmp_path / "batch.jsonl"
    ok_lines = [line for line in BATCH_LINES if line["custom_id"] not in REFUSED]
    batch.write_text("".join(json.dumps(line) + "\n" for line in ok_lines))
    out = tmp_path / "out"
    run(batch, "-o", out, "--chat-template", template, "--served-model-name", "tiny")
    first = {
        x["custom_id"]: x for x in map(json.loads, (out / "batch_output.jsonl").read_text().splitlines())
    }

    # What an interrupt leaves: request 1 cancelled, request 2 never written, a torn last line.
    records = records_of(out)
    records[1] = {**records[1], "finish_reason": "cancelled"}
    del records[2]
    (out / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    cancelled = {"id": "batch_req_bm_1", "custom_id": ok_lines[1]["custom_id"], "response": None,
                 "error": {"code": "cancelled", "message": "interrupted"}}  # fmt: skip
    kept = [first[line["custom_id"]] for i, line in enumerate(ok_lines) if i not in (1, 2)] + [cancelled]
    (out / "batch_output.jsonl").write_text("".join(json.dumps(x) + "\n" for x in kept) + '{"id": "batch_req')

    result = runner.invoke(
        app,
        [
            "run",
            str(batch),
            "-o",
            str(out),
            "--resume",
            "--chat-template",
            str(template),
            "--served-model-name",
            "tiny",
            "-q",
            "--set",
            "model.device=cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(x["custom_id"] for x in ok_lines)
    assert lines[0] == first[ok_lines[0]["custom_id"]]  # the finished request's line, carried over as it was
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        answer = first[line["custom_id"]]["response"]["body"]["choices"]
        assert line["response"]["body"]["choices"] == answer  # rerun greedy requests answer the same
