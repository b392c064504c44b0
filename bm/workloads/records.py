"""Prompt datasets stored as JSON: bm's JSONL, trtllm-bench's JSONL, and ShareGPT.

- bm JSONL (what ``bm run`` reads): ``{"id"?, "prompt" | "input_ids", "request_output_len"? (or
  ``max_tokens``, ``max_new_tokens``, ``output_tokens``), "arrival_time"? (seconds), <request fields>}``.
- trtllm-bench JSONL (``prepare_dataset.py``): ``{"task_id", "prompt" | "input_ids", "output_tokens"}``.
- ShareGPT JSON: a list of ``{"id"?, "conversations": [{"from", "value"}, ...]}``; the first turn is the
  prompt and the second turn's token count the output length (as ``vllm bench`` does). Conversations
  with fewer than two turns are not requests: they are counted as skipped, not run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bm.workloads.jsonl import iter_lines, read_request_file
from bm.workloads.request import (
    DatasetError,
    RowError,
    Workload,
    WorkloadRequest,
    positive_int,
    token_ids,
)

TRTLLM_KEYS = ("task_id", "prompt", "input_ids", "output_tokens")


def iter_json_lines(path: Path) -> Iterator[tuple[str, dict[str, Any] | RowError]]:
    """(``"line N"``, object) per non-blank line; a bad line (bytes, JSON, nesting) yields its error."""
    for number, data in iter_lines(path):
        yield f"line {number}", data


def _prompt(data: dict[str, Any], req: WorkloadRequest) -> None:
    has_text, has_ids = "prompt" in data, "input_ids" in data
    if has_text and has_ids:
        raise RowError("give either 'prompt' or 'input_ids', not both")
    if not has_text and not has_ids:
        raise RowError("missing field 'prompt' (text) or 'input_ids' (token ids)")
    if has_ids:
        req.input_ids = token_ids(data["input_ids"], "input_ids")
        req.input_len = len(req.input_ids)
        return
    text = data["prompt"]
    if not isinstance(text, str):
        raise RowError(f"prompt: expected a string, got {type(text).__name__}")
    if not text:
        raise RowError("prompt: the prompt is empty")
    req.prompt_text = text


def _row(where: str, parsed: dict[str, Any] | RowError, fill) -> WorkloadRequest:
    req = WorkloadRequest(source=where)
    try:
        if isinstance(parsed, RowError):
            raise parsed
        fill(parsed, req)
    except RowError as exc:
        req.error = f"{where}: {exc}"
    return req


def load_bm_jsonl(path: Path, default_output_len: int) -> Workload:
    """bm's own format through the one parser ``bm run`` uses, so a file means the same to both."""
    requests = []
    for line in read_request_file(path):
        req = WorkloadRequest(source=line.where, user_id=line.user_id, error=line.error)
        if line.ok:
            req.timestamp = line.arrival_time
            req.output_len = line.output_len or default_output_len
            req.fields = dict(line.fields)
            if line.input_ids is not None:
                req.input_ids = line.input_ids
                req.input_len = len(line.input_ids)
            elif line.prompt is not None:
                req.prompt_text = line.prompt
            else:
                req.error = (
                    f"{line.where}: messages: bm bench replays 'prompt' or 'input_ids' lines; "
                    "render the chat with bm run, or give the prompt as text"
                )
            if line.stop and req.ok:
                req.error = f"{line.where}: stop: stop strings are read by bm run; give stop_words_list"
        requests.append(req)
    return Workload("bm", str(path), requests)


def load_trtllm_jsonl(path: Path) -> Workload:
    def fill(data: dict[str, Any], req: WorkloadRequest) -> None:
        for name in ("task_id", "output_tokens"):
            if name not in data:
                raise RowError(f"missing field {name!r}; trtllm-bench lines hold {', '.join(TRTLLM_KEYS)}")
        req.user_id = data["task_id"]
        _prompt(data, req)
        req.output_len = positive_int(data["output_tokens"], "output_tokens")

    requests = [_row(where, parsed, fill) for where, parsed in iter_json_lines(path)]
    return Workload("trtllm", str(path), requests)


def load_sharegpt(path: Path) -> Workload:
    try:
        entries = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(entries, list):
        raise DatasetError(
            f"{path}: expected a JSON list of conversations (ShareGPT), got {type(entries).__name__}"
        )
    requests, skipped = [], 0
    for i, entry in enumerate(entries):
        where = f"entry {i}"
        req = WorkloadRequest(source=where)
        try:
            if not isinstance(entry, dict):
                raise RowError(f"expected an object with 'conversations', got {type(entry).__name__}")
            req.user_id = entry.get("id", i)
            turns = entry.get("conversations")
            if not isinstance(turns, list):
                raise RowError("missing field 'conversations' (a list of {'from', 'value'} turns)")
            if len(turns) < 2:
                skipped += 1
                continue
            req.prompt_text = _turn_text(turns[0], "conversations[0]")
            req.output_text = _turn_text(turns[1], "conversations[1]")
        except RowError as exc:
            req.error = f"{where}: {exc}"
        requests.append(req)
    reason = "conversations with fewer than two turns" if skipped else ""
    return Workload("sharegpt", str(path), requests, num_skipped=skipped, skipped_reason=reason)


def _turn_text(turn: Any, name: str) -> str:
    if not isinstance(turn, dict) or "value" not in turn:
        raise RowError(f"{name}: missing field 'value'")
    value = turn["value"]
    if not isinstance(value, str):
        raise RowError(f"{name}.value: expected a string, got {type(value).__name__}")
    if not value:
        raise RowError(f"{name}.value: the text is empty")
    return value
