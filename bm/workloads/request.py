"""The shape every dataset loader produces, and the checks they share.

A loader turns rows into :class:`Row` values without tokenizing or generating token ids:
that happens once, after shuffling and ``num_requests`` have chosen the rows that run (so a 90k-entry
ShareGPT file costs nothing beyond the rows used). A row that cannot run keeps its place with an
``error``: it is reported as a failed request, never dropped. A problem with the file itself (a missing
column, timestamps out of order) raises :class:`DatasetError` before anything runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bm.engine.requests.request import RequestError


class DatasetError(ValueError):
    """The dataset cannot be used at all; the message names the file, the row and the field."""


# One row cannot run; the loader records the message on the row and goes on. It is the engine's own
# refusal type: a row's problem and a request's are one thing, raised by the one field table
# (bm.engine.requests.fields) or the one validator (bm.engine.requests.validate.validate_request).
RowError = RequestError


@dataclass
class Row:
    """One input row, whatever the format: a line of bm's JSONL or of an OpenAI batch file, a trtllm-bench
    line, a ShareGPT entry, a trace row, a Hugging Face dataset row or a synthetic request.

    It is the only row type: readers fill it with values already checked against the one field table
    (:mod:`bm.engine.requests.fields`), untokenized; ``bm run`` turns it into an engine request, ``bm bench``
    first chooses, tokenizes and scales the rows it replays. A row that cannot run keeps its place with its
    ``error`` and is reported, never dropped. Exactly one prompt form is set once it is ready to run
    (``prompt``, ``input_ids`` or ``messages``; a trace row has only ``input_len`` until bench generates ids).
    """

    where: str  # "line 12", "entry 3", "row 5": every message about this row names it
    index: int = 0  # 0-based position in the input: a record's ``index`` and bm run's engine request id
    user_id: Any = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    input_len: int = 0  # prompt length; traces and synthetic rows get ids generated to it
    max_tokens: int | None = None  # None: the command's default (its output length)
    max_tokens_key: str | None = None  # the field the line gave it under (max_tokens, ...), for errors
    # No max_tokens where the format's default is none (OpenAI lines): the end token or the model's
    # length ends it, not the command's default
    max_tokens_to_limit: bool = False
    output_text: str | None = None  # a completion whose token count is the output length (sharegpt, hf)
    arrival_time: float | None = None  # seconds from the first row (timed files and traces)
    hash_ids: list[int] | None = None  # blocks of a shared prefix: equal ids mean equal tokens (mooncake)
    stop: list[str] = field(default_factory=list)  # stop strings (OpenAI's ``stop``)
    lora_dir: str | None = None  # a PEFT adapter directory, resolved against the file's directory
    # Request fields by spec name, plain values: word lists as [str | list[int], ...] or the [2, n] form.
    fields: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # OpenAI tools, rendered by the chat template
    tool_call: bool = False  # tool_choice made the reply a call (its output carries tool_calls)
    tool_auto: bool = False  # tools given, tool_choice absent or "auto": a parser reads the free reply
    tool_parser: str | None = None  # that parser, chosen with the chat template (bm.workloads.tool_parsers)
    # An OpenAI completions prompt list: the prompts after the first (text, or token-id lists), each run as
    # its own request and answered in the line's one record (bm.runfiles.prompts.to_requests)
    more_prompts: list[Any] | None = None
    part: int = 0  # which of its line's prompts this row runs (0: the first, or the only one)
    num_parts: int = 1  # how many requests its line runs as
    error: str | None = None  # "line N: field: problem; fix", when the row cannot run
    num_prompt_tokens: int | None = None  # set once the prompt is tokenized

    @classmethod
    def at_line(cls, number: int, **values: Any) -> Row:
        """The row of a file's 1-based line ``number``; its ``id`` defaults to its 0-based index."""
        values.setdefault("user_id", number - 1)
        return cls(where=f"line {number}", index=number - 1, **values)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def prompt_key(self) -> str:
        """The field the row gave its prompt in: ``prompt`` (text), ``messages`` (a chat) or ``input_ids``."""
        if self.prompt is not None:
            return "prompt"
        return "messages" if self.messages is not None else "input_ids"


@dataclass
class Workload:
    """The requests of one dataset, in replay order, plus what a results file should say about it."""

    kind: str
    source: str
    requests: list[Row]
    hash_block_size: int = 0  # tokens per hash id (mooncake; synthetic prefixes)
    num_skipped: int = 0  # rows that are not requests (e.g. a ShareGPT conversation with one turn)
    skipped_reason: str = ""

    @property
    def has_timestamps(self) -> bool:
        return bool(self.requests) and all(r.arrival_time is not None for r in self.requests)

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


def timestamp(value: Any, where: str, name: str, unit: float = 1.0) -> float:
    """A finite, non-negative number, converted to seconds; bad ones stop the load (they break the clock)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DatasetError(f"{where}: {name}: expected a number, got {value!r}")
    if value < 0:
        raise DatasetError(f"{where}: {name}: must be >= 0, got {value}")
    return float(value) * unit


def check_order(requests: list[Row], field_name: str) -> None:
    """Trace timestamps must not go backwards: replaying a shuffled trace would silently change the load."""
    previous: Row | None = None
    for req in requests:
        if req.arrival_time is None:
            continue
        if (
            previous is not None
            and previous.arrival_time is not None
            and req.arrival_time < previous.arrival_time
        ):
            raise DatasetError(
                f"{req.where}: {field_name} goes backwards ({req.arrival_time:g} s after the first row, "
                f"{previous.where} is at {previous.arrival_time:g} s); sort the trace by {field_name}"
            )
        previous = req
