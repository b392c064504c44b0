"""``batch_output.jsonl`` in OpenAI's format: one output line per input line, built from the line's
:class:`~bm.runfiles.openai_batch.BatchLine` and the record bm wrote for it (a response with its choices,
log probs and tool calls, an error response with its status code and ``param``, or a cancelled line).
Apart from the input side (:mod:`bm.runfiles.openai_batch`, which maps a body onto a bm line) because the two
change for different reasons: the reader follows the request fields, this follows the response schema.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bm.engine.requests.fields import USER_NAMES
from bm.files import replacing_text
from bm.runfiles.openai_batch import CHAT_URL, BatchLine
from bm.runfiles.writers import JsonlWriter
from bm.workloads.jsonl import iter_lines
from bm.workloads.tool_parsers import parse_tool_calls
from bm.workloads.tools import tool_calls, tool_names

FINISH_REASONS = {"stop": "stop", "length": "length", "end_id": "stop"}  # end_id: older records
# bm's field names in an engine error -> the body field the user wrote (an error's ``param``): the one
# table's vLLM names, which are OpenAI's too, except ``top_logprobs``, which a chat body names itself.
OPENAI_NAMES = {engine: user for engine, user in USER_NAMES.items() if engine != "top_logprobs"}
FIELD_PATH = re.compile(r"^(?:line \d+: )?(?:body\.)?([A-Za-z_][\w.\[\]]*): ")


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


def _ended_on_end_token(sample: dict[str, Any]) -> bool:
    """``stop`` with no ``stop_reason`` (vLLM's rule: the end token, not a stop string or token); a
    record of an older bm says ``end_id``."""
    reason = sample.get("finish_reason")
    return reason == "end_id" or (
        reason == "stop" and "stop_reason" in sample and sample["stop_reason"] is None
    )


def _scored_tokens(sample: dict[str, Any], line: BatchLine, decode: Callable[[int], str]):
    """(token text, log prob, top pairs) per generated token, without the end token (the text holds none
    of it); None when log probs were not asked for."""
    log_probs = sample.get("output_log_probs") if line.logprobs else None
    if log_probs is None:
        return None
    ids = list(sample.get("output_ids", []))
    tops = sample.get("top_log_probs") or [[] for _ in ids]
    if _ended_on_end_token(sample) and ids:
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
