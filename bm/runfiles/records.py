"""``bm run``'s output records: one per input line, from its request's final response or the line's own
error, with what a record holds beyond one sequence's tokens (top log probs, every sample of an n-sample
request, logits files). Built in one place so the record's shape is documented in one place (docs/run.md,
"Output records")."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bm.engine.outputs.sequences import FinishedSequence, finished_sequences
from bm.engine.requests.fields import in_user_terms
from bm.engine.requests.request import Response
from bm.scheduling import FinishReason
from bm.workloads.request import Row
from bm.workloads.tool_parsers import parse_tool_calls
from bm.workloads.tools import tool_calls, tool_names

# The engine's (the seed's) name for a request's output length, which its errors use.
ENGINE_OUTPUT_LEN = "request_output_len"
ENGINE_PROMPT = "input_ids"  # and for a prompt

if TYPE_CHECKING:  # the records need no torch
    from bm.runtime import LoadedModel


def top_log_probs(values: list[list[tuple[int, float]]] | None) -> list[list[list[float]]] | None:
    """Per generated token, its most likely ``[token id, log prob]`` pairs, most likely first."""
    if values is None:
        return None
    return [[[token, lp] for token, lp in top] for top in values]


def _finished_fields(sequence: FinishedSequence) -> dict[str, Any]:
    """A sequence's tokens and why it ended, as a record and each of its ``samples`` hold them."""
    return {
        "output_ids": sequence.token_ids,
        "num_output_tokens": len(sequence.token_ids),
        "finish_reason": sequence.finish_reason,
        "stop_reason": sequence.stop_reason,
    }


def sample_record(sequence: FinishedSequence) -> dict[str, Any]:
    """One entry of a record's ``samples``: the sample's own tokens, text and finish reason."""
    entry: dict[str, Any] = {"index": sequence.index}
    if sequence.text is not None:
        entry["text"] = sequence.text
    entry.update(_finished_fields(sequence))
    if sequence.log_probs is not None:
        entry["output_log_probs"] = sequence.log_probs
    if sequence.top_log_probs is not None:
        entry["top_log_probs"] = top_log_probs(sequence.top_log_probs)
    return entry


def _error_fields(index: int, user_id: Any, num_prompt_tokens: int | None) -> dict[str, Any]:
    """Every key of a record, for a request that failed (``text`` is there too, empty, as in any record)."""
    return {
        "index": index,
        "id": user_id,
        "num_prompt_tokens": num_prompt_tokens,
        "text": "",
        "output_ids": [],
        "num_output_tokens": 0,
        "finish_reason": FinishReason.ERROR.label,
        "stop_reason": None,
        "error": None,
    }


def in_line_terms(message: str, row: Row) -> str:
    """An engine error in the names the line used: the engine calls the output length
    ``request_output_len`` (the seed's name), the line wrote ``max_tokens`` (or another spelling), and a
    line that gave none took ``--max-tokens``; it calls the prompt ``input_ids``, the line may have
    written ``prompt`` (text) or ``messages`` (a chat)."""
    key = row.max_tokens_key or ("max_tokens" if row.max_tokens_to_limit else "--max-tokens")
    message = in_user_terms(message, {ENGINE_OUTPUT_LEN: key})
    if message.startswith(f"{ENGINE_PROMPT}:") and row.prompt_key != ENGINE_PROMPT:
        message = row.prompt_key + message[len(ENGINE_PROMPT) :]
    return message


