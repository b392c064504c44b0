"""bm's JSONL request format, parsed in one place for ``bm run``, ``bm bench`` and ``bm compare``.

A line is ``{"id"?, "prompt" | "input_ids" | "messages", "request_output_len"? (or ``max_tokens``,
``max_new_tokens``, ``output_tokens``), "arrival_time"?, "stop"?, <request fields by spec name>}``.

Plain Python only (no torch), so a whole file is checked before the model loads. Types are strict: a
value of the wrong type is refused with the field and the fix, never truncated or read for its
truthiness (``beam_width: 1.9`` and ``temperature: true`` are errors). The lines themselves are read by
:mod:`bm.workloads.json_lines`, where bad bytes or bad JSON end as one line's error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from bm.engine.requests.fields import (
    FIELD_ALIASES,
    INT32_MAX,
    MAX_TOKEN_ID,
    REQUEST_FIELDS,
    VLLM_OUTPUT_FIELDS,
    WORD_LISTS,
    check_bool,
    check_int,
    field_hint,
    finite_number,
    is_int,
    is_offsets_form,
    request_field,
    show_value,
    strict_int,
)
from bm.workloads.json_lines import iter_lines, iter_slice_lines
from bm.workloads.request import Row, RowError
from bm.workloads.tools import is_auto, read_tools, tool_choice_spec

__all__ = [
    "WORD_LISTS",
    "Row",
    "chat_ids",
    "iter_lines",
    "iter_request_file",
    "iter_slice_lines",
    "read_request_file",
    "resolve_word_list",
]

OUTPUT_LEN_KEYS = ("request_output_len", "max_tokens", "max_new_tokens", "output_tokens")
# A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), read into lora_config and
# lora_weights; a relative path is taken from the request file's directory.
LORA_DIR = "lora_dir"
PROMPT_KEYS = ("prompt", "input_ids", "messages")
TOOL_KEYS = ("tools", "tool_choice")  # bm.workloads.tools
# vLLM's SamplingParams names that set no engine field value for value (bm.engine.requests.fields has the rest
# as aliases): read by _vllm_fields.
VLLM_LINE_KEYS = (
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "structured_outputs",
    "prompt_logprobs",
    "best_of",
)
KNOWN_KEYS = frozenset(
    {
        "id",
        "arrival_time",
        "stop",
        LORA_DIR,
        *PROMPT_KEYS,
        *OUTPUT_LEN_KEYS,
        *FIELD_ALIASES,
        *REQUEST_FIELDS,
        *TOOL_KEYS,
        *VLLM_LINE_KEYS,
        *VLLM_OUTPUT_FIELDS,
    }
)


def read_request_file(path: Path) -> list[Row]:
    """Every non-blank line of a bm JSONL file, checked; a bad line keeps its place with its error."""
    return list(iter_request_file(path))


def iter_request_file(path: Path) -> Iterator[Row]:
    """The lines of :func:`read_request_file` one at a time, read as they are asked for: a file of millions
    of lines is never held in memory (only the ids seen so far, to refuse a duplicate)."""
    return iter_request_lines(iter_lines(path), path.parent)


def iter_request_lines(lines: Iterable[tuple[int, dict[str, Any] | RowError]], base: Path) -> Iterator[Row]:
    """The rows of a file's lines as :func:`iter_lines` gives them (line number, object or error);
    ``base``: the file's directory (relative ``lora_dir`` paths are resolved against it)."""
    seen_ids: dict[str, int] = {}
    for number, data in lines:
        yield _request_row(number, data, base, seen_ids)


def iter_request_slice(data: bytes, first_number: int, base: Path) -> Iterator[Row]:
    """The rows of a slice of a bm JSONL file (its raw lines, the first being the file's line
    ``first_number``), checked as :func:`iter_request_file` checks them, with one exception: an ``id``
    repeated on a line outside the slice is the whole file's reader's to find. ``bm run --ray`` runs a file
    as such slices on many machines, and its driver, which reads the whole file, passes that verdict on.
    ``base``: the file's directory (relative ``lora_dir`` paths are resolved against it)."""
    for number, value in iter_slice_lines(data, first_number):
        yield _request_row(number, value, base, None)


