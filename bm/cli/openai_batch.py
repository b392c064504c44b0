"""OpenAI Batch API files: the input users already have, and ``batch_output.jsonl`` in OpenAI's format.

An input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}``. The body is mapped onto bm's request format and parsed by the same parser as a bm line,
so the same checks apply, vLLM's sampling extensions (``top_k``, ``min_tokens``, ``ignore_eos``, ...)
included. ``body.model`` picks the base model or an adapter (:class:`ServedModels`; any other name is a
404). A field that would change the answer and that bm cannot honour (``echo``, ``suffix``, ``best_of``
above ``n``, ``logprobs`` beyond 5 on completions, ...) makes that line an error record naming it. Fields
that change nothing computed (``store``, ``service_tier``, ``parallel_tool_calls``, ``stream_options``
beside ``stream: false``) are accepted once their type is right; a field bm does not know at all
(``reasoning_effort``, ``verbosity``, ...) is ignored, and ``bm run`` says so once per field name. Plain
Python (no torch): the file is checked before the model loads.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bm.cli.writers import JsonlWriter
from bm.config import ModelConfig
from bm.engine.fields import (
    MAX_COMPLETION_LOGPROBS,
    OPENAI_NO_EFFECT_FIELDS,
    is_int,
    no_effect_field,
    show_value,
    strict_int,
)
from bm.files import replacing_text
from bm.workloads.jsonl import iter_lines, iter_slice_lines, parse_request, token_ids
from bm.workloads.records import replayable
from bm.workloads.request import DatasetError, Row, RowError, Workload
from bm.workloads.tool_parsers import parse_tool_calls
from bm.workloads.tools import tool_calls, tool_names

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
# Passed through to bm's line as they are: structured output (bm.engine.structured) and tools
# (bm.workloads.tools), read and checked there.
STRUCTURED_FIELDS = ("response_format",)
TOOL_FIELDS = ("tools", "tool_choice")
FINISH_REASONS = {"end_id": "stop", "stop": "stop", "length": "length"}
# bm's field names in an engine error -> the body field the user wrote (an error's ``param``)
OPENAI_NAMES = {
    "num_return_sequences": "n",
    "random_seed": "seed",
    "runtime_top_p": "top_p",
    "request_output_len": "max_tokens",
    "stop_words_list": "stop",
    "return_log_probs": "logprobs",
}
FIELD_PATH = re.compile(r"^(?:line \d+: )?(?:body\.)?([A-Za-z_][\w.\[\]]*): ")


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


class ModelNotFoundError(RowError):
    """A line's ``body.model`` names neither a served name of the base model nor an adapter: answered
    with HTTP 404, as OpenAI and vLLM answer a request for a model they do not serve."""


@dataclass(frozen=True)
class ServedModels:
    """What a line's ``body.model`` may name, as vLLM serves them: the base model under any of its
    served names (``--served-model-name``), or a PEFT adapter by its ``--lora-modules`` name. A line
    naming anything else is refused (404), never answered by another model. ``routes`` False (``bm
    bench``, which replays prompts for timing): any name is the base model's."""

    names: tuple[str, ...]
    adapters: Mapping[str, str] = field(default_factory=dict)
    routes: bool = True

    @classmethod
    def of(cls, model: ModelConfig) -> ServedModels:
        """The names a run over ``model`` (the config's ``model`` section) answers to."""
        adapters = {name: str(Path(d).resolve()) for name, d in (model.lora_modules or {}).items()}
        return cls(tuple(model.served_names), adapters)

    def route(self, model: str | None) -> tuple[str | None, str | None]:
        """(the name the response gives, the adapter directory or None) for a line's ``body.model``; a
        line naming none is the base model's, as vLLM answers it. Raises :class:`ModelNotFoundError`."""
        if not self.routes:
            return model, None
        if model is None or model in self.names:
            return (model or self.names[0]), None
        if model in self.adapters:
            return model, self.adapters[model]
        served = ", ".join(repr(n) for n in self.names)
        adapters = ", ".join(repr(n) for n in self.adapters)
        where = f"the base model is served as {served} (--served-model-name)" + (
            f" and the adapters as {adapters} (--lora-modules)" if adapters else ""
        )
        raise ModelNotFoundError(
            f"body.model: {model!r} is not served by this run; {where}. Name one of them, or serve this "
            "name with --served-model-name NAME (the base model) or --lora-modules NAME=DIR (an adapter)"
        )


ANY_MODEL = ServedModels(("bm",), routes=False)


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


