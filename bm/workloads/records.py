"""Prompt datasets stored as JSON: bm's JSONL, trtllm-bench's JSONL, and ShareGPT.

- bm JSONL (what ``bm run`` reads): ``{"id"?, "prompt" | "input_ids" | "messages", "request_output_len"? (or
  ``max_tokens``, ``max_new_tokens``, ``output_tokens``), "arrival_time"? (seconds), <request fields>}``.
- trtllm-bench JSONL (``prepare_dataset.py``): ``{"task_id", "prompt" | "input_ids", "output_tokens"}``.
- ShareGPT JSON: a list of ``{"id"?, "conversations": [{"from", "value"}, ...]}``; the first turn is the
  prompt and the second turn's token count the output length (as ``vllm bench`` does). Conversations
  with fewer than two turns are not requests: they are counted as skipped, not run.

Every reader yields :class:`~bm.workloads.request.Row` values, the type ``bm run`` reads too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bm.workloads.jsonl import iter_lines, iter_request_file, parse_prompt
from bm.workloads.request import DatasetError, Row, RowError, Workload, positive_int

TRTLLM_KEYS = ("task_id", "prompt", "input_ids", "output_tokens")


def load_bm_jsonl(path: Path, default_max_tokens: int) -> Workload:
    """bm's own format through the one parser ``bm run`` uses, so a file means the same to both."""
    return Workload("bm", str(path), [replayable(row, default_max_tokens) for row in iter_request_file(path)])


def replayable(row: Row, default_max_tokens: int) -> Row:
    """A parsed request line (bm's, or an OpenAI batch line's) as ``bm bench`` replays it: its output
    length settled. A chat (``messages``) is rendered with the model's chat template and stop strings
    are tokenized once the model is loaded (:func:`bm.workloads.load.load_workload`), as ``bm run``
    does with the same line."""
    if row.ok:
        row.max_tokens = row.max_tokens or default_max_tokens
        if row.input_ids is not None:
            row.input_len = len(row.input_ids)
    return row


def load_trtllm_jsonl(path: Path) -> Workload:
    rows = []
    for number, data in iter_lines(path):
        row = Row.at_line(number)
        try:
            if isinstance(data, RowError):
                raise data
            for name in ("task_id", "output_tokens"):
                if name not in data:
                    raise RowError(
                        f"missing field {name!r}; trtllm-bench lines hold {', '.join(TRTLLM_KEYS)}"
                    )
            row.user_id = data["task_id"]
            parse_prompt(data, row, keys=("prompt", "input_ids"))
            row.input_len = len(row.input_ids) if row.input_ids is not None else 0
            row.max_tokens = positive_int(data["output_tokens"], "output_tokens")
        except RowError as exc:
            row.error = f"{row.where}: {exc}"
        rows.append(row)
    return Workload("trtllm", str(path), rows)


def load_sharegpt(path: Path) -> Workload:
    try:
        entries = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(entries, list):
        raise DatasetError(
            f"{path}: expected a JSON list of conversations (ShareGPT), got {type(entries).__name__}"
        )
    rows, skipped = [], 0
    for i, entry in enumerate(entries):
        row = Row(where=f"entry {i}", index=i)
        try:
            if not isinstance(entry, dict):
                raise RowError(f"expected an object with 'conversations', got {type(entry).__name__}")
            row.user_id = entry.get("id", i)
            turns = entry.get("conversations")
            if not isinstance(turns, list):
                raise RowError("missing field 'conversations' (a list of {'from', 'value'} turns)")
            if len(turns) < 2:
                skipped += 1
                continue
            row.prompt = _turn_text(turns[0], "conversations[0]")
            row.output_text = _turn_text(turns[1], "conversations[1]")
        except RowError as exc:
            row.error = f"{row.where}: {exc}"
        rows.append(row)
    reason = "conversations with fewer than two turns" if skipped else ""
    return Workload("sharegpt", str(path), rows, num_skipped=skipped, skipped_reason=reason)


def _turn_text(turn: Any, name: str) -> str:
    if not isinstance(turn, dict) or "value" not in turn:
        raise RowError(f"{name}: missing field 'value'")
    value = turn["value"]
    if not isinstance(value, str):
        raise RowError(f"{name}.value: expected a string, got {type(value).__name__}")
    if not value:
        raise RowError(f"{name}.value: the text is empty")
    return value