def _request_row(
    number: int, data: dict[str, Any] | RowError, base: Path, seen_ids: dict[str, int] | None
) -> Row:
    """The checked row of line ``number``; ``seen_ids`` (id -> line) finds duplicates, when given."""
    entry = Row.at_line(number)
    try:
        if isinstance(data, RowError):
            raise data
        parse_request(data, entry)
        if entry.lora_dir is not None and not Path(entry.lora_dir).is_absolute():
            entry.lora_dir = str(base / entry.lora_dir)
        if "id" in data and seen_ids is not None:
            key = json.dumps(entry.user_id)
            if key in seen_ids:
                raise RowError(
                    f"id: duplicate id {entry.user_id!r} (also on line {seen_ids[key]}); ids must be unique"
                )
            seen_ids[key] = number
    except RowError as exc:
        entry.error = f"{entry.where}: {exc}"
    return entry


def parse_request(data: dict[str, Any], entry: Row) -> None:
    """Fill ``entry`` from one line's object or raise :class:`RowError` naming the field and the fix."""
    if "id" in data:  # first: the error record of a line refused for another field keeps its id
        value = data["id"]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise RowError(f"id: expected a string or an integer, got {show_value(value)}")
        entry.user_id = value
    unknown = sorted(k for k in data if k not in KNOWN_KEYS)
    if unknown:
        hint = field_hint(unknown[0], KNOWN_KEYS) or "; the fields are listed in docs/request-fields.md"
        raise RowError(f"unknown field {unknown[0]!r}{hint}")
    parse_prompt(data, entry)
    given = [k for k in OUTPUT_LEN_KEYS if k in data]
    if len(given) > 1:
        raise RowError(f"{given[1]}: output length given twice ({', '.join(given)}); keep one")
    if given and data[given[0]] is not None:
        entry.max_tokens = strict_int(data[given[0]], given[0], 1, INT32_MAX)
        entry.max_tokens_key = given[0]
    if data.get("arrival_time") is not None:
        entry.arrival_time = finite_number(data["arrival_time"], "arrival_time", low=0.0)
    if data.get("stop") is not None:
        entry.stop = stop_strings(data["stop"], "stop")
    if data.get(LORA_DIR) is not None:
        value = data[LORA_DIR]
        if not isinstance(value, str) or not value:
            raise RowError(f"{LORA_DIR}: expected a directory path, got {show_value(value)}")
        if "lora_weights" in data or "lora_config" in data:
            raise RowError(f"{LORA_DIR}: give either lora_dir or lora_weights + lora_config, not both")
        entry.lora_dir = value
    for key, value in data.items():
        name = FIELD_ALIASES.get(key, key)
        if name not in REQUEST_FIELDS:
            continue
        if name in entry.fields:
            raise RowError(f"{key}: given twice (as {name!r} and an alias); keep one")
        if value is None:
            continue
        entry.fields[name] = request_field(name, key, value)
    if any(data.get(k) is not None for k in TOOL_KEYS):
        _tools(data, entry)
    if any(data.get(k) is not None for k in (*VLLM_LINE_KEYS, *VLLM_OUTPUT_FIELDS)):
        _vllm_fields(data, entry)


