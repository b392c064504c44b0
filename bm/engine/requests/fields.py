"""The request fields bm implements, in one table, and the checks of their JSON form.

Every reader of request lines (bm's JSONL, OpenAI batch bodies, bench datasets) and the seed's tensor
adapter take field names, aliases and types from here, so a field is declared once. The checks here are
the ones that need no model: a value's type and the bounds of its encoding. What depends on the model
(token ids against the vocabulary, where ids from vocab_size on may be prompt-table rows; lengths
against the maximum sequence) is judged once, by :func:`bm.engine.requests.validate.validate_request`.

Plain Python (no torch), so a whole file is checked before the model loads. A value of the wrong type is
refused with the field and the fix, never coerced (``beam_width: 1.9`` is an error, not 1).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from bm.engine.requests.structured import GUIDED_KEYS, SpecError, guided_spec


class RequestError(ValueError):
    """A request the batch manager refuses; the message is sent back as the error response."""


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_RETURN_SEQUENCES = 128  # OpenAI's bound on n
MAX_TOP_LOGPROBS = 20  # OpenAI chat's bound on top_logprobs
LOGIT_BIAS_BOUND = 100.0  # OpenAI: each bias in [-100, 100]
UINT64_MAX = 2**64 - 1
FIELD_ALIASES = {
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "seed": "random_seed",
    "n": "num_return_sequences",
}
# Structured output: response_format, guided_json, guided_regex, guided_choice and guided_grammar each set
# the one field guided_decoding (a GuidedSpec; bm.engine.requests.structured reads and checks every form).
FIELD_ALIASES.update(dict.fromkeys(GUIDED_KEYS, "guided_decoding"))
# vLLM's SamplingParams names that set one engine field each, value for value.
FIELD_ALIASES.update(min_tokens="min_length", bad_words="bad_words_list")

# vLLM's SamplingParams names -> the engine request field each sets: the one table of them. bm's JSONL
# lines and OpenAI batch bodies take these names (bm.workloads.jsonl), as bm.LLM's SamplingParams does
# (a test keeps bm.llm_params.SAMPLING_FIELDS equal to it).
VLLM_SAMPLING_FIELDS: dict[str, str] = {
    "n": "num_return_sequences",
    "max_tokens": "request_output_len",
    "temperature": "temperature",
    "top_p": "runtime_top_p",
    "top_k": "runtime_top_k",
    "min_p": "min_p",
    "seed": "random_seed",
    "stop": "stop_words_list",
    "stop_token_ids": "stop_words_list",
    "bad_words": "bad_words_list",
    "ignore_eos": "end_id",
    "min_tokens": "min_length",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logprobs": "top_logprobs",
    "logit_bias": "logit_bias",
    "structured_outputs": "guided_decoding",
    "guided_decoding": "guided_decoding",
    "response_format": "guided_decoding",
    "prompt_logprobs": "return_context_logits",
}
# The other direction, engine field -> the vLLM name a user wrote for it (the first that sets it above),
# for every message that speaks back to a user: bm.LLM's errors, a line's error, an OpenAI error's
# ``param``. Derived, so the two directions cannot drift. Fields that several names set with different
# meanings (end_id from ignore_eos, guided_decoding from response_format, ...) keep the engine's name.
_SEVERAL_MEANINGS = frozenset({"end_id", "guided_decoding", "return_context_logits"})
USER_NAMES: dict[str, str] = {"return_log_probs": "logprobs"}
for _user, _engine in VLLM_SAMPLING_FIELDS.items():
    if _engine != _user and _engine not in _SEVERAL_MEANINGS:
        USER_NAMES.setdefault(_engine, _user)


def in_user_terms(message: str, names: dict[str, str] | None = None) -> str:
    """An engine message with each engine field name (a whole word) replaced by the user's: ``names``
    (default :data:`USER_NAMES`); the one translation from the engine's words to a user's."""
    names = USER_NAMES if names is None else names
    if not names:
        return message
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda m: names[m.group(1)], message)


# vLLM's SamplingParams names that shape the text returned, not a request field -> the values a line may
# give because bm's records are made so anyway (any other is refused, naming the field and bm.LLM).
VLLM_OUTPUT_FIELDS: dict[str, tuple[Any, ...]] = {
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
}

# Names other tools give a field bm spells otherwise -> bm's name: what an unknown field's "did you
# mean" names before any near spelling (a near spelling of another field is a wrong hint: min_tokens
# once suggested max_tokens, prompt_token_ids output_tokens). One table for every reader of lines.
FIELD_SYNONYMS: dict[str, str] = {
    "prompt_token_ids": "input_ids",  # vLLM's TokensPrompt
    "max_completion_tokens": "max_tokens",  # OpenAI chat's newer name
    "max_output_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",  # transformers' generate()
    "num_beams": "beam_width",
    "length_penalty": "len_penalty",
    "stop_sequences": "stop",
    "stop_words": "stop",
    "bad_words_ids": "bad_words",
    "eos_token_id": "end_id",
    "pad_token_id": "pad_id",
    "return_logprobs": "logprobs",
    "num_samples": "n",
}


def field_hint(name: str, known: Any) -> str:
    """``"; did you mean 'input_ids'?"`` for an unknown field ``name``: the synonym table's name when it
    has one that ``known`` holds, else the closest spelling among ``known``; ``""`` when neither."""
    from bm.suggest import did_you_mean

    target = FIELD_SYNONYMS.get(name)
    if target is not None and target in known:
        return f"; did you mean {target!r}?"
    return did_you_mean(name, known)


# Every request field the engine implements, by its spec name, with the JSON type it must have and the
# bounds that hold whatever the model; the engine's validator narrows some by the model (the vocabulary,
# the beam width it was built for, the output length). (A test keeps this equal to the engine's
# SUPPORTED_INPUT_TENSORS.)
INT_FIELDS: dict[str, tuple[int, int]] = {
    "beam_width": (1, INT32_MAX),
    "runtime_top_k": (0, INT32_MAX),
    "early_stopping": (0, INT32_MAX),
    "min_length": (0, INT32_MAX),
    "no_repeat_ngram_size": (0, INT32_MAX),
    "random_seed": (0, UINT64_MAX),
    "end_id": (-1, INT32_MAX),
    "pad_id": (0, INT32_MAX),
    "lora_task_id": (0, UINT64_MAX),
    "prompt_vocab_size": (1, INT32_MAX),
    "num_return_sequences": (1, MAX_RETURN_SEQUENCES),
    "top_logprobs": (0, MAX_TOP_LOGPROBS),
}
FLOAT_FIELDS = (
    "temperature",
    "runtime_top_p",
    "min_p",
    "len_penalty",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
# name: (low, whether low itself is refused, high or None, a note for the message)
FLOAT_BOUNDS: dict[str, tuple[float, bool, float | None, str]] = {
    "temperature": (0.0, False, None, " (0 is greedy)"),
    "runtime_top_p": (0.0, True, 1.0, ""),
    "min_p": (0.0, False, 1.0, " (0 is off)"),
    "repetition_penalty": (0.0, True, None, " (1 is off)"),
}
BOOL_FIELDS = ("streaming", "return_log_probs", "return_context_logits", "return_generation_logits")
WORD_LISTS = ("bad_words_list", "stop_words_list")
LIST_FIELDS = ("embedding_bias",)
# Nested lists of numbers (the engine checks their shapes and values).
NESTED_FIELDS = ("prompt_embedding_table", "lora_weights", "lora_config", "draft_logits")
ID_LIST_FIELDS = ("draft_input_ids",)  # flat lists of token ids
GUIDED_FIELDS = ("guided_decoding",)
MAP_FIELDS = ("logit_bias",)  # {token id: bias}, OpenAI's sparse logit bias
REQUEST_FIELDS = (
    *INT_FIELDS,
    *FLOAT_FIELDS,
    *BOOL_FIELDS,
    *WORD_LISTS,
    *LIST_FIELDS,
    *NESTED_FIELDS,
    *ID_LIST_FIELDS,
    *GUIDED_FIELDS,
    *MAP_FIELDS,
)
MAX_TOKEN_ID = INT32_MAX


def request_field(name: str, key: str, value: Any) -> Any:
    """One request field's value, checked against its declared JSON type (spec name ``name``)."""
    if name in INT_FIELDS:
        return check_int(name, value, key)
    if name in FLOAT_FIELDS:
        return check_float(name, value, key)
    if name in BOOL_FIELDS:
        return check_bool(value, key)
    if name in WORD_LISTS:
        return word_list(value, key)
    if name in NESTED_FIELDS:
        if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
            raise RequestError(f"{key}: expected a nested list of numbers (one list per row)")
        return value
    if name in GUIDED_FIELDS:
        try:
            return guided_spec(key, value)
        except SpecError as exc:
            raise RequestError(str(exc)) from None
    if name in ID_LIST_FIELDS:
        if not isinstance(value, list) or not all(is_int(t) for t in value):
            raise RequestError(f"{key}: expected a list of integer token ids")
        return value
    if name in MAP_FIELDS:
        return logit_bias(value, key)
    if not isinstance(value, list) or not value or not all(is_number(v) for v in value):
        raise RequestError(f"{key}: expected a list of finite numbers, one per vocabulary token")
    return value


