"""Structured output as plain values: what a request asked its text to match, checked before anything runs.

A request that constrains its output carries one :class:`GuidedSpec`: a kind (a JSON schema, any JSON
object, a regular expression, a choice of strings, or a Lark grammar) and that constraint's canonical
text. It is frozen and hashable, so the engine core carries it like any other plain field and the runtime
keys its compiled grammars on it (one compile per distinct spec per run). The grammar library,
llguidance, is an optional extra: it is imported here only to check a spec (its schema compiler needs
no tokenizer and no torch), so a bad schema is that line's error before the model loads, and a run that
asks for no structured output never imports it. Why llguidance: docs/structured-output.md.

The names a line may use (bm lines, OpenAI batch bodies and ``bm.SamplingParams`` alike):

- ``response_format``: OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema":
  {"name", "schema", "strict"?}}`` (``text`` is the default and constrains nothing);
- ``guided_json`` (a schema object), ``guided_regex`` (a string), ``guided_choice`` (a list of strings),
  ``guided_grammar`` (Lark text): vLLM's names;
- ``guided_decoding``: the same as one object, ``{"json" | "regex" | "choice" | "grammar": ...}`` or
  ``{"json_object": true}``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any


class SpecError(ValueError):
    """A structured-output field that cannot be honoured; its callers report it as the line's
    RequestError (this module stays below bm.engine.requests.request, which reads specs through it)."""


INSTALL = "pip install llguidance==1.9.1"
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON with ", " and ": " between items and no other whitespace: a small model given free whitespace
# often loops on newlines until max_tokens, and these separators are what models write anyway.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GUIDED_KEYS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class GuidedSpec:
    """One request's output constraint: ``kind`` (one of :data:`KINDS`) and its canonical ``text`` (a
    schema as compact JSON in its own key order, a regex, a JSON list of choices, a Lark grammar)."""

    kind: str
    text: str

    def grammar(self) -> str:
        """llguidance's grammar for this spec (checked when the spec was built)."""
        return _grammar(self.kind, self.text)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output follows (json_schema and json_object), for checking results."""
        if self.kind == "json_schema":
            return json.loads(self.text)
        return {"type": "object"} if self.kind == "json_object" else None


def guided_spec(key: str, value: Any) -> GuidedSpec | None:
    """The spec a line's field ``key`` asks for (None: no constraint), or :class:`SpecError` naming
    what is wrong and the fix. ``key`` is one of :data:`GUIDED_KEYS` or ``guided_decoding``."""
    if isinstance(value, GuidedSpec):
        return value
    if key == "response_format":
        return _response_format(value)
    if key == "guided_decoding":
        return _guided_object(value)
    kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}.get(
        key, "grammar"
    )
    return make_spec(kind, value, key)


def make_spec(kind: str, value: Any, key: str) -> GuidedSpec:
    """A checked spec of ``kind`` from its JSON value (a schema object, a regex, choices, Lark text)."""
    if kind == "json_schema":
        if isinstance(value, str):  # vLLM accepts a schema as a JSON string too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpecError(f"{key}: the schema is not valid JSON ({exc.msg})") from None
        if not isinstance(value, dict):
            raise SpecError(f"{key}: expected a JSON schema object, got {type(value).__name__}")
        # compact, keys in the user's order: a schema's property order is the order the output follows
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    elif kind == "json_object":
        text = ""
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise SpecError(f'{key}: expected a non-empty list of non-empty strings, e.g. ["yes", "no"]')
        text = json.dumps(value, ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value:
            what = "a regular expression" if kind == "regex" else "a Lark grammar"
            raise SpecError(f"{key}: expected {what} as a non-empty string")
        text = value
    try:
        problem = _check(kind, text)
    except SpecError as exc:  # the library is missing
        raise SpecError(f"{key}: {exc}") from None
    if problem:
        raise SpecError(f"{key}: {problem}")
    return GuidedSpec(kind, text)


def _response_format(value: Any) -> GuidedSpec | None:
    form = 'response_format: expected {"type": "text" | "json_object" | "json_schema", ...}'
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise SpecError(form)
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if kind == "text" or kind == "json_object":
        if extra or "json_schema" in value:
            raise SpecError(
                f"response_format: {kind!r} takes no other fields; got {(extra or ['json_schema'])[0]!r}"
            )
        return None if kind == "text" else make_spec("json_object", None, "response_format")
    if kind != "json_schema":
        raise SpecError(f"{form}; got type {kind!r}")
    if extra:
        raise SpecError(f"response_format.{extra[0]}: unknown field (type and json_schema are)")
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise SpecError(
            'response_format.json_schema: expected {"name": ..., "schema": {...}, "strict"?: bool}'
        )
    unknown = sorted(set(inner) - {"name", "schema", "strict", "description"})
    if unknown:
        raise SpecError(
            f"response_format.json_schema.{unknown[0]}: unknown field (name, schema, strict, description are)"
        )
    name = inner.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("response_format.json_schema.name: expected a non-empty string")
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise SpecError(f"response_format.json_schema.strict: expected true or false, got {strict!r}")
    # strict or not, bm enforces the schema on every token: the output always follows it
    return make_spec("json_schema", inner.get("schema", {}), "response_format.json_schema.schema")


def _guided_object(value: Any) -> GuidedSpec | None:
    forms = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
    given = sorted(k for k in value if value[k] is not None) if isinstance(value, dict) else None
    if given == ["json_object"] and value["json_object"] is True:
        return make_spec("json_object", None, "guided_decoding.json_object")
    if not given or len(given) != 1 or given[0] not in forms:
        raise SpecError(
            'guided_decoding: expected one of {"json": schema}, {"regex": "..."}, {"choice": [...]}, '
            '{"grammar": "..."} or {"json_object": true}'
        )
    return make_spec(forms[given[0]], value[given[0]], f"guided_decoding.{given[0]}")


def load_llguidance() -> Any:
    """The llguidance module, or :class:`SpecError` saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise SpecError(
            f"structured output needs the llguidance package, which is not installed: {INSTALL}"
        ) from None
    return llguidance


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, text: str) -> str:
    """llguidance's grammar text for a spec; cached, so each distinct spec is translated once per run."""
    matcher = load_llguidance().LLMatcher
    if kind in ("json_schema", "json_object"):
        schema = text if kind == "json_schema" else '{"type": "object"}'
        return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(text)
    if kind == "choice":
        choices = json.loads(text)
        return matcher.grammar_from_regex("|".join(_regex_literal(c) for c in choices))
    return matcher.grammar_from_lark(text)


@functools.lru_cache(maxsize=256)
def _check(kind: str, text: str) -> str:
    """Why the spec cannot be compiled ('' when it can); checked once per distinct spec."""
    try:
        grammar = _grammar(kind, text)
    except SpecError:
        raise  # the library is missing: not a problem of this spec
    except ValueError as exc:
        return f"cannot be compiled: {exc}"
    is_error, messages = load_llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        # one line: the library's message can span several (a regex error draws a caret under the spot)
        text = " ".join(messages[0].split()) if messages else "unknown error"
        return f"cannot be compiled: {text if len(text) <= 240 else text[:237] + '...'}"
    return ""


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (llguidance's syntax is Rust's, whose escapes these are)."""
    special = set("\\.+*?()|[]{}^$#&-~")
    return "".join("\\" + ch if ch in special else ch for ch in text)
