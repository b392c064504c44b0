"""Why a request stops after a token: its end id, a stop word, or its length; and how a finished
sequence reads back, the same for ``bm run``'s records and ``bm.LLM``'s outputs. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from bm.scheduling import FinishReason, LlmRequest
from bm.scheduling.request import NOT_FINISHED

END_ID, STOP_WORDS, LENGTH = FinishReason.END_ID, FinishReason.STOP_WORDS, FinishReason.LENGTH


@dataclass(frozen=True)
class FinishedText:
    """A finished sequence as the user reads it: its text (None without a tokenizer), its finish reason
    in the one vocabulary both front doors write (:attr:`FinishReason.label`: ``stop``, ``length``,
    ``cancelled``, ``error``, ...), and vLLM's ``stop_reason``: the stop string that ended the text, the
    token that completed a stop word (``stop_token_ids``), or None (the end token, or a limit)."""

    text: str | None
    finish_reason: str
    stop_reason: int | str | None


def finished_text(
    text: str | None,
    output_ids: list[int],
    reason: FinishReason,
    stops: list[str],
    include_stop_str: bool = False,
) -> FinishedText:
    """``text`` (the decoded ``output_ids``) cut before the first stop string in it, as OpenAI's API and
    vLLM cut it (through it with ``include_stop_str``), and why the sequence ended. One rule for
    ``bm run``'s records and ``bm.LLM``'s outputs."""
    stop_reason: int | str | None = output_ids[-1] if reason is STOP_WORDS and output_ids else None
    word = reason.label
    if text is not None and (found := _first_stop(text, stops)) is not None:
        where, stop = found
        text, word, stop_reason = text[: where + (len(stop) if include_stop_str else 0)], "stop", stop
    return FinishedText(text, word, stop_reason)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(where, which) of the stop string that starts first in ``text``; of two starting at the same
    place the shorter, which was complete first."""
    hits = [(i, len(s), s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return None
    where, _, stop = min(hits)
    return where, stop


def ends_with(prompt: list[int], output: list[int], word: tuple[int, ...]) -> bool:
    """Whether prompt + output ends with ``word``, without building the concatenation."""
    n = len(word)
    if n > len(prompt) + len(output):
        return False
    if n <= len(output):
        return tuple(output[len(output) - n :]) == word
    head = n - len(output)
    return tuple(prompt[len(prompt) - head :]) + tuple(output) == word


def stop_reason(req: LlmRequest, token: int) -> FinishReason:
    """Asked after every token of every request: the common case (no stop words) makes no generator
    and reads no member off the enum class."""
    if token == req.sampling.end_id:
        return END_ID
    controls = req.controls
    if (
        controls is not None
        and controls.stop_words_list
        and any(ends_with(req.prompt_ids, req.output_ids, w) for w in controls.stop_words_list)
    ):
        return STOP_WORDS
    if len(req.output_ids) >= req.max_new_tokens:
        return LENGTH
    return NOT_FINISHED
