"""Reading a prompts JSONL file into requests, one problem per bad line and no line lost.

A line is ``{"id"?, "prompt" | "input_ids", "request_output_len"?, <request fields by spec name>}``.
The batch manager gets each line's index as its request id (always unique); the user's ``id``, which
may be any string or integer, is echoed back in the output record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.engine.inference_request import SPEC_INPUT_TENSORS, SUPPORTED_INPUT_TENSORS, WORD_LISTS
from bm.engine.request import Request

OUTPUT_LEN_ALIASES = ("request_output_len", "max_tokens", "max_new_tokens", "output_tokens")
FIELD_ALIASES = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "seed": "random_seed"}
REQUEST_FIELDS = sorted(SUPPORTED_INPUT_TENSORS - {"input_ids", "request_output_len"})
# Fields whose JSONL value is a nested list of numbers (the engine checks shapes and values).
NESTED_FIELDS = ("prompt_embedding_table", "lora_weights", "lora_config", "draft_logits")
# Fields whose JSONL value is a flat list of token ids.
ID_LIST_FIELDS = ("draft_input_ids",)
# A PEFT adapter directory (adapter_config.json + adapter_model.safetensors), read into lora_config and
# lora_weights; relative paths are taken from the prompts file's directory.
LORA_DIR = "lora_dir"
# Read by `bm bench`; `bm run` is offline and accepts the field so one file serves both.
IGNORED_KEYS = ("arrival_time",)
KNOWN_KEYS = {
    "id",
    "prompt",
    "input_ids",
    *OUTPUT_LEN_ALIASES,
    *FIELD_ALIASES,
    *SPEC_INPUT_TENSORS,
    *IGNORED_KEYS,
    LORA_DIR,
}


@dataclass
class PromptLine:
    index: int  # 0-based position among the file's non-blank lines; the batch manager's request id
    line_number: int  # 1-based line in the file, for messages
    user_id: Any
    request: Request | None = None
    num_prompt_tokens: int | None = None
    error: str | None = None


class LineError(ValueError):
    pass


def read_prompt_lines(
    path: Path,
    encode: Callable[[str], list[int]] | None,
    default_output_len: int,
    default_end_id: int | None,
    encode_word: Callable[[str], list[int]] | None = None,
) -> list[PromptLine]:
    """Parse every non-blank line; a bad line becomes a :class:`PromptLine` carrying its error.

    ``encode_word`` tokenizes the strings of a word list (without the special tokens a prompt gets).
    """
    lines: list[PromptLine] = []
    seen_ids: dict[Any, int] = {}
    adapters: dict[Path, tuple[Any, Any]] = {}  # each adapter directory is read once
    with path.open(encoding="utf-8") as f:
        for line_number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            index = len(lines)
            entry = PromptLine(index=index, line_number=line_number, user_id=index)
            try:
                data = _load_object(text)
                entry.user_id = _user_id(data, index)
                hashable = json.dumps(entry.user_id)
                if hashable in seen_ids:
                    raise LineError(
                        f"duplicate id {entry.user_id!r} (also on line {seen_ids[hashable]}); ids must be unique"
                    )
                seen_ids[hashable] = line_number
                entry.request, entry.num_prompt_tokens = _to_request(
                    data, index, encode, default_output_len, default_end_id, encode_word
                )
                if LORA_DIR in data:
                    _add_lora_dir(entry.request, data, path.parent, adapters)
            except LineError as exc:
                entry.error = f"line {line_number}: {exc}"
            lines.append(entry)
    return lines


def _load_object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise LineError(f"expected a JSON object, got {type(data).__name__}")
    return data


def _user_id(data: dict[str, Any], index: int) -> Any:
    if "id" not in data:
        return index
    value = data["id"]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise LineError(f"id: expected a string or an integer, got {value!r}")
    return value


def _to_request(
    data: dict[str, Any],
    index: int,
    encode: Callable[[str], list[int]] | None,
    default_output_len: int,
    default_end_id: int | None,
    encode_word: Callable[[str], list[int]] | None = None,
) -> tuple[Request, int]:
    unknown = sorted(k for k in data if k not in KNOWN_KEYS)
    if unknown:
        allowed = ", ".join(["id", "prompt", "input_ids", *OUTPUT_LEN_ALIASES, *REQUEST_FIELDS])
        raise LineError(f"unknown field {unknown[0]!r}; allowed fields: {allowed}")
    prompt_ids = _prompt_ids(data, encode)
    output_len = _output_len(data, default_output_len)
    fields: dict[str, Any] = {}
    for key, value in data.items():
        name = FIELD_ALIASES.get(key, key)
        if name in ("id", "prompt", "input_ids", LORA_DIR, *OUTPUT_LEN_ALIASES, *IGNORED_KEYS):
            continue
        if name in fields:
            raise LineError(f"{key}: given twice (as {name!r} and an alias); keep one")
        if value is None:
            continue
        if name in WORD_LISTS:
            value = _word_list(key, value, encode_word)
        elif name == "embedding_bias":
            value = _bias(key, value)
        elif name in NESTED_FIELDS:
            value = _nested_numbers(key, value)
        elif name in ID_LIST_FIELDS:
            if not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in value
            ):
                raise LineError(f"{key}: expected a list of integer token ids")
        elif not isinstance(value, (int, float, bool)):
            raise LineError(f"{key}: expected a number or true/false, got {value!r}")
        fields[name] = value
    if "end_id" not in fields and default_end_id is not None:
        fields["end_id"] = default_end_id
    # Values go to the engine as written: it refuses a wrong type by name rather than coercing it.
    return Request(request_id=index, input_ids=prompt_ids, request_output_len=output_len, **fields), len(
        prompt_ids
    )


def _prompt_ids(data: dict[str, Any], encode: Callable[[str], list[int]] | None) -> list[int]:
    has_prompt, has_ids = "prompt" in data, "input_ids" in data
    if has_prompt and has_ids:
        raise LineError("give either 'prompt' or 'input_ids', not both")
    if not has_prompt and not has_ids:
        raise LineError("missing prompt: give 'prompt' (text) or 'input_ids' (token ids)")
    if has_prompt:
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise LineError(f"prompt: expected a string, got {type(prompt).__name__}")
        if not prompt:
            raise LineError("prompt: the prompt is empty")
        if encode is None:
            raise LineError("prompt: this model has no tokenizer; give 'input_ids' instead")
        ids = encode(prompt)
        if not ids:
            raise LineError("prompt: the prompt encodes to no tokens")
        return ids
    ids = data["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise LineError("input_ids: expected a list of integer token ids")
    if not ids:
        raise LineError("input_ids: the prompt is empty")
    return ids


def _add_lora_dir(request: Request, data: dict[str, Any], base: Path, adapters: dict) -> None:
    """The line's adapter directory as the seed's fields; the task id derives from the directory unless
    the line gives ``lora_task_id``. Every line carries the weights, so no line depends on another's."""
    from bm.runtime.lora import read_peft_adapter, task_id_for_directory

    value = data[LORA_DIR]
    if not isinstance(value, str) or not value:
        raise LineError(f"{LORA_DIR}: expected a directory path, got {value!r}")
    if "lora_weights" in data or "lora_config" in data:
        raise LineError(f"{LORA_DIR}: give either lora_dir or lora_weights + lora_config, not both")
    path = Path(value) if Path(value).is_absolute() else base / value
    key = path.resolve()
    if key not in adapters:
        try:
            adapters[key] = read_peft_adapter(path)
        except ValueError as exc:
            raise LineError(str(exc)) from None
    request.lora_config, request.lora_weights = adapters[key]
    if request.lora_task_id is None:
        request.lora_task_id = task_id_for_directory(path)


