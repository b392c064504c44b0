"""OpenAI Batch API input files: the input users already have, read as bm lines.

An input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}``. The body is mapped onto bm's request format and parsed by the same parser as a bm line,
so the same checks apply, vLLM's sampling extensions (``top_k``, ``min_tokens``, ``ignore_eos``, ...)
included. ``body.model`` picks the base model or an adapter (:mod:`bm.runfiles.served_models`; any other
name is a 404). A field that would change the answer and that bm cannot honour (``echo``, ``suffix``,
``best_of`` above ``n``, ``logprobs`` beyond 5 on completions, ...) makes that line an error record
naming it. Fields that change nothing computed (``store``, ``service_tier``, ``parallel_tool_calls``,
``stream_options`` beside ``stream: false``) are accepted once their type is right; a field bm does not
know at all (``reasoning_effort``, ``verbosity``, ...) is ignored, and ``bm run`` says so once per field
name. ``batch_output.jsonl`` is written by :mod:`bm.runfiles.openai_batch_output`. Plain Python (no torch):
the file is checked before the model loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.engine.requests.fields import (
    MAX_COMPLETION_LOGPROBS,
    OPENAI_NO_EFFECT_FIELDS,
    is_int,
    no_effect_field,
    show_value,
    strict_int,
)
from bm.generation_config import VLLM_TEMPERATURE
from bm.runfiles.served_models import ANY_MODEL, ModelNotFoundError, ServedModels
from bm.stderr import print_error
from bm.workloads.jsonl import iter_lines, iter_slice_lines, parse_request, token_ids
from bm.workloads.records import replayable
from bm.workloads.request import DatasetError, Row, RowError, Workload

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
LINE_KEYS = ("custom_id", "method", "url", "body")
# body field -> bm field; fields mapped by hand (logprobs, n, stream, ...) are handled in _body.
COMMON_FIELDS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
METADATA_FIELDS = ("model", "user", "metadata")  # describe the request, change nothing bm computes
# vLLM's extensions of the OpenAI body (its sampling parameters, structured output), passed to the bm line
# under the same names: the line's reader (bm.workloads.jsonl) maps and checks them as SamplingParams does.
VLLM_BODY_FIELDS = (
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# Fields of one url's body, refused on the other's (they would change the answer there, not be ignored).
URL_FIELDS = ("messages", "prompt", "max_completion_tokens", "top_logprobs", "tools", "tool_choice")
# Body fields that would change the answer and that bm cannot honour -> the values that ask for nothing
# (accepted) and the fix; any other value refuses the line, naming the field. best_of is judged beside n.
REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False,), "bm returns the completion alone; prepend the prompt yourself"),
    "suffix": (("",), "bm has no fill-in-the-middle; drop it"),
    "functions": ((), "give the functions as tools (and function_call as tool_choice)"),
    "function_call": ((), "give it as tool_choice, with the functions as tools"),
}
# Passed through to bm's line as they are: structured output (bm.engine.requests.structured) and tools
# (bm.workloads.tools), read and checked there.
STRUCTURED_FIELDS = ("response_format",)
TOOL_FIELDS = ("tools", "tool_choice")


@dataclass
class BatchLine:
    """One input line: the bm request it maps to, and what the output line needs back."""

    parsed: Row
    custom_id: str | None = None
    url: str = CHAT_URL
    model: str | None = None  # the served name or adapter that answers it (the response's ``model``)
    logprobs: bool = False
    top_logprobs: int = 0  # most likely tokens per position in the output's logprobs
    status_code: int = 400  # of the error response, when the line cannot run (404: no such model)
    ignored: tuple[str, ...] = ()  # body fields bm does not know, ignored (said once per run)


def is_batch_file(path: Path) -> bool:
    """True when the first JSON object looks like an OpenAI batch request (``custom_id`` and ``body``);
    lines before it that are not objects do not decide (they become error records either way)."""
    for _number, data in iter_lines(path):
        if isinstance(data, dict):
            return is_batch_object(data)
    return False


def is_batch_object(data: dict[str, Any]) -> bool:
    """Whether a file's first JSON object makes it an OpenAI batch file (``custom_id`` and ``body``)."""
    return "custom_id" in data and "body" in data


def iter_batch_file(path: Path, served: ServedModels = ANY_MODEL) -> Iterator[BatchLine]:
    """Every non-blank line as a :class:`BatchLine` (a line bm cannot run carries its error), read as they
    are asked for, so a file of millions of lines is never held whole. Duplicate custom ids are refused
    for the whole file, before it runs, by :func:`check_unique_custom_ids`. ``served``: what a line's
    ``body.model`` may name (:class:`ServedModels`)."""
    return batch_lines(iter_lines(path), served)