def load_batch_workload(path: Path, default_output_len: int) -> Workload:
    """An OpenAI batch file as ``bm bench`` replays it (``--dataset-kind openai-batch``, or detected):
    each line's body through the same reader as ``bm run``, then as a bm line (bench replays prompts
    and token ids; a chat line is refused on its row, naming ``bm run``). Before, bench took such a file
    for a Hugging Face table and suggested ``--prompt-column``, which cannot reach a prompt in ``body``."""
    try:
        check_unique_custom_ids(path)
    except DuplicateCustomIdError as exc:
        raise DatasetError(str(exc)) from None
    rows = [replayable(_one_prompt(line.parsed), default_output_len) for line in iter_batch_file(path)]
    return Workload("openai-batch", str(path), rows)


def _one_prompt(row: Row) -> Row:
    """A row bench can replay: a completions prompt list is refused on its row (bench replays a request
    per line; dropping the other prompts would time another workload)."""
    if row.more_prompts and row.error is None:
        row.error = (
            f"{row.where}: body.prompt: bm bench replays one prompt per line; give each prompt its own "
            "line (bm run answers a prompt list)"
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
    entry.parsed.output_len_to_limit = entry.parsed.output_len is None


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
    return request


class BatchOutput:
    """``batch_output.jsonl``, one line per input line, written as each request's record is written.

    Lines come in the order requests finish, as in OpenAI's own batch output (match them by
    ``custom_id``); nothing is held back to sort them, so memory does not grow with the file. On
    ``--resume`` the lines of the records the run keeps are carried over first (rewritten in one step),
    and the lines of requests that were cancelled are dropped, since those requests run again."""

    def __init__(
        self,
        out_dir: Path,
        model_name: str,
        decode_token: Callable[[int], str] | None = None,
        keep: set[int] | None = None,
        path: Path | None = None,
    ) -> None:
        # ``path``: where the lines go instead (``bm run --ray`` writes a temporary file, renamed over
        # ``batch_output.jsonl`` once whole)
        self.path = path or out_dir / "batch_output.jsonl"
        self.model_name = model_name
        self.decode_token = decode_token
        self.created = int(time.time())
        if keep is not None and self.path.exists():
            with replacing_text(self.path) as f:
                for _number, data in iter_lines(self.path):
                    if isinstance(data, dict) and _line_index(data) in keep:
                        f.write(json.dumps(data, ensure_ascii=False) + "\n")
        self._file = JsonlWriter(self.path, append=keep is not None)

    def write(self, line: BatchLine, record: dict[str, Any] | None) -> None:
        out = batch_output_line(
            line.parsed.index, line, record, self.model_name, self.created, self.decode_token
        )
        self._file.write(out)

    def close(self) -> None:
        self._file.close()


def token_decoder(tokenizer: Any) -> Callable[[int], str] | None:
    """How an output line's logprobs name a token (``decode_token`` of :class:`BatchOutput`): its text
    by ``tokenizer`` (one with ``decode``); None without one (the id is written as text)."""
    return (lambda token: tokenizer.decode([token])) if tokenizer is not None else None


def _line_index(data: dict[str, Any]) -> int | None:
    """The input line index an output line answers (its ``id`` is ``batch_req_bm_<index>``)."""
    ident = data.get("id")
    prefix = "batch_req_bm_"
    if isinstance(ident, str) and ident.startswith(prefix) and ident[len(prefix) :].isdigit():
        return int(ident[len(prefix) :])
    return None


def batch_output_line(
    index: int,
    line: BatchLine,
    record: dict[str, Any] | None,
    model_name: str,
    created: int,
    decode_token: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """One line of OpenAI's batch output: ``response`` with a completion body, or an error."""
    base: dict[str, Any] = {"id": f"batch_req_bm_{index}", "custom_id": line.custom_id}
    if record is None or record.get("finish_reason") == "cancelled":
        message = "the run was interrupted before this request finished; run again with --resume"
        return {**base, "response": None, "error": {"code": "cancelled", "message": message}}
    if record.get("finish_reason") not in FINISH_REASONS:
        message = record.get("error") or "failed"
        not_found = line.status_code == 404
        error = {
            "message": message,
            "type": "invalid_request_error",
            "param": _prompt_param(error_param(message), line),
            "code": "model_not_found" if not_found else None,
        }
        body = {"error": error}
        response = {"status_code": line.status_code, "request_id": f"bm-{index}", "body": body}
        return {**base, "response": response, "error": None}
    prompt_tokens = record.get("num_prompt_tokens") or 0
    completion_tokens = record.get("num_output_tokens") or 0
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    decode = decode_token or str
    samples = record.get("samples") or [record]  # n > 1: every sample; else the record is the one
    model = line.model or model_name
    if line.url == CHAT_URL:
        choices = [_chat_choice(i, sample, line, decode) for i, sample in enumerate(samples)]
        body = {"id": f"chatcmpl-bm-{index}", "object": "chat.completion", "created": created, "model": model}
    else:
        choices = [_completion_choice(i, sample, line, decode) for i, sample in enumerate(samples)]
        body = {"id": f"cmpl-bm-{index}", "object": "text_completion", "created": created, "model": model}
    body.update(choices=choices, usage=usage)
    return {
        **base,
        "response": {"status_code": 200, "request_id": f"bm-{index}", "body": body},
        "error": None,
    }


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


def _prompt_param(param: str | None, line: BatchLine) -> str | None:
    """The engine names a prompt ``input_ids``; the user wrote ``messages`` (chat) or ``prompt``."""
    if param != "input_ids":
        return param
    return "messages" if line.url == CHAT_URL else "prompt"


def error_param(message: str) -> str | None:
    """The body field an error names (``line 3: body.n: ...`` -> ``n``; bm's own names for a field, as
    the engine reports them, become the body's: ``random_seed`` -> ``seed``)."""
    found = FIELD_PATH.match(message)
    if found is None:
        return None
    path = found.group(1)
    head, sep, rest = path.partition(".")
    return OPENAI_NAMES.get(head, head) + sep + rest


def _scored_tokens(sample: dict[str, Any], line: BatchLine, decode: Callable[[int], str]):
    """(token text, log prob, top pairs) per generated token, without the end token (the text holds none
    of it); None when log probs were not asked for."""
    log_probs = sample.get("output_log_probs") if line.logprobs else None
    if log_probs is None:
        return None
    ids = list(sample.get("output_ids", []))
    tops = sample.get("top_log_probs") or [[] for _ in ids]
    if sample.get("finish_reason") == "end_id" and ids:
        ids, log_probs, tops = ids[:-1], log_probs[: len(ids) - 1], tops[: len(ids) - 1]
    return [
        (decode(t), lp, [(decode(int(tok)), v) for tok, v in top])
        for t, lp, top in zip(ids, log_probs, tops, strict=False)
    ]


def _chat_choice(
    index: int, sample: dict[str, Any], line: BatchLine, decode: Callable[[int], str]
) -> dict[str, Any]:
    scored = _scored_tokens(sample, line, decode)
    logprobs = None
    if scored is not None:
        logprobs = {
            "content": [
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top
                    ],
                }
                for tok, lp, top in scored
            ],
            "refusal": None,
        }
    message: dict[str, Any] = {"role": "assistant", "content": sample.get("text") or "", "refusal": None}
    reason = FINISH_REASONS[sample["finish_reason"]]
    call_id = f"call_bm_{line.parsed.index}" + (f"_{index}" if index else "")
    calls = tool_calls(message["content"], call_id) if line.parsed.tool_call and reason == "stop" else None
    if calls is not None:  # tool_choice constrained the reply to a call: OpenAI returns it as tool_calls
        message.update(content=None, tool_calls=calls)
        reason = "tool_calls"
    elif line.parsed.tool_parser is not None:  # tool_choice auto: the model chose; its parser tells which
        reply = parse_tool_calls(
            line.parsed.tool_parser, message["content"], tool_names(line.parsed.tools), call_id
        )
        if reply.tool_calls is not None:
            message.update(content=reply.content, tool_calls=reply.tool_calls)
            reason = "tool_calls" if reason == "stop" else reason
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def _completion_choice(
    index: int, sample: dict[str, Any], line: BatchLine, decode: Callable[[int], str]
) -> dict[str, Any]:
    scored = _scored_tokens(sample, line, decode)
    logprobs = None
    if scored is not None:
        offsets, at = [], 0
        for tok, _lp, _top in scored:
            offsets.append(at)
            at += len(tok)
        logprobs = {
            "tokens": [tok for tok, _lp, _top in scored],
            "token_logprobs": [lp for _tok, lp, _top in scored],
            "top_logprobs": [dict(top) for _tok, _lp, top in scored] if line.top_logprobs else None,
            "text_offset": offsets,
        }
    reason = FINISH_REASONS[sample["finish_reason"]]
    return {"index": index, "text": sample.get("text") or "", "logprobs": logprobs, "finish_reason": reason}
