"""Structured output and tools through ``bm run``: OpenAI batch lines and bm lines in, records and
``batch_output.jsonl`` out, parsed with the ``openai`` package's types; on the embedded tiny model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.runtime import ByteTokenizer
from tests.test_cli_chat_batch import run_batch_file

pytest.importorskip("llguidance", reason="structured output needs llguidance (optional extra)")
jsonschema = pytest.importorskip("jsonschema")

runner = CliRunner()
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}  # fmt: skip
CHAT = "/v1/chat/completions"


def line(custom_id, url=CHAT, **body):
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": "Plan a trip"}])
    else:
        body.setdefault("prompt", "Plan a trip")
    body.setdefault("max_tokens", 120)
    body.setdefault("temperature", 0)  # greedy, as these checks were written (OpenAI lines sample by default)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


LINES = [
    line("schema", response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": CITY, "strict": True}}),
    line("object", url="/v1/completions", response_format={"type": "json_object"}, max_tokens=12),
    line("text", response_format={"type": "text"}, max_tokens=6),
    line("plain", max_tokens=6),
    line("named", tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    line("required", tools=[WEATHER, TIME], tool_choice="required"),
    line("none", tools=[WEATHER], tool_choice="none", max_tokens=4),
    line("auto", tools=[WEATHER], tool_choice="auto"),
    line("bad-schema", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
    line("bad-choice", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
]  # fmt: skip
REFUSED = {
    "auto": "does not show which call syntax it teaches; name one with --tool-call-parser",
    "bad-schema": "body.response_format.json_schema.schema: cannot be compiled: Invalid type: strin",
    "bad-choice": "'nope' is not one of the tools",
}


def run_batch(tmp_path, lines):
    return run_batch_file(tmp_path, lines, TEMPLATE)


def test_response_format_and_tool_choice_lines_parse_with_openais_types_and_follow_their_schemas(tmp_path):
    types = pytest.importorskip("openai.types")
    from openai.types.chat import ChatCompletion

    outputs, records = run_batch(tmp_path, LINES)
    for custom_id, message in REFUSED.items():
        response = outputs[custom_id]["response"]
        assert response["status_code"] == 400
        assert message in response["body"]["error"]["message"]
    schema = ChatCompletion.model_validate(outputs["schema"]["response"]["body"])
    assert schema.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(schema.choices[0].message.content), CITY)
    completion = types.Completion.model_validate(outputs["object"]["response"]["body"])
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert completion.choices[0].text.startswith("{")
    text = ChatCompletion.model_validate(outputs["text"]["response"]["body"]).choices[0].message
    plain = ChatCompletion.model_validate(outputs["plain"]["response"]["body"]).choices[0].message
    assert text.content == plain.content  # {"type": "text"} is the default: it constrains nothing
    for custom_id, names in (("named", {"get_weather"}), ("required", {"get_weather", "get_time"})):
        chat = ChatCompletion.model_validate(outputs[custom_id]["response"]["body"])
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name in names
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, CITY)
        else:
            assert arguments == {}
        record = records[next(i for i, line in enumerate(LINES) if line["custom_id"] == custom_id)]
        assert record["tool_calls"] == [call.model_dump(exclude_none=True)]  # bm's own record has it too
    none = ChatCompletion.model_validate(outputs["none"]["response"]["body"])
    assert none.choices[0].message.tool_calls is None


def test_tools_are_rendered_through_the_chat_template(tmp_path):
    _, records = run_batch(tmp_path, [line("none", tools=[WEATHER, TIME], tool_choice="none", max_tokens=2)])
    rendered = "<tools>get_weather;get_time;<user>Plan a trip\n<assistant>"  # trim_blocks eats one newline
    assert records[0]["num_prompt_tokens"] == len(ByteTokenizer().encode(rendered))


def test_bm_lines_take_guided_regex_and_guided_choice(tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "Answer:", "max_tokens": 20, "guided_choice": ["yes", "no"]},
        {"prompt": "Code:", "max_tokens": 20, "guided_regex": "[A-Z]{3}-[0-9]{2}"},
        {"prompt": "x", "guided_json": {"type": "integer"}, "response_format": {"type": "json_object"}},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = runner.invoke(
        app, ["run", str(prompts), "-o", str(tmp_path / "o"), "-q", "--set", "model.device=cpu"]
    )
    assert result.exit_code == 0, result.output
    records = {
        r["index"]: r for r in map(json.loads, (tmp_path / "o" / "outputs.jsonl").read_text().splitlines())
    }
    assert (
        records[0]["text"] in ("yes", "no")
        and records[0]["finish_reason"] == "stop"
        and records[0]["stop_reason"] is None
    )
    code = records[1]["text"]
    assert len(code) == 6 and code[:3].isupper() and code[3] == "-" and code[4:].isdigit()
    assert "given twice" in records[2]["error"]