def iter_batch_slice(data: bytes, first_number: int, served: ServedModels = ANY_MODEL) -> Iterator[BatchLine]:
    """The :class:`BatchLine` of each non-blank line of a slice of a batch file (its raw bytes, the first
    line being the file's line ``first_number``), parsed and checked as :func:`iter_batch_file` does:
    ``bm run --ray``'s replicas read their blocks so. Duplicate custom ids span slices; they are refused
    for the whole file before any replica starts (:func:`check_unique_custom_ids`)."""
    return batch_lines(iter_slice_lines(data, first_number), served)


def batch_lines(
    lines: Iterable[tuple[int, dict[str, Any] | RowError]], served: ServedModels = ANY_MODEL
) -> Iterator[BatchLine]:
    """One :class:`BatchLine` per (line number, object or error): what the file and slice readers share."""
    for number, data in lines:
        entry = BatchLine(Row.at_line(number))
        try:
            if isinstance(data, RowError):
                raise data
            _line(data, entry, served)
        except ModelNotFoundError as exc:
            entry.parsed.error = f"line {number}: {exc}"
            entry.status_code = 404
        except RowError as exc:
            entry.parsed.error = f"line {number}: {exc}"
        yield entry


class IgnoredFieldNotices:
    """Says, once per field name for the whole run, that a body field bm does not know is ignored (as
    vLLM's server warns and goes on), naming the first line that gave it. One run prints the same
    notices however it reads the file: ``bm run`` as its lines are read, ``bm run --ray``'s driver in
    its pass over the file before any replica starts (:func:`note_ignored_fields`), ``bm bench`` as it
    loads the dataset. ``say``: where a notice goes (standard error by default)."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self.said: set[str] = set()
        self._say = say or (lambda text: print_error(text, prefix="warning:"))

    def note(self, line: BatchLine) -> None:
        """Say each of ``line``'s ignored fields that no earlier line gave."""
        for key in line.ignored:
            if key not in self.said:
                self.said.add(key)
                self._say(
                    f"body.{key} (first on {line.parsed.where}): bm does not know this field; it is "
                    "ignored on every line that gives it"
                )


def note_ignored_fields(path: Path, served: ServedModels, notices: IgnoredFieldNotices) -> None:
    """One streaming pass over a batch file, noting every ignored body field (held: the names said)."""
    for line in iter_batch_file(path, served):
        notices.note(line)


def load_batch_workload(
    path: Path,
    default_max_tokens: int,
    served: ServedModels = ANY_MODEL,
    notices: IgnoredFieldNotices | None = None,
) -> Workload:
    """An OpenAI batch file as ``bm bench`` replays it (``--dataset-kind openai-batch``, or detected):
    each line's body through the same reader as ``bm run``, then as a bm line (bench replays prompts
    and token ids; a chat line is refused on its row, naming ``bm run``). Before, bench took such a file
    for a Hugging Face table and suggested ``--prompt-column``, which cannot reach a prompt in ``body``.
    ``served``: how ``body.model`` routes, as in ``bm run`` (the config's ``model.served_model_name``
    and ``model.lora_modules``); ``notices``: where ignored body fields are said, once per name."""
    try:
        check_unique_custom_ids(path)
    except DuplicateCustomIdError as exc:
        raise DatasetError(str(exc)) from None
    rows = []
    for line in iter_batch_file(path, served):
        if notices is not None:
            notices.note(line)
        rows.append(replayable(_replayable_line(line), default_max_tokens))
    return Workload("openai-batch", str(path), rows)


def _replayable_line(line: BatchLine) -> Row:
    """A line's row as bench can replay it, or refused on its row naming the line, the field and why:
    a completions prompt list (bench replays one request per line; timing its first prompt alone would
    measure another workload) and an adapter (bench runs the base model and applies none, so it would
    time another model's answers)."""
    row = line.parsed
    if row.error is not None:
        return row
    if row.more_prompts:
        row.error = (
            f"{row.where}: body.prompt: a list of {1 + len(row.more_prompts)} prompts; bm bench replays "
            "one request per line, and timing the first prompt alone would measure another workload: give "
            "each prompt its own line (bm run answers a prompt list)"
        )
    elif row.lora_dir is not None:
        row.error = (
            f"{row.where}: body.model: {line.model!r} is a LoRA adapter (--lora-modules, "
            "model.lora_modules); bm bench replays on the base model and applies no adapter, so it would "
            "time another model's answers: run this file with bm run, or name the base model's served name"
        )
    return row


