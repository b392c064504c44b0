"""Tools with ``tool_choice`` auto (or absent, OpenAI's default): the model answers freely and a tool-call
parser (hermes, llama3_json) tells a call from text. The parsers on fixed replies; then ``bm run`` end to
end on the embedded tiny model, whose reply a line's own grammar pins (a random model writes a call only
when made to), with ``batch_output.jsonl`` parsed by the ``openai`` package's types."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.workloads.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    ToolParserError,
    check_parser,
    detect_parser,
    parse_tool_calls,
)
from tests.test_cli_chat_batch import records_of, run

runner = CliRunner()
NAMES = {"get_weather", "add"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
# A ChatML template that renders tools and teaches the hermes syntax (detected from "<tool_call>").
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools> call as "
    "<tool_call>{json}</tool_call>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Renders the tool names but teaches no call syntax: no parser can be detected.
PLAIN_TOOLS_TEMPLATE = HERMES_TEMPLATE.replace(" call as <tool_call>{json}</tool_call>", "")
NO_TOOLS_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
HERMES_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'


def calls(parser, text):
    return parse_tool_calls(parser, text, NAMES, "call_x")


def test_hermes_parser_returns_each_call_and_the_text_around_it():
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    reply = calls(HERMES, text)
    assert reply.content == "Let me check."
    assert reply.tool_calls == [
        {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_x_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
    ]  # fmt: skip
    listed = calls(
        HERMES,
        '<tool_call>[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}]</tool_call>',
    )
    assert [c["function"]["arguments"] for c in listed.tool_calls] == ["{}", '{"a": 2}']  # SmolLM2's form
    only_call = calls(HERMES, HERMES_CALL)
    assert only_call.content is None and only_call.tool_calls[0]["function"]["name"] == "get_weather"


def test_llama3_json_parser_reads_parameters_python_tag_and_several_calls():
    reply = calls(LLAMA3_JSON, ' {"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert reply.content is None
    assert reply.tool_calls == [
        {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    ]  # fmt: skip
    two = calls(
        LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "arguments": {}}'
    )
    assert [c["function"]["arguments"] for c in two.tool_calls] == ['{"a": 1}', "{}"]


@pytest.mark.parametrize("parser", [HERMES, LLAMA3_JSON])
def test_a_reply_without_a_call_is_text(parser):
    reply = calls(parser, "It is sunny in Paris today.")
    assert reply.content == "It is sunny in Paris today." and reply.tool_calls is None


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),  # bad JSON
        (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'),  # cut, unclosed
        (HERMES, '<tool_call>{"name": "book_flight", "arguments": {}}</tool_call>'),  # not a given tool
        (HERMES, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        (HERMES, HERMES_CALL + "<tool_call>"),  # a second call cut short
        (HERMES, '<tool_call>[{"name": "add", "arguments": {}}, 3]</tool_call>'),  # a list with a non-call
        (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some text'),
        (LLAMA3_JSON, '{"name": "get_weather", "parameters": ["Paris"]}'),  # arguments not an object
        (LLAMA3_JSON, '{"city": "Paris"}'),  # JSON, but not a call
        (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Par'),  # cut by max_tokens
    ],
)
def test_a_malformed_call_is_returned_as_text_whole(parser, text):
    reply = calls(parser, text)
    assert reply.tool_calls is None and reply.content == text


def test_parser_is_detected_from_the_call_syntax_the_chat_template_teaches():
    assert detect_parser(HERMES_TEMPLATE) == HERMES
    llama = '{{- "Respond in the format {\\"name\\": function name, \\"parameters\\": dictionary of argument name and its value}." }}'  # fmt: skip
    assert detect_parser(llama) == LLAMA3_JSON
    assert detect_parser("{%- if builtin_tools %}<|python_tag|>{% endif %}") == LLAMA3_JSON
    assert detect_parser(PLAIN_TOOLS_TEMPLATE) is None
    assert detect_parser(None) is None


def test_unknown_tool_call_parser_is_refused_before_the_model_loads(tmp_path):
    assert check_parser(None) is None and check_parser(HERMES) == HERMES
    with pytest.raises(ToolParserError, match="bm has hermes, llama3_json"):
        check_parser("mistral")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    result = runner.invoke(
        app, ["run", str(prompts), "-o", str(tmp_path / "o"), "-q", "--tool-call-parser", "mistral"]
    )
    assert result.exit_code == 2
    assert "--tool-call-parser: unknown parser 'mistral'" in result.output
    assert "loading model" not in result.output and not (tmp_path / "o").exists()


def chat_line(**fields):
    fields.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return fields


def run_lines(tmp_path, lines, template, *flags):
    tmp_path.mkdir(exist_ok=True)
    template_path = tmp_path / "chat.jinja"
    template_path.write_text(template)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    run(prompts, "-o", out, "--chat-template", template_path, *flags)
    return records_of(out)


def test_auto_tools_reply_becomes_tool_calls_with_the_parser_the_template_teaches(tmp_path):
    pytest.importorskip("llguidance", reason="the test pins the reply with a grammar (llguidance)")
    records = run_lines(
        tmp_path,
        [
            chat_line(tools=[WEATHER], guided_regex=HERMES_REGEX, max_tokens=120),  # tool_choice absent
            chat_line(tools=[WEATHER], tool_choice="auto", guided_regex="Sunny", max_tokens=20),
        ],
        HERMES_TEMPLATE,
    )
    call, text = records[0], records[1]
    assert call["error"] is None and call["text"] == HERMES_CALL
    assert call["tool_calls"] == [
        {"id": "call_bm_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]  # fmt: skip
    assert text["error"] is None and text["text"] == "Sunny" and text["tool_calls"] is None


def test_auto_tools_line_without_a_detectable_parser_gets_an_error_naming_the_flag(tmp_path):
    pytest.importorskip("llguidance", reason="the test pins the reply with a grammar (llguidance)")
    line = chat_line(tools=[WEATHER], guided_regex=HERMES_REGEX, max_tokens=120)
    plain = chat_line(max_tokens=2)
    records = run_lines(tmp_path / "a", [line, plain], PLAIN_TOOLS_TEMPLATE)
    assert "name one with --tool-call-parser (hermes or llama3_json)" in records[0]["error"]
    assert records[0]["error"].startswith("line 1: tool_choice: 'auto'")
    assert records[0]["output_ids"] == [] and records[1]["error"] is None  # it never ran; others do
    named = run_lines(tmp_path / "b", [line], PLAIN_TOOLS_TEMPLATE, "--tool-call-parser", "hermes")
    assert named[0]["error"] is None and named[0]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_auto_tools_with_a_template_that_does_not_render_tools_is_an_error(tmp_path):
    """SmolLM2's own template is one: the model would never see the tools, flag or no flag."""
    line = chat_line(tools=[WEATHER], max_tokens=4)
    records = run_lines(
        tmp_path, [line, chat_line(max_tokens=2)], NO_TOOLS_TEMPLATE, "--tool-call-parser", "hermes"
    )
    assert "the chat template does not render tools" in records[0]["error"]
    assert "--chat-template FILE" in records[0]["error"]


