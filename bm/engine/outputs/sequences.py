"""A final response's generated sequences as a user reads them back, built once for both front doors.

``bm run`` writes each sequence into a JSON record (:mod:`bm.runfiles.records`) and ``bm.LLM`` into
vLLM's ``CompletionOutput`` (:mod:`bm.llm_outputs`); what a sequence *is* (its tokens, its text cut at a
stop string, why it ended, its log probs, which of the n samples it is) is decided here, so the two can
differ only in shape. Pure Python: the text comes from a ``decode`` callable the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bm.engine.requests.request import Response
from bm.engine.requests.stopping import finished_text


@dataclass(frozen=True)
class FinishedSequence:
    """One generated sequence of a final response: sample ``index`` of an n-sample request (0 for a
    plain one), its tokens, its text (None without a decoder) and finish words from the one rule
    (:func:`bm.engine.requests.stopping.finished_text`), and its log probs when they were asked for
    (``top_log_probs``: per token, ``(token, log prob)`` most likely first, each list carrying the
    chosen token's ``rank`` where the runtime counted it)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stop_reason: int | str | None
    log_probs: list[float] | None
    top_log_probs: list[Any] | None


def finished_sequences(
    result: Response,
    stops: list[str],
    decode: Callable[[list[int]], str] | None,
    include_stop_str: bool = False,
) -> list[FinishedSequence]:
    """Every sequence of ``result``, sample 0 first: its n samples, or the response itself. ``stops``:
    the request's stop strings; ``decode``: tokens -> text (None: no text)."""
    samples: list[Any] = list(result.samples) if result.samples is not None else [result]
    sequences = []
    for i, sample in enumerate(samples):
        tokens = list(sample.output_ids)
        text = decode(tokens) if decode is not None else None
        finished = finished_text(text, tokens, sample.finish_reason, stops, include_stop_str)
        sequences.append(
            FinishedSequence(
                getattr(sample, "index", i), tokens, finished.text, finished.finish_reason,
                finished.stop_reason, sample.output_log_probs, sample.output_top_log_probs,
            )
        )  # fmt: skip
    return sequences