class DuplicateCustomIdError(ValueError):
    """Two lines of a batch file share a ``custom_id``; phrased for the user (exit code 2)."""


def check_unique_custom_ids(path: Path, name: str | None = None) -> None:
    """Refuse a batch file in which two lines share a ``custom_id``, before anything runs.

    The output is matched to the input by ``custom_id`` alone (output lines come in the order requests
    finish), so a duplicate makes two output lines that cannot be told apart; OpenAI's Batch API refuses
    such a file at upload too. Only the ids are kept while the file is read (OpenAI caps a batch at
    50,000 lines)."""
    seen: dict[str, int] = {}
    for number, data in iter_lines(path):
        custom_id = data.get("custom_id") if isinstance(data, dict) else None
        if not isinstance(custom_id, str) or not custom_id:
            continue  # that line's own error says so
        if custom_id in seen:
            raise DuplicateCustomIdError(
                f"{name or path}: line {number}: custom_id {custom_id!r} is also on line {seen[custom_id]}; "
                "each line of a batch file needs its own custom_id (outputs are matched to inputs by it)"
            )
        seen[custom_id] = number


def _line(data: dict[str, Any], entry: BatchLine, served: ServedModels) -> None:
    custom_id = data.get("custom_id")
    if isinstance(custom_id, str) and custom_id:
        entry.custom_id = custom_id
        entry.parsed.user_id = custom_id
    unknown = sorted(set(data) - set(LINE_KEYS))
    if unknown:
        raise RowError(f"{unknown[0]}: unknown field of a batch line; allowed: {', '.join(LINE_KEYS)}")
    if entry.custom_id is None:
        raise RowError("custom_id: expected a non-empty string")
    if data.get("method", "POST") != "POST":
        raise RowError(f"method: only POST is supported, got {data.get('method')!r}")
    url = data.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise RowError(f"url: expected {CHAT_URL!r} or {COMPLETIONS_URL!r}, got {url!r}")
    entry.url = url
    body = data.get("body")
    if not isinstance(body, dict):
        raise RowError("body: expected an object with the request (messages or prompt, max_tokens, ...)")
    request = _body(body, entry, served)
    request["id"] = entry.custom_id
    try:
        parse_request(request, entry.parsed)
    except RowError as exc:
        raise RowError(f"body.{exc}") from None
    # OpenAI and vLLM cap no output a body does not cap: bm run's --max-tokens is for bm's own lines
    entry.parsed.max_tokens_to_limit = entry.parsed.max_tokens is None