def _vllm_fields(data: dict[str, Any], entry: Row) -> None:
    """vLLM's SamplingParams names that set an engine field in a form of their own: each means here what
    it means in vLLM (and in bm.LLM), or the line is refused naming the field and the fix."""
    fields = entry.fields
    if data.get("stop_token_ids") is not None:
        ids = data["stop_token_ids"]
        if not isinstance(ids, list) or not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise RowError("stop_token_ids: expected a list of token ids, e.g. [13, 128009]")
        if ids:  # each a one-token stop word, beside the line's stop_words_list
            words = fields.get("stop_words_list") or []
            if is_offsets_form(words):
                raise RowError("stop_token_ids: give stop_words_list as a list of words to add them to")
            fields["stop_words_list"] = [*words, *([t] for t in ids)]
    ignore_eos = data.get("ignore_eos")
    if ignore_eos is not None and check_bool(ignore_eos, "ignore_eos"):
        if "end_id" in fields:
            raise RowError("ignore_eos: given with end_id; keep one (end_id -1 is ignore_eos)")
        fields["end_id"] = -1  # no end token: only the length (or a stop word) ends it
    if data.get("logprobs") is not None:  # vLLM: the chosen token's log prob and the k most likely ones
        if "top_logprobs" in fields or "return_log_probs" in fields:
            raise RowError("logprobs: given with top_logprobs or return_log_probs; keep one")
        count = check_int("top_logprobs", data["logprobs"], "logprobs")
        fields["return_log_probs"] = True
        if count:
            fields["top_logprobs"] = count
    if data.get("structured_outputs") is not None:
        if fields.get("guided_decoding") is not None:
            raise RowError("structured_outputs: give one structured-output field, not two")
        try:
            fields["guided_decoding"] = request_field(
                "guided_decoding", "guided_decoding", data["structured_outputs"]
            )
        except RowError as exc:
            raise RowError(str(exc).replace("guided_decoding", "structured_outputs")) from None
    if data.get("prompt_logprobs") is not None:
        raise RowError(
            "prompt_logprobs: bm run records no prompt log probs; ask return_context_logits: true for the "
            "prompt's logits (written beside the records), or use bm.LLM, which returns prompt_logprobs"
        )
    if data.get("best_of") is not None:
        best_of = check_int("num_return_sequences", data["best_of"], "best_of")
        n = fields.get("num_return_sequences", 1)
        if best_of != n:
            raise RowError(
                f"best_of: {best_of} differs from n ({n}); bm returns every sample it draws and ranks "
                f"none: ask n={best_of} and keep the best by their log probs (logprobs: 0)"
            )
    for name, inert in VLLM_OUTPUT_FIELDS.items():
        if name in data and data[name] is not None and check_bool(data[name], name) not in inert:
            raise RowError(
                f"{name}: bm run's records are written with {name} {str(inert[0]).lower()}; drop it, or "
                "use bm.LLM, whose SamplingParams honours it"
            )


def _tools(data: dict[str, Any], entry: Row) -> None:
    """``tools`` for the chat template, and the call ``tool_choice`` constrains the reply to (none for
    "auto", OpenAI's default: the reply is parsed once generated)."""
    if data.get("tools") is not None:
        if entry.messages is None:
            raise RowError("tools: need a chat ('messages'), whose template renders them")
        entry.tools = read_tools(data["tools"])
    entry.tool_auto = is_auto(entry.tools, data.get("tool_choice"))
    spec = tool_choice_spec(entry.tools, data.get("tool_choice"))
    if spec is not None:
        if entry.fields.get("guided_decoding") is not None:
            raise RowError(
                "tool_choice: a forced tool call is already a structured output; drop response_format"
            )
        entry.fields["guided_decoding"] = spec
        entry.tool_call = True


def parse_prompt(data: dict[str, Any], entry: Row, keys: tuple[str, ...] = PROMPT_KEYS) -> None:
    """The one prompt field of ``data`` among ``keys`` (a format may allow fewer than bm's three)."""
    given = [k for k in keys if k in data]
    named = {
        "prompt": "'prompt' (text)",
        "input_ids": "'input_ids' (token ids)",
        "messages": "'messages' (chat turns)",
    }
    if len(given) > 1:
        one_of = ", ".join(repr(k) for k in keys)
        raise RowError(f"{given[1]}: give one of {one_of}, not {' and '.join(given)}")
    if not given:
        options = [named[k] for k in keys]
        raise RowError(f"missing prompt: give {', '.join(options[:-1])} or {options[-1]}")
    key = given[0]
    value = data[key]
    if key == "prompt":
        if not isinstance(value, str):
            raise RowError(f"prompt: expected a string, got {show_value(value)}")
        if not value:
            raise RowError("prompt: the prompt is empty")
        entry.prompt = value
    elif key == "input_ids":
        entry.input_ids = token_ids(value, "input_ids")
    else:
        entry.messages = chat_messages(value, "messages")


