"""The shape every dataset loader produces, and the checks they share.

A loader turns rows into :class:`WorkloadRequest` records without tokenizing or generating token ids:
that happens once, after shuffling and ``num_requests`` have chosen the rows that run (so a 90k-entry
ShareGPT file costs nothing beyond the rows used). A row that cannot run keeps its place with an
``error``: it is reported as a failed request, never dropped. A problem with the file itself (a missing
column, timestamps out of order) raises :class:`DatasetError` before anything runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bm.engine.request import RequestError


class DatasetError(ValueError):
    """The dataset cannot be used at all; the message names the file, the row and the field."""


# One row cannot run; the loader records the message on the row and goes on. It is the engine's own
# refusal type: a row's problem and a request's are one thing, raised by the one field table
# (bm.engine.fields) or the one validator (bm.engine.request.validate_request).
RowError = RequestError


@dataclass
class WorkloadRequest:
    """One request of a workload. ``source`` names its row for messages ("line 12", "entry 3")."""

    source: str
    user_id: Any = None
    input_ids: list[int] | None = None  # real token ids (bm / trtllm / hf datasets)
    prompt_text: str | None = None  # text to tokenize (sharegpt, hf, bm with "prompt")
    input_len: int = 0  # length of the prompt; trace and synthetic formats get ids generated to it
    output_len: int = 0
    output_text: str | None = None  # a completion whose token count is the output length (sharegpt)
    timestamp: float | None = None  # seconds since the dataset's first row (timed traces)
    hash_ids: list[int] | None = None  # blocks of a shared prefix: equal ids mean equal tokens
    fields: dict[str, Any] = field(default_factory=dict)  # extra request fields (temperature, ...)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Workload:
    """The requests of one dataset, in replay order, plus what a results file should say about it."""

    kind: str
    source: str
    requests: list[WorkloadRequest]
    hash_block_size: int = 0  # tokens per hash id (mooncake; synthetic prefixes)
    num_skipped: int = 0  # rows that are not requests (e.g. a ShareGPT conversation with one turn)
    skipped_reason: str = ""

    @property
    def has_timestamps(self) -> bool:
        return bool(self.requests) and all(r.timestamp is not None for r in self.requests)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": self.source,
            "num_requests": len(self.requests),
            "num_invalid": sum(1 for r in self.requests if not r.ok),
            "num_skipped": self.num_skipped,
            "skipped_reason": self.skipped_reason or None,
        }


def positive_int(value: Any, name: str) -> int:
    """A length field: an integer >= 1 (a float like 12.0 is accepted, 12.5 is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise RowError(f"{name}: expected a positive integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise RowError(f"{name}: expected a positive integer, got {value!r}")
        value = int(value)
    if value < 1:
        raise RowError(f"{name}: must be at least 1, got {value}")
    return value


def token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RowError(f"{name}: expected a list of integer token ids")
    if not value:
        raise RowError(f"{name}: the prompt is empty")
    return value


def timestamp(value: Any, where: str, name: str, unit: float = 1.0) -> float:
    """A finite, non-negative number, converted to seconds; bad ones stop the load (they break the clock)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DatasetError(f"{where}: {name}: expected a number, got {value!r}")
    if value < 0:
        raise DatasetError(f"{where}: {name}: must be >= 0, got {value}")
    return float(value) * unit


def check_order(requests: list[WorkloadRequest], field_name: str) -> None:
    """Trace timestamps must not go backwards: replaying a shuffled trace would silently change the load."""
    previous: WorkloadRequest | None = None
    for req in requests:
        if req.timestamp is None:
            continue
        if previous is not None and previous.timestamp is not None and req.timestamp < previous.timestamp:
            raise DatasetError(
                f"{req.source}: {field_name} goes backwards ({req.timestamp:g} s after the first row, "
                f"{previous.source} is at {previous.timestamp:g} s); sort the trace by {field_name}"
            )
        previous = req