def check_int(
    name: str, value: Any, key: str | None = None, *, low: int | None = None, high: int | None = None
) -> int:
    """Field ``name``'s integer within its table bounds, narrowed by ``low``/``high`` where the caller knows
    more (the model's vocabulary, the engine's beam width). Files and the library both come here, so a
    value means the same, and is refused in the same words, whichever door it came in by."""
    table_low, table_high = INT_FIELDS.get(name, (INT32_MIN, INT32_MAX))
    low = table_low if low is None else max(low, table_low)
    high = table_high if high is None else min(high, table_high)
    return strict_int(value, key or name, low, high)


def check_float(name: str, value: Any, key: str | None = None) -> float:
    """Field ``name``'s finite number within its table bounds (temperature >= 0, top_p in (0, 1], ...)."""
    key = key or name
    number = finite_number(value, key)
    if name in FLOAT_BOUNDS:
        low, low_open, high, note = FLOAT_BOUNDS[name]
        if number < low or (low_open and number == low) or (high is not None and number > high):
            if high is not None:
                allowed = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            else:
                allowed = f"{'>' if low_open else '>='} {low:g}"
            raise RequestError(f"{key}: {short_float(number)} is out of range; allowed {allowed}{note}")
    return number


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name}: expected true or false, got {show_value(value)}")
    return value


