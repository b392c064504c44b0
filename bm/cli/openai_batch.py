"""OpenAI Batch API files: the input users already have, and ``batch_output.jsonl`` in OpenAI's format.

An input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}``. The body is mapped onto bm's request format and parsed by the same parser as a bm line,
so the same checks apply. A body field bm cannot honour (``n: 2``, ``top_logprobs``, ...) makes
that line an error record; it is never silently ignored. Plain Python (no torch): the file is checked
before the model loads.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.workloads.jsonl import iter_lines, parse_request
from bm.workloads.request import Row, RowError
from bm.workloads.tools import tool_calls

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
# Passed through to bm's line as they are: structured output (bm.engine.structured) and tools
# (bm.workloads.tools), read and checked there.
STRUCTURED_FIELDS = ("response_format",)
TOOL_FIELDS = ("tools", "tool_choice")
FINISH_REASONS = {"end_id": "stop", "stop": "stop", "length": "length"}


@dataclass
class BatchLine:
    """One input line: the bm request it maps to, and what the output line needs back."""

    parsed: Row
    custom_id: str | None = None
    url: str = CHAT_URL
    model: str | None = None
    logprobs: bool = False


def is_batch_file(path: Path) -> bool:
    """True when the first JSON object looks like an OpenAI batch request (``custom_id`` and ``body``);
    lines before it that are not objects do not decide (they become error records either way)."""
    for _number, data in iter_lines(path):
        if isinstance(data, dict):
            return "custom_id" in data and "body" in data
    return False


def iter_batch_file(path: Path) -> Iterator[BatchLine]:
    """Every non-blank line as a :class:`BatchLine` (a line bm cannot run carries its error), read as they
    are asked for: only the custom ids seen so far are kept (to refuse a duplicate), so a file of millions
    of lines is never held whole."""
    seen: dict[str, int] = {}
    for number, data in iter_lines(path):
        entry = BatchLine(Row.at_line(number))
        try:
            if isinstance(data, RowError):
                raise data
            _line(data, entry)
            if entry.custom_id in seen:
                raise RowError(
                    f"custom_id: duplicate {entry.custom_id!r} (also on line {seen[entry.custom_id]}); "
                    "custom ids must be unique"
                )
            seen[entry.custom_id] = number  # type: ignore[index]
        except RowError as exc:
            entry.parsed.error = f"line {number}: {exc}"
        yield entry


def _line(data: dict[str, Any], entry: BatchLine) -> None:
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
    request = _body(body, entry)
    request["id"] = entry.custom_id
    try:
        parse_request(request, entry.parsed)
    except RowError as exc:
        raise RowError(f"body.{exc}") from None


def _body(body: dict[str, Any], entry: BatchLine) -> dict[str, Any]:
    """The bm request line for an OpenAI body; a field bm cannot honour raises :class:`RowError`."""
    chat = entry.url == CHAT_URL
    prompt_key = "messages" if chat else "prompt"
    allowed = {prompt_key, *COMMON_FIELDS, *METADATA_FIELDS, *STRUCTURED_FIELDS, "n", "stream", "logprobs"}
    if chat:
        allowed |= {"max_completion_tokens", "top_logprobs", *TOOL_FIELDS}
    for key in body:
        if key not in allowed:
            raise RowError(
                f"body.{key}: bm cannot honour this field on {entry.url}; remove it (supported: "
                f"{', '.join(sorted(allowed))})"
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RowError(f"body.model: expected a string, got {model!r}")
    entry.model = model
    if prompt_key not in body:
        raise RowError(f"body.{prompt_key}: missing; {entry.url} needs it")
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise RowError(f"body.n: bm returns one choice per request; got {body.get('n')!r} (use 1)")
    if body.get("stream", False) is not False:
        raise RowError("body.stream: a batch has no stream; remove it or set false")
    request: dict[str, Any] = {prompt_key: body[prompt_key]}
    if not chat and isinstance(body["prompt"], list):
        raise RowError("body.prompt: bm runs one prompt per line; give a string, not a list")
    for key, name in COMMON_FIELDS.items():
        if body.get(key) is not None:
            request[name] = body[key]
    for key in (*STRUCTURED_FIELDS, *TOOL_FIELDS):
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
        top = body.get("top_logprobs")
        if top not in (None, 0) or isinstance(top, bool):
            raise RowError(
                f"body.top_logprobs: bm returns the chosen token's log prob only; got {top!r} (use 0)"
            )
        entry.logprobs = bool(logprobs)
    elif logprobs is not None:
        if isinstance(logprobs, bool) or logprobs != 0:
            raise RowError(
                f"body.logprobs: bm returns the chosen token's log prob only; got {logprobs!r} (use 0)"
            )
        entry.logprobs = True
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
    ) -> None:
        self.path = out_dir / "batch_output.jsonl"
        self.model_name = model_name
        self.decode_token = decode_token
        self.created = int(time.time())
        if keep is not None and self.path.exists():
            fresh = self.path.with_suffix(".jsonl.tmp")
            with fresh.open("w", encoding="utf-8") as f:
                for _number, data in iter_lines(self.path):
                    if isinstance(data, dict) and _line_index(data) in keep:
                        f.write(json.dumps(data, ensure_ascii=False) + "\n")
            os.replace(fresh, self.path)
        self._file = self.path.open("a" if keep is not None else "w", encoding="utf-8")

    def write(self, line: BatchLine, record: dict[str, Any] | None) -> None:
        out = batch_output_line(
            line.parsed.index, line, record, self.model_name, self.created, self.decode_token
        )
        self._file.write(json.dumps(out, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
        error = {
            "message": record.get("error") or "failed",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        response = {"status_code": 400, "request_id": f"bm-{index}", "body": {"error": error}}
        return {**base, "response": response, "error": None}
    prompt_tokens = record.get("num_prompt_tokens") or 0
    completion_tokens = record.get("num_output_tokens") or 0
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    text = record.get("text") or ""
    reason = FINISH_REASONS[record["finish_reason"]]
    model = line.model or model_name
    log_probs = record.get("output_log_probs") if line.logprobs else None
    tokens = [decode_token(t) if decode_token else str(t) for t in record.get("output_ids", [])]
    if line.url == CHAT_URL:
        logprobs = None
        if log_probs is not None:
            logprobs = {
                "content": [
                    {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
                    for tok, lp in zip(tokens, log_probs, strict=False)
                ],
                "refusal": None,
            }
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        calls = tool_calls(text, f"call_bm_{index}") if line.parsed.tool_call and reason == "stop" else None
        if calls is not None:
            message.update(content=None, tool_calls=calls)
            reason = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        body = {"id": f"chatcmpl-bm-{index}", "object": "chat.completion", "created": created, "model": model}
    else:
        logprobs = None
        if log_probs is not None:
            offsets, at = [], 0
            for tok in tokens:
                offsets.append(at)
                at += len(tok)
            logprobs = {
                "tokens": tokens,
                "token_logprobs": log_probs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        body = {"id": f"cmpl-bm-{index}", "object": "text_completion", "created": created, "model": model}
    body.update(choices=[choice], usage=usage)
    return {
        **base,
        "response": {"status_code": 200, "request_id": f"bm-{index}", "body": body},
        "error": None,
    }
