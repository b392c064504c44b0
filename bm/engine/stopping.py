"""Why a request stops after a token: its end id, a stop word, or its length. Pure Python."""

from __future__ import annotations

from bm.scheduling import FinishReason, LlmRequest
from bm.scheduling.request import NOT_FINISHED

END_ID, STOP_WORDS, LENGTH = FinishReason.END_ID, FinishReason.STOP_WORDS, FinishReason.LENGTH


def text_before_stop(text: str, stops: list[str]) -> str | None:
    """The text before the first stop string in it, or None when none occurs: stop strings end the text
    before them, as in OpenAI's API. One rule for ``bm run``'s records and ``bm.LLM``'s outputs."""
    found = _first_stop(text, stops)
    return text[: found[0]] if found is not None else None


def text_through_stop(text: str, stops: list[str]) -> str | None:
    """The text up to and including the first stop string in it (vLLM's ``include_stop_str_in_output``),
    or None when none occurs; the same stop as :func:`text_before_stop` finds."""
    found = _first_stop(text, stops)
    return text[: found[0] + len(found[1])] if found is not None else None


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
        and controls.stop_words
        and any(ends_with(req.prompt_ids, req.output_ids, w) for w in controls.stop_words)
    ):
        return STOP_WORDS
    if len(req.output_ids) >= req.max_new_tokens:
        return LENGTH
    return NOT_FINISHED
