"""Tools (OpenAI function calling), the part that needs no per-model parser.

``tools`` is checked here and handed to the chat template, which renders it in the model's own words.
``tool_choice`` naming a function, or ``"required"``, makes the reply a call: structured output
constrains it to ``{"name": <the function>, "arguments": <its parameters' schema>}``, and the output
carries it as OpenAI's ``message.tool_calls``. ``"none"`` constrains nothing (the tools are still shown
to the model, as OpenAI does). ``"auto"``, OpenAI's default when tools are given, constrains nothing
either: the model answers freely and a tool-call parser tells a call from text afterwards
(:mod:`bm.workloads.tool_parsers`), so no grammar of bm's own competes with llguidance's.

Plain Python (no torch): a file's tools are checked before the model loads.
"""

from __future__ import annotations

import json
from typing import Any

from bm.engine.requests.request import RequestError
from bm.engine.requests.structured import GuidedSpec, SpecError, make_spec


def read_tools(value: Any, key: str = "tools") -> list[dict[str, Any]]:
    """OpenAI's ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}]``, checked; returned as given (the chat template reads them)."""
    if not isinstance(value, list) or not value:
        raise RequestError(f'{key}: expected a non-empty list of {{"type": "function", "function": {{...}}}}')
    names = set()
    for i, tool in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(
                f'{where}: expected {{"type": "function", "function": {{...}}}} (only functions)'
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f'{where}.function: expected {{"name": ..., "parameters": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name: expected a non-empty string")
        if name in names:
            raise RequestError(f"{where}.function.name: {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{where}.function.parameters: expected a JSON schema object")
    return value


def tool_choice_spec(tools: list[dict[str, Any]] | None, choice: Any) -> GuidedSpec | None:
    """The constraint ``tool_choice`` puts on the reply (None: none, as for "none" and "auto");
    :class:`RequestError` for a choice that names no given tool."""
    if choice is None:
        return None
    if tools is None:
        raise RequestError("tool_choice: given without tools; give the tools or drop tool_choice")
    if choice in ("none", "auto"):
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "required":
        chosen = list(functions)
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        if name not in functions:
            raise RequestError(
                f"tool_choice.function.name: {name!r} is not one of the tools ({', '.join(functions)})"
            )
        chosen = [name]
    else:
        raise RequestError(
            'tool_choice: expected "auto", "none", "required" or {"type": "function", "function": '
            '{"name": ...}}'
        )
    calls = [_call_schema(name, functions[name].get("parameters")) for name in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        return make_spec("json_schema", schema, "tools")
    except SpecError as exc:
        raise RequestError(str(exc)) from None


def is_auto(tools: list[dict[str, Any]] | None, choice: Any) -> bool:
    """Whether the model chooses between a call and text (tools given, ``tool_choice`` absent or
    "auto"): its reply then goes through a tool-call parser."""
    return tools is not None and choice in (None, "auto")


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """The function names a parsed call may name."""
    return {t["function"]["name"] for t in tools or []}


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_calls(text: str, call_id: str) -> list[dict[str, Any]] | None:
    """The reply's call in OpenAI's ``message.tool_calls`` shape (``arguments`` as a JSON string), or None
    when the text is not a complete call (e.g. cut short by max_tokens)."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return [{"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": arguments}}]
