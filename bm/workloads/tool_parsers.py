"""Tool calls a model wrote on its own (``tool_choice: "auto"``, OpenAI's default when tools are given),
told apart from text after generation.

A model left free to answer writes a call in the syntax its chat template taught it, and each model
family has its own. bm knows two, named as vLLM's ``--tool-call-parser`` names them:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, with text around them
  (Hermes, Qwen 2/2.5/3, SmolLM3 and other ChatML templates that render tools); a block may hold a JSON
  list of calls, as SmolLM2 writes them;
- ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``, several calls separated by ``;``), as Llama 3.1+ templates ask for.

The parser is chosen from the chat template where it gives its call syntax away (:func:`detect_parser`),
or named by ``bm run --tool-call-parser``. Nothing constrains the generation: a reply that is not a
well-formed call to one of the given tools is text, and is returned as text (a malformed call is never
half-parsed). A forced call (``tool_choice`` ``"required"`` or naming a function) is another path:
llguidance's grammar makes the reply a call (:mod:`bm.workloads.tools`).

Plain Python (no torch): parsing runs where records are written, detection where chats are rendered.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from bm.engine.requests.request import RequestError

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON)
# What a chat template writes when it teaches a call syntax -> the parser for that syntax (first match).
TEMPLATE_MARKERS = (
    ("<tool_call>", HERMES),
    ("<|python_tag|>", LLAMA3_JSON),
    ("dictionary of argument name and its value", LLAMA3_JSON),  # Llama 3.1+: the reply's format
)
PARSER_FLAG = "--tool-call-parser"
HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


class ToolParserError(ValueError):
    """A tool-call parser name bm does not know; the message lists the ones it does."""


@dataclass(frozen=True)
class ToolReply:
    """A reply split as OpenAI's message is: ``content`` (None when only calls were written) and
    ``tool_calls`` (None when the reply is text)."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None


def check_parser(name: str | None) -> str | None:
    """``name`` when bm has such a parser (None stays None: detect from the template)."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ToolParserError(
            f"{PARSER_FLAG}: unknown parser {name!r}; bm has {', '.join(TOOL_CALL_PARSERS)}"
        )
    return name


def detect_parser(template: str | None) -> str | None:
    """The parser for the call syntax ``template`` (Jinja text) teaches, or None when it shows none."""
    if not template:
        return None
    for marker, parser in TEMPLATE_MARKERS:
        if marker in template:
            return parser
    return None


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads ``tools`` at all: one that does not shows the model nothing, so a
    free reply could only call a tool by chance."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def line_parser(template: str | None, parser: str | None) -> str:
    """The parser for a line with tools and ``tool_choice`` auto, rendered with ``template`` (None:
    unknown) in a run whose parser is ``parser`` (the flag's, else the detected one). A template that does
    not render tools, or no parser, makes the line an error that says what to give: otherwise the reply
    could be a call nobody reads as one."""
    if template is not None and not renders_tools(template):
        raise RequestError(
            "tools: the chat template does not render tools, so the model would never see them; give a "
            "template that does with --chat-template FILE, or force a call with tool_choice "
            '"required" or a named function'
        )
    if parser is None:
        raise RequestError(
            "tool_choice: 'auto' (the default when tools are given) needs a tool-call parser, and the "
            f"chat template does not show which call syntax it teaches; name one with {PARSER_FLAG} "
            f'({" or ".join(TOOL_CALL_PARSERS)}), or force a call with tool_choice "required" or a '
            "named function"
        )
    return parser


def parse_tool_calls(parser: str, text: str, tool_names: set[str], call_id: str) -> ToolReply:
    """``text`` as OpenAI's message: the calls ``parser``'s syntax holds, each to one of ``tool_names``,
    with ids ``call_id``, ``call_id_1``, ...; plain text (``tool_calls`` None) when there is no call or
    any call is malformed."""
    parse = _hermes if parser == HERMES else _llama3_json
    found = parse(text)
    if found is None:
        return ToolReply(text, None)
    content, calls = found
    if not calls or any(name not in tool_names for name, _ in calls):
        return ToolReply(text, None)
    return ToolReply(
        content or None,
        [
            {
                "id": call_id if i == 0 else f"{call_id}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
            for i, (name, arguments) in enumerate(calls)
        ],
    )


Call = tuple[str, dict[str, Any]]


def _call(value: Any, arguments_key: str) -> Call | None:
    """``(name, arguments)`` of one decoded call object, or None when it is not one. Arguments written as
    a JSON string (some models do) are decoded."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments


def _hermes(text: str) -> tuple[str, list[Call]] | None:
    """Every ``<tool_call>`` block; the text outside them is the content. An opening tag left unclosed
    (cut by max_tokens or a stop) makes the reply text."""
    if "<tool_call>" not in text:
        return None
    calls: list[Call] = []
    for block in HERMES_BLOCK.findall(text):
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return None
        for item in value if isinstance(value, list) else [value]:  # SmolLM2 writes a list of calls
            call = _call(item, "arguments")
            if call is None:
                return None
            calls.append(call)
    content = HERMES_BLOCK.sub("", text)
    if "<tool_call>" in content or "</tool_call>" in content:
        return None
    return content.strip(), calls


def _llama3_json(text: str) -> tuple[str, list[Call]] | None:
    """The reply is calls and nothing else: JSON objects separated by ``;``."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls: list[Call] = []
    at = 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        call = _call(value, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = body[at:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return None
        at = len(body) - len(rest) + 1
        while at < len(body) and body[at].isspace():
            at += 1
    return "", calls
