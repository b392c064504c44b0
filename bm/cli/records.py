"""What an output record holds beyond one sequence's tokens: top log probs, and every sample of an
n-sample request. Kept beside ``bm run``'s record builder so the record's shape is documented in one
place (docs/run.md, "Output records")."""

from __future__ import annotations

from typing import Any

from bm.engine.request import Response, SampleOutput
from bm.engine.stopping import text_before_stop
from bm.scheduling import FinishReason
from bm.workloads.request import Row


def cut_at_stop(row: Row, text: str, reason: str) -> tuple[str, str]:
    """Stop strings end the text before them, as in OpenAI's API (the finish reason becomes ``stop``)."""
    cut = text_before_stop(text, row.stop)
    return (text, reason) if cut is None else (cut, FinishReason.STOP_WORDS.label)


def top_log_probs(values: list[list[tuple[int, float]]] | None) -> list[list[list[float]]] | None:
    """Per generated token, its most likely ``[token id, log prob]`` pairs, most likely first."""
    if values is None:
        return None
    return [[[token, lp] for token, lp in top] for top in values]


def sample_record(row: Row, sample: SampleOutput, tokenizer: Any) -> dict[str, Any]:
    """One entry of a record's ``samples``: the sample's own tokens, text and finish reason."""
    entry: dict[str, Any] = {"index": sample.index}
    reason = sample.finish_reason.label
    if tokenizer is not None:
        entry["text"], reason = cut_at_stop(row, tokenizer.decode(sample.output_ids), reason)
    entry.update(output_ids=sample.output_ids, num_output_tokens=len(sample.output_ids), finish_reason=reason)
    if sample.output_log_probs is not None:
        entry["output_log_probs"] = sample.output_log_probs
    if sample.output_top_log_probs is not None:
        entry["top_log_probs"] = top_log_probs(sample.output_top_log_probs)
    return entry


def extra_fields(row: Row, result: Response, tokenizer: Any) -> dict[str, Any]:
    """``top_log_probs`` when asked for, and for n > 1 ``samples`` (every sample, index 0 first; the
    record's own fields are sample 0's, and ``num_output_tokens`` counts the tokens of all samples)."""
    extra: dict[str, Any] = {}
    if result.output_top_log_probs is not None:
        extra["top_log_probs"] = top_log_probs(result.output_top_log_probs)
    if result.samples is not None:
        extra["samples"] = [sample_record(row, s, tokenizer) for s in result.samples]
        extra["num_output_tokens"] = sum(len(s.output_ids) for s in result.samples)
    return extra