def short_float(value: float) -> str:
    """A float as the user wrote it (1.01, not 1.0099999904632568 from a float32 tensor)."""
    return repr(float(f"{value:.7g}"))


def logit_bias(value: Any, name: str) -> dict[int, float]:
    """OpenAI's ``logit_bias`` read into ``{token id: bias}``, each bias in [-100, 100]: JSON object keys
    are strings, so "50256" names token 50256 (the library's dict may use ints). Only the ids against the
    vocabulary are left to validate_request, which knows the model."""
    if not isinstance(value, dict):
        raise RequestError(f'{name}: expected an object of token id to bias, e.g. {{"50256": -100}}')
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
            raise RequestError(f"{name}: key {show_value(key)} is not a token id (a non-negative integer)")
        if not is_number(bias):
            raise RequestError(f"{name}[{key}]: expected a number in [-100, 100], got {show_value(bias)}")
        if not -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND:
            raise RequestError(f"{name}[{key}]: {short_float(bias)} is out of range; allowed [-100, 100]")
        out[token] = float(bias)
    return out


# OpenAI body fields bm accepts and that change nothing it computes, with the JSON type each must have.
OPENAI_NO_EFFECT_FIELDS: dict[str, tuple[type, str]] = {
    "store": (bool, "true or false"),
    "service_tier": (str, 'a string such as "auto"'),
    "parallel_tool_calls": (bool, "true or false"),
    "stream_options": (dict, "an object (ignored: a batch has no stream)"),
}
MAX_COMPLETION_LOGPROBS = 5  # OpenAI completions: logprobs is a count of top tokens, 0-5