def _nested_numbers(key: str, value: Any) -> list[list[float]]:
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise LineError(f"{key}: expected a nested list of numbers (one list per row), got {value!r:.60}")
    return value


def _output_len(data: dict[str, Any], default: int) -> int:
    given = [k for k in OUTPUT_LEN_ALIASES if k in data]
    if len(given) > 1:
        raise LineError(f"output length given twice ({', '.join(given)}); keep one")
    if not given:
        return default
    value = data[given[0]]
    if isinstance(value, bool) or not isinstance(value, int):
        raise LineError(f"{given[0]}: expected a positive integer, got {value!r}")
    if value < 1:
        raise LineError(f"{given[0]}: must be at least 1, got {value}")
    return value


def _is_offsets_form(value: list[Any]) -> bool:
    """Two equal-length integer rows whose second is a valid end-offset row: TensorRT-LLM's [2, n] form."""
    if len(value) != 2 or not all(isinstance(r, list) for r in value) or len(value[0]) != len(value[1]):
        return False
    if not all(isinstance(t, int) and not isinstance(t, bool) for r in value for t in r):
        return False
    offsets = value[1]
    real = [o for o in offsets if o >= 0]
    if not real or offsets[: len(real)] != real or any(o != -1 for o in offsets[len(real) :]):
        return False
    return all(b > a for a, b in zip([0, *real], real, strict=False)) and real[-1] <= len(value[0])


def _word_list(key: str, value: Any, encode_word: Callable[[str], list[int]] | None) -> list[list[int]]:
    """A word list in any accepted form, as the list of token-id lists the engine validates."""
    form = (
        f'{key}: expected a list of strings or of token-id lists (e.g. ["stop", [13, 13]]), or the '
        "[2, n] form [[ids...], [end offsets..., -1...]]"
    )
    if not isinstance(value, list):
        raise LineError(form)
    if _is_offsets_form(value):
        ids, ends = value[0], [o for o in value[1] if o >= 0]
        return [ids[a:b] for a, b in zip([0, *ends], ends, strict=False)]
    words = []
    for word in value:
        if isinstance(word, str):
            if encode_word is None:
                raise LineError(f"{key}: this model has no tokenizer; give words as token-id lists")
            ids = encode_word(word)
            if not ids:
                raise LineError(f"{key}: the word {word!r} encodes to no tokens")
            words.append(ids)
        elif (
            isinstance(word, list)
            and word
            and all(isinstance(t, int) and not isinstance(t, bool) for t in word)
        ):
            words.append(word)
        else:
            raise LineError(f"{form}; got the item {word!r}")
    return words


def _bias(key: str, value: Any) -> list[float]:
    if not isinstance(value, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        raise LineError(f"{key}: expected a list of numbers, one per vocabulary token")
    return [float(v) for v in value]