BATCH_CHAT = "/v1/chat/completions"
LLAMA_CALL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "parameters": {"type": "object", "properties": {"city": {"const": "Rome"}}, "required": ["city"], "additionalProperties": False}},
    "required": ["name", "parameters"],
    "additionalProperties": False,
}  # fmt: skip


def batch_line(custom_id, **body):
    body.setdefault("messages", [{"role": "user", "content": "Weather in Rome?"}])
    body.setdefault("max_tokens", 120)
    return {"custom_id": custom_id, "method": "POST", "url": BATCH_CHAT, "body": body}


def test_batch_output_of_auto_tools_parses_with_openais_types(tmp_path):
    """The OpenAI batch path with llama3_json named by the flag: a call comes back as ``tool_calls`` with
    ``finish_reason: "tool_calls"`` and null content, text as content; both as OpenAI's types read them."""
    pytest.importorskip("llguidance", reason="the test pins the reply with a grammar (llguidance)")
    chat_types = pytest.importorskip("openai.types.chat")
    schema = {"type": "json_schema", "json_schema": {"name": "call", "schema": LLAMA_CALL, "strict": True}}
    lines = [
        batch_line("call", tools=[WEATHER], response_format=schema),
        batch_line("text", tools=[WEATHER], tool_choice="auto", max_tokens=3),
    ]
    run_lines(tmp_path, lines, PLAIN_TOOLS_TEMPLATE, "--tool-call-parser", LLAMA3_JSON)
    written = (tmp_path / "out" / "batch_output.jsonl").read_text().splitlines()
    outputs = {line["custom_id"]: line for line in map(json.loads, written)}
    for output in outputs.values():
        assert set(output) == {"id", "custom_id", "response", "error"} and output["error"] is None
        assert output["response"]["status_code"] == 200
    call = chat_types.ChatCompletion.model_validate(outputs["call"]["response"]["body"]).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None
    (tool_call,) = call.message.tool_calls
    assert tool_call.id == "call_bm_0" and tool_call.type == "function"
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments) == {
        "city": "Rome"
    }
    text = chat_types.ChatCompletion.model_validate(outputs["text"]["response"]["body"]).choices[0]
    assert text.finish_reason in ("stop", "length") and text.message.tool_calls is None
    assert isinstance(text.message.content, str)


def test_shipped_tools_batch_files_run_auto_with_the_template_that_teaches_smollm2_the_hermes_syntax():
    """datasets/tools: the SmolLM2 tool-calling demo (docs/structured-output.md). Every line is a chat
    with tools and no tool_choice; the shipped template renders the tools and earlier calls and is
    detected as hermes."""
    from pathlib import Path

    from bm.chat_template import jinja_renderer
    from bm.runfiles.openai_batch import iter_batch_file

    root = Path(__file__).resolve().parent.parent / "datasets" / "tools"
    template = (root / "chatml-tools.jinja").read_text()
    assert detect_parser(template) == HERMES
    render = jinja_renderer(template)
    for name in ("weather-calculator-batch.jsonl", "weather-calculator-agent-batch.jsonl"):
        lines = list(iter_batch_file(root / name))
        assert len(lines) == 20 and all(line.parsed.ok and line.parsed.tool_auto for line in lines)
        text = render(lines[0].parsed.messages, tools=lines[0].parsed.tools)
        assert "<tools>[{" in text and '"name": "get_weather"' in text  # (plain Jinja's tojson sorts keys)
        assert text.endswith("<|im_start|>assistant\n")
    agent = next(iter_batch_file(root / "weather-calculator-agent-batch.jsonl")).parsed
    earlier_call = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Lisbon"}}]</tool_call>'
    assert earlier_call in render(agent.messages, tools=agent.tools)