def no_effect_field(name: str, value: Any) -> None:
    """An accepted OpenAI field that changes nothing computed must still have its type (null is fine)."""
    kind, form = OPENAI_NO_EFFECT_FIELDS[name]
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)):
        raise RequestError(f"{name}: expected {form}, got {show_value(value)}")


def strict_int(value: Any, name: str, low: int, high: int) -> int:
    """An integer in [low, high]; 12.0 and true are refused, not read as 12 and 1."""
    if not is_int(value):
        raise RequestError(f"{name}: expected an integer in [{low}, {high}], got {show_value(value)}")
    if value < low:
        raise RequestError(f"{name}: must be at least {low}, got {value}")
    if value > high:
        raise RequestError(f"{name}: must be at most {high}, got {value}")
    return value


def finite_number(value: Any, name: str, low: float | None = None) -> float:
    if not is_number(value):
        raise RequestError(f"{name}: expected a finite number, got {show_value(value)}")
    if low is not None and value < low:
        raise RequestError(f"{name}: must be >= {low:g}, got {value}")
    return value


def word_list(value: Any, name: str) -> list[Any]:
    """Words as strings or token-id lists, or TensorRT-LLM's [2, n] form; tokenized later."""
    form = (
        f'{name}: expected a list of strings or of token-id lists (e.g. ["stop", [13, 13]]), or the '
        "[2, n] form [[ids...], [end offsets..., -1...]]"
    )
    if not isinstance(value, list) or not value:
        raise RequestError(form)
    if is_offsets_form(value):
        return value
    for word in value:
        if isinstance(word, str) and word:
            continue
        if isinstance(word, list) and word and all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in word):
            continue
        raise RequestError(f"{form}; got the item {show_value(word)}")
    return value


def is_offsets_form(value: list[Any]) -> bool:
    """Two equal-length integer rows whose second is a valid end-offset row: TensorRT-LLM's [2, n] form."""
    if len(value) != 2 or not all(isinstance(r, list) for r in value) or len(value[0]) != len(value[1]):
        return False
    if not all(is_int(t) and INT32_MIN <= t <= INT32_MAX for r in value for t in r):
        return False
    offsets = value[1]
    real = [o for o in offsets if o >= 0]
    if not real or offsets[: len(real)] != real or any(o != -1 for o in offsets[len(real) :]):
        return False
    return all(b > a for a, b in zip([0, *real], real, strict=False)) and real[-1] <= len(value[0])


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number that fits a float32 tensor's conversion (true/false are not numbers)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) < 2**63
    return isinstance(value, float) and math.isfinite(value)


def show_value(value: Any) -> str:
    """A value for a message, cut short: a 200 KB prompt must not become a 200 KB error."""
    text = json.dumps(value, ensure_ascii=True) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def token_id_list(value: Any) -> list[int]:
    """A prompt's token ids from the shapes the ecosystem hands over: a list, one row of a batch of one,
    anything with ``tolist`` (a tensor or array), a transformers tokenizer's result (``input_ids``) or
    vLLM's TokensPrompt (``prompt_token_ids``). One reading for ``InferenceRequest.from_values`` and
    ``bm.LLM``; anything else is refused in bm's words, not torch's."""
    if isinstance(value, dict) or hasattr(value, "keys"):
        key = next((k for k in ("prompt_token_ids", "input_ids") if k in value), None)
        if key is None:
            raise RequestError(f"input_ids: expected token ids, got a mapping with keys {sorted(value)}")
        value = value[key]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        if len(value) != 1:
            raise RequestError(f"input_ids: a prompt's token ids must be one row, got {len(value)} rows")
        value = value[0]  # one row, as tokenizers return a batch of one
    if not isinstance(value, (list, tuple)) or not all(is_int(t) for t in value):
        raise RequestError(f"input_ids: expected a list of integer token ids, got {type(value).__name__}")
    return list(value)