def output_record(row: Row, result: Response | None, loaded: LoadedModel) -> dict[str, Any]:
    """The record of one row: its request's final response, or the row's own error (``result`` None)."""
    if result is None or result.error:
        # the engine does not know lines: the CLI names the line its request came from
        record = _error_fields(row.index, row.user_id, row.num_prompt_tokens)
        record["error"] = row.error if result is None else f"{row.where}: {in_line_terms(result.error, row)}"
        if result is not None and result.output_ids:
            record.update(output_ids=result.output_ids, num_output_tokens=len(result.output_ids))
        return record
    record: dict[str, Any] = {
        "index": row.index,
        "id": row.user_id,
        "num_prompt_tokens": row.num_prompt_tokens,
    }
    tokenizer = loaded.tokenizer
    sequences = finished_sequences(result, row.stop, None if tokenizer is None else tokenizer.decode)
    first = sequences[0]  # the record's own fields are sample 0's
    if first.text is not None:
        record["text"] = first.text
        if row.tool_call:  # tool_choice forced a call: the record carries it parsed, as OpenAI's message does
            record["tool_calls"] = tool_calls(first.text, f"call_bm_{row.index}")
        elif row.tool_parser is not None:  # tool_choice auto: the calls the reply holds, None for text
            reply = parse_tool_calls(
                row.tool_parser, first.text, tool_names(row.tools), f"call_bm_{row.index}"
            )
            record["tool_calls"] = reply.tool_calls
    record.update(_finished_fields(first), error=None)
    log_probs = first.log_probs
    if result.beams is not None:
        record["beams"] = result.beams
        log_probs = result.beam_log_probs[0] if result.beam_log_probs else None  # the best beam's
    if log_probs is not None:
        record["output_log_probs"] = log_probs
    if result.beam_log_probs is not None:
        record["beam_log_probs"] = result.beam_log_probs
    if result.cum_log_probs is not None:
        record["cum_log_probs"] = (
            result.cum_log_probs if result.beams is not None else result.cum_log_probs[0]
        )
    if first.top_log_probs is not None:
        record["top_log_probs"] = top_log_probs(first.top_log_probs)
    if result.samples is not None:  # n > 1: every sample; num_output_tokens counts them all
        record["samples"] = [sample_record(s) for s in sequences]
        record["num_output_tokens"] = sum(len(s.token_ids) for s in sequences)
    return record


def write_logits(out_dir: Path, index: int, result: Response) -> str | None:
    """Logits go to ``logits/<index>.safetensors`` beside outputs.jsonl (never inline); returns the path
    relative to the output directory, or None when the request asked for none."""
    tensors = {
        name: value.contiguous()
        for name, value in (
            ("context_logits", result.context_logits),
            ("generation_logits", result.generation_logits),
        )
        if value is not None
    }
    if not tensors:
        return None
    from safetensors.torch import save_file

    relative = Path("logits") / f"{index}.safetensors"
    (out_dir / "logits").mkdir(exist_ok=True)
    save_file(tensors, str(out_dir / relative))
    return relative.as_posix()


def cancelled_record(row: Row) -> dict[str, Any]:
    """The record of a row an interrupt ended before its request started (an unreadable row keeps its
    error)."""
    if row.error is not None:
        return {**_error_fields(row.index, row.user_id, None), "error": row.error}
    return {
        "index": row.index,
        "id": row.user_id,
        "num_prompt_tokens": row.num_prompt_tokens,
        "output_ids": [],
        "num_output_tokens": 0,
        "finish_reason": FinishReason.CANCELLED.label,
        "stop_reason": None,
        "error": None,
        "text": "",
    }


# What one generated sequence of a record is (the keys a ``samples`` entry has, ``sample_record``)
SAMPLE_KEYS = (
    "text",
    "output_ids",
    "num_output_tokens",
    "finish_reason",
    "stop_reason",
    "output_log_probs",
    "top_log_probs",
)


class LineParts:
    """The records of lines that ran as several requests (an OpenAI completions prompt list), each held
    until every part's has come, then joined into the line's one record: a line still ends with exactly
    one record, however many requests answered it."""

    def __init__(self) -> None:
        self._held: dict[int, list[dict[str, Any] | None]] = {}

    def add(self, row: Row, record: dict[str, Any]) -> dict[str, Any] | None:
        """The line's record once ``record`` (the one of part ``row``) completes it, else None."""
        if row.num_parts == 1:
            return record
        held = self._held.setdefault(row.index, [None] * row.num_parts)
        held[row.part] = record
        if any(r is None for r in held):
            return None
        del self._held[row.index]
        return joined_record([r for r in held if r is not None])


def joined_record(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for a line whose prompts ran as requests of their own: ``samples`` are every prompt's in
    prompt order, each numbered as OpenAI numbers its choices (prompt x n + sample) with its
    ``prompt_index``; token counts are sums; the record's own fields are the first sample's. A line one of
    whose prompts failed or was cancelled ends so as a whole (a resume runs all of it again)."""
    for reason in (FinishReason.ERROR.label, FinishReason.CANCELLED.label):
        bad = next((r for r in parts if r["finish_reason"] == reason), None)
        if bad is not None:
            return bad
    samples = []
    for p, record in enumerate(parts):
        for sample in record.get("samples") or [record]:
            entry = {k: sample[k] for k in SAMPLE_KEYS if k in sample}
            samples.append({"index": len(samples), "prompt_index": p, **entry})
    return {
        **parts[0],
        "num_prompt_tokens": sum(r.get("num_prompt_tokens") or 0 for r in parts),
        "num_output_tokens": sum(r.get("num_output_tokens") or 0 for r in parts),
        "samples": samples,
    }
