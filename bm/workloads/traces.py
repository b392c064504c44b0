"""Timed traces that carry lengths but no tokens: the Azure LLM inference trace and Mooncake's form.

- Azure (2023/2024 conversation and code traces): CSV ``TIMESTAMP, ContextTokens, GeneratedTokens``;
  the published files have a UTF-8 BOM and CRLF line ends, both accepted.
- Mooncake: ``timestamp`` (milliseconds, as in Mooncake's published traces), ``input_length``,
  ``output_length`` and optionally ``hash_ids``, one id per ``hash_block_size`` tokens of the prompt:
  equal ids mean the same tokens, i.e. a shared prefix block. JSONL (Mooncake's own form) or CSV (with
  ``hash_ids`` as a JSON list).

Token ids are generated later (random ids of the given lengths; see :mod:`bm.workloads.load`).
Messages name lines as an editor shows them (the CSV header is line 1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from bm.workloads.jsonl import iter_lines
from bm.workloads.request import (
    DatasetError,
    Row,
    RowError,
    Workload,
    positive_int,
    timestamp,
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_COLUMNS = ("timestamp", "input_length", "output_length")


def read_csv(path: Path, required: tuple[str, ...], kind: str) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path, encoding="utf-8-sig", dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as exc:
        raise DatasetError(f"{path}: not a readable CSV file ({exc})") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise DatasetError(
            f"{path}: missing column {missing[0]!r} for a {kind} trace; it has {', '.join(frame.columns)} "
            f"and needs {', '.join(required)}"
        )
    return frame


def _number(text: str) -> Any:
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() else value


def load_azure(path: Path) -> Workload:
    frame = read_csv(path, AZURE_COLUMNS, "Azure LLM inference")
    stamps = pd.to_datetime(frame["TIMESTAMP"].str.strip(), format="ISO8601", errors="coerce")
    bad = stamps.isna()
    if bad.any():
        row = int(bad.to_numpy().nonzero()[0][0])
        raise DatasetError(
            f"{path}: line {row + 2}: TIMESTAMP: {frame['TIMESTAMP'].iloc[row]!r} is not a date and time "
            "(expected e.g. 2023-11-16 18:15:46.6805900)"
        )
    seconds = (stamps - stamps.iloc[0]).dt.total_seconds().tolist() if len(frame) else []
    requests = []
    contexts, generated = frame["ContextTokens"].tolist(), frame["GeneratedTokens"].tolist()
    for row, (t, n_in, n_out) in enumerate(zip(seconds, contexts, generated, strict=True)):
        req = Row(where=f"line {row + 2}", index=row, user_id=row, arrival_time=t)
        try:
            req.input_len = positive_int(_number(n_in), "ContextTokens")
            req.max_tokens = positive_int(_number(n_out), "GeneratedTokens")
        except RowError as exc:
            req.error = f"{req.where}: {exc}"
        requests.append(req)
    return Workload("azure", str(path), requests)


def load_mooncake(path: Path, hash_block_size: int) -> Workload:
    if path.suffix.lower() == ".csv":
        frame = read_csv(path, MOONCAKE_COLUMNS, "Mooncake")
        rows = [
            (f"line {i + 2}", {k: v for k, v in row.items() if v != ""})
            for i, row in enumerate(frame.to_dict("records"))
        ]
        for _, row in rows:
            for key in MOONCAKE_COLUMNS:
                if key in row:
                    row[key] = _number(row[key])
    else:
        rows = [(f"line {number}", data) for number, data in iter_lines(path)]
    requests = [_mooncake_row(where, i, row) for i, (where, row) in enumerate(rows)]
    _relative_to_first(requests)
    return Workload("mooncake", str(path), requests, hash_block_size=hash_block_size)


def _mooncake_row(where: str, index: int, data: dict[str, Any] | RowError) -> Row:
    req = Row(where=where, index=index)
    try:
        if isinstance(data, RowError):
            raise data
        if "timestamp" not in data:
            raise DatasetError(
                f"{where}: missing field 'timestamp' (milliseconds); a trace needs one per row"
            )
        req.arrival_time = timestamp(data["timestamp"], where, "timestamp", unit=1e-3)
        for name in ("input_length", "output_length"):
            if name not in data:
                raise RowError(
                    f"missing field {name!r}; Mooncake rows hold {', '.join(MOONCAKE_COLUMNS)}[, hash_ids]"
                )
        req.input_len = positive_int(data["input_length"], "input_length")
        req.max_tokens = positive_int(data["output_length"], "output_length")
        req.hash_ids = _hash_ids(data.get("hash_ids"))
        req.user_id = data.get("id", where)
    except RowError as exc:
        req.error = f"{where}: {exc}"
    return req


def _hash_ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise RowError(f"hash_ids: expected a JSON list of integers, got {value!r}") from None
    if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in value):
        raise RowError(f"hash_ids: expected a list of integers, got {value!r}")
    return value


def _relative_to_first(requests: list[Row]) -> None:
    """Seconds since the first row's timestamp, so a trace excerpt starts at once."""
    first = next((r.arrival_time for r in requests if r.arrival_time is not None), None)
    if first is None or math.isclose(first, 0.0):
        return
    for req in requests:
        if req.arrival_time is not None:
            req.arrival_time -= first