def _body(body: dict[str, Any], entry: BatchLine, served: ServedModels) -> dict[str, Any]:
    """The bm request line for an OpenAI body; a field bm cannot honour raises :class:`RowError`, a model
    this run does not serve :class:`ModelNotFoundError` (checked first: a server routes before it reads
    the fields)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RowError(f"body.model: expected a string, got {model!r}")
    entry.model, adapter = served.route(model)
    chat = entry.url == CHAT_URL
    prompt_key = "messages" if chat else "prompt"
    allowed = {prompt_key, *COMMON_FIELDS, *METADATA_FIELDS, *STRUCTURED_FIELDS, *OPENAI_NO_EFFECT_FIELDS}
    allowed |= {"n", "stream", "logprobs", "logit_bias", "best_of", *VLLM_BODY_FIELDS}
    if chat:
        allowed |= {"max_completion_tokens", "top_logprobs", *TOOL_FIELDS}
    for key, (inert, fix) in REFUSED_FIELDS.items():
        if body.get(key) is not None and not _same_value(body[key], inert):
            raise RowError(f"body.{key}: bm cannot honour {key} {json.dumps(body[key])[:40]}; {fix}")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise RowError(
            f"body.best_of: {show_value(best_of)} differs from n ({body.get('n', 1)}); bm returns every "
            "sample it draws and ranks none: ask n instead and keep the best by their logprobs"
        )
    other_url = sorted(k for k in body if k in URL_FIELDS and k not in allowed)
    if other_url:
        raise RowError(
            f"body.{other_url[0]}: not a field of {entry.url}; remove it or send the line to the other url"
        )
    # Any other field is one bm does not know: ignored, as OpenAI's newer fields (reasoning_effort,
    # verbosity, ...) are by a server that predates them, and said once per run by the caller.
    entry.ignored = tuple(k for k in body if k not in allowed and k not in REFUSED_FIELDS)
    if prompt_key not in body:
        raise RowError(f"body.{prompt_key}: missing; {entry.url} needs it")
    if body.get("stream") not in (None, False):
        raise RowError("body.stream: a batch has no stream; remove it or set false")
    for key in OPENAI_NO_EFFECT_FIELDS:
        try:
            no_effect_field(key, body.get(key))
        except RowError as exc:
            raise RowError(f"body.{exc}") from None
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 2:
        raise RowError(
            f"body.temperature: {temperature} is above OpenAI's limit of 2 (the API refuses it); lower it"
        )
    request: dict[str, Any] = {prompt_key: body[prompt_key]}
    if adapter is not None:  # the same path as a bm line's lora_dir, and its adapter cache
        request["lora_dir"] = adapter
    for key in ("n", "logit_bias"):  # checked by the bm line's parser, bounds by the engine
        if body.get(key) is not None:
            request[key] = body[key]
    if not chat and isinstance(body["prompt"], list):
        first_key, first, more = _prompt_list(body["prompt"])
        del request["prompt"]
        request[first_key] = first
        entry.parsed.more_prompts = more or None
    for key, name in COMMON_FIELDS.items():
        if body.get(key) is not None:
            request[name] = body[key]
    for key in (*STRUCTURED_FIELDS, *TOOL_FIELDS, *VLLM_BODY_FIELDS):
        if key in body:
            request[key] = body[key]
    if chat and body.get("max_completion_tokens") is not None:
        if "max_tokens" in request:
            raise RowError("body.max_completion_tokens: given with max_tokens; keep one")
        request["max_tokens"] = body["max_completion_tokens"]
    logprobs = body.get("logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RowError(f"body.logprobs: expected true or false, got {logprobs!r}")
        entry.logprobs = bool(logprobs)
        top = body.get("top_logprobs")
        if top is not None:
            if top != 0 and not entry.logprobs:
                raise RowError("body.top_logprobs: needs logprobs: true; add it or drop top_logprobs")
            request["top_logprobs"] = top
            entry.top_logprobs = top if isinstance(top, int) else 0
    elif logprobs is not None:
        try:  # a count of top tokens on /v1/completions (0: the chosen token's log prob only)
            entry.top_logprobs = strict_int(logprobs, "body.logprobs", 0, MAX_COMPLETION_LOGPROBS)
        except RowError as exc:
            raise RowError(f"{exc} (on {COMPLETIONS_URL} logprobs counts the top tokens listed)") from None
        entry.logprobs = True
        if entry.top_logprobs:
            request["top_logprobs"] = entry.top_logprobs
    if entry.logprobs:
        request["return_log_probs"] = True
    _sampling_defaults(request, served.defaults)
    return request


def _sampling_defaults(request: dict[str, Any], defaults: Mapping[str, Any]) -> None:
    """What vLLM's server gives a body that leaves a sampling field out: the served model's generation
    config (``defaults``; its ``max_new_tokens`` only where neither max_tokens field is given), else
    temperature 1.0. bm's own lines keep their greedy default; an OpenAI body never meant it."""
    for name, value in {"temperature": VLLM_TEMPERATURE, **defaults}.items():
        if request.get(name) is None:  # a null is no value, as vLLM reads it
            request[name] = value


def _prompt_list(value: list[Any]) -> tuple[str, Any, list[Any]]:
    """A completions ``prompt`` given as a list, as OpenAI reads it: token ids (one prompt), or strings
    or token-id lists (one prompt each). Returns the bm line's prompt key, the first prompt and the
    others (checked here as the first is by the line's parser)."""
    if not value:
        raise RowError("body.prompt: the list is empty; give a string, a list of strings or token ids")
    if all(is_int(t) for t in value):
        return "input_ids", value, []
    if all(isinstance(p, str) for p in value):
        if not all(value):
            raise RowError("body.prompt: a prompt of the list is empty")
        return "prompt", value[0], value[1:]
    if all(isinstance(p, list) for p in value):
        for i, ids in enumerate(value):
            try:
                token_ids(ids, f"prompt[{i}]")
            except RowError as exc:
                raise RowError(f"body.{exc}") from None
        return "input_ids", value[0], value[1:]
    raise RowError(
        "body.prompt: expected a string, a list of strings, a list of token ids or a list of token-id "
        "lists, not a mix"
    )


def _same_value(value: Any, inert: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``inert`` (``False`` is not ``0`` here)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in inert)