def token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise RowError(f"{name}: expected a list of integer token ids, e.g. [1, 415, 2936]")
    if not value:
        raise RowError(f"{name}: the prompt is empty; give at least one token")
    bad = next((t for t in value if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise RowError(
            f"{name}: token id {bad} is out of range; token ids are vocabulary indices in [0, {MAX_TOKEN_ID}]"
        )
    return value


def chat_messages(value: Any, name: str) -> list[dict[str, Any]]:
    """OpenAI chat turns: ``[{"role": ..., "content": "text"}, ...]`` (content parts of type text too)."""
    if not isinstance(value, list) or not value:
        raise RowError(f'{name}: expected a non-empty list of {{"role": ..., "content": ...}} turns')
    out = []
    for i, turn in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(turn, dict):
            raise RowError(f'{where}: expected {{"role": ..., "content": ...}}, got {show_value(turn)}')
        role, content = turn.get("role"), turn.get("content")
        if not isinstance(role, str) or not role:
            raise RowError(f"{where}.role: expected a string such as 'system', 'user' or 'assistant'")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise RowError(
                        f"{where}.content[{j}]: only text parts are supported ({{'type': 'text', 'text': ...}})"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and isinstance(turn.get("tool_calls"), list):
            content = ""  # an assistant turn that only called tools
        if not isinstance(content, str):
            raise RowError(f"{where}.content: expected a string, got {show_value(content)}")
        extra = sorted(set(turn) - {"role", "content", "name", "tool_calls", "tool_call_id"})
        if extra:
            raise RowError(
                f"{where}.{extra[0]}: not supported in a chat turn (role, content, name, tool_calls and "
                "tool_call_id are)"
            )
        out.append({**turn, "content": content})
    return out


def stop_strings(value: Any, name: str) -> list[str]:
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w for w in words):
        raise RowError(f'{name}: expected a non-empty string or a list of them, e.g. ["\\n\\n", "User:"]')
    return list(words)


def resolve_word_list(
    value: list[Any], name: str, encode_word: Callable[[str], list[int]] | None
) -> list[list[int]]:
    """A parsed word list as token-id words: strings tokenized (without special tokens), [2, n] unpacked.

    Raises :class:`RowError` when a string cannot be tokenized (no tokenizer, or no tokens)."""
    if is_offsets_form(value):
        ids, offsets = value
        ends = [o for o in offsets if o >= 0]
        return [ids[a:b] for a, b in zip([0, *ends], ends, strict=False)]
    words = []
    for word in value:
        if isinstance(word, str):
            if encode_word is None:
                raise _words_without_tokenizer(name)
            ids = encode_word(word)
            if not ids:
                raise RowError(f"{name}: the word {word!r} encodes to no tokens")
            words.append(list(ids))
        else:
            words.append(list(word))
    return words


def chat_ids(row: Row, render_chat: Callable[..., list[int]] | None) -> list[int]:
    """The prompt ids of a chat row (``messages``, and ``tools`` for the template), rendered with the
    model's chat template; one rule for ``bm run``'s lines and ``bm bench``'s replayed rows.
    ``render_chat``: ``(messages, tools=None) -> ids`` (:class:`bm.runfiles.prompts.Codec`), None when the
    model has no template."""
    if render_chat is None:
        raise RowError(
            "messages: this model has no chat template; give one with --chat-template FILE, "
            "or send the prompt as text"
        )
    ids = render_chat(row.messages, tools=row.tools) if row.tools else render_chat(row.messages)
    if not ids:
        raise RowError("messages: the chat renders to no tokens")
    return list(ids)


NAME_A_TOKENIZER = "or name a tokenizer with --set model.tokenizer=DIR"


def check_without_tokenizer(row: Row) -> None:
    """Raise the :class:`RowError` a row gets from a model without a tokenizer, for what it gives as text
    (a prompt, a chat, words or stop strings); a row of token ids alone passes. One verdict for the run
    (:func:`bm.runfiles.prompts.to_request`) and for the check before a model known to have none loads
    (:func:`bm.runfiles.source.check_runnable`)."""
    if row.prompt is not None:
        raise RowError(
            f"prompt: this model has no tokenizer; give 'input_ids' (token ids) instead, {NAME_A_TOKENIZER}"
        )
    if row.messages is not None:
        raise RowError(
            f"messages: this model has no tokenizer to render a chat with; give 'input_ids' (token ids) "
            f"instead, {NAME_A_TOKENIZER}"
        )
    for name in WORD_LISTS:
        words = row.fields.get(name)
        if words is not None and not is_offsets_form(words) and any(isinstance(w, str) for w in words):
            raise _words_without_tokenizer(name)
    if row.stop:
        raise RowError(
            "stop: this model has no tokenizer to match stop strings with; give stop_words_list as token-id "
            f"lists instead, {NAME_A_TOKENIZER}"
        )


def _words_without_tokenizer(name: str) -> RowError:
    return RowError(f"{name}: this model has no tokenizer; give words as token-id lists, {NAME_A_TOKENIZER}")
