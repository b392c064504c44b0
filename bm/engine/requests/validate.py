"""The one place a core :class:`~bm.engine.requests.request.Request`'s every value is checked, into the
scheduler's :class:`~bm.scheduling.LlmRequest` (or a :class:`~bm.engine.requests.fields.RequestError`
naming the field and the fix). Both doors (the typed core and the seed's tensor maps) refuse the same things
with the same messages, and a value of the wrong type is refused, never coerced (``beam_width: 1.9`` is an
error, not 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bm.engine.requests.fields import RequestError, check_bool, check_float, check_int, is_number, logit_bias
from bm.engine.requests.model_inputs import ModelInputs, check_prompt_table_request, lora_spec, prompt_table
from bm.engine.requests.request import Request, RequestLimits
from bm.scheduling.controls import Controls
from bm.scheduling.request import LlmRequest, Sampling

UINT64_MAX = 2**64 - 1

# Fields of the spec table bm refuses by name until they are implemented.
UNSUPPORTED_FIELDS: tuple[str, ...] = ()


def _int(name: str, value: Any, default: int, *, high: int | None = None) -> int:
    """A given integer field, checked against the one field table (bm.engine.requests.fields), narrowed by
    ``high``."""
    return default if value is None else check_int(name, value, high=high)


def _float(name: str, value: Any, default: float) -> float:
    return default if value is None else check_float(name, value)


def _bool(name: str, value: Any) -> bool:
    return False if value is None else check_bool(value, name)


def _token_ids(name: str, ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise RequestError(f"{name}: expected a list of token ids, got {type(ids).__name__}")
    if not set(map(type, ids)) <= {int}:  # the common case checked in C; a long prompt has 10^4 ids
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise RequestError(f"{name}: expected integer token ids, got {t!r}")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise RequestError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def _words(name: str, words: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    if words is None:
        return ()
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, (list, tuple)) for w in words):
        raise RequestError(f"{name}: expected a list of token-id lists")
    out = []
    for word in words:
        if not word:
            raise RequestError(f"{name}: a word is empty; give at least one token id per word")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in word):
            raise RequestError(f"{name}: expected integer token ids, got the word {list(word)}")
        if min(word) < 0 or max(word) >= vocab_size:
            raise RequestError(
                f"{name}: token id outside the vocabulary [0, {vocab_size}) in word {list(word)}"
            )
        out.append(tuple(word))
    return tuple(out)


def _embedding_bias(value: Any, vocab_size: int) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != vocab_size:
        got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise RequestError(
            f"embedding_bias: expected {vocab_size} numbers (one per vocabulary token; shape [1, {vocab_size}] "
            f"as a tensor), got {got}"
        )
    for v in value:
        if not is_number(v):
            raise RequestError("embedding_bias: values must be finite numbers")
    return tuple(float(v) for v in value)


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """OpenAI's sparse bias: read and bounded by the field table, then its ids against the vocabulary."""
    if value is None:
        return {}
    out = logit_bias(value, "logit_bias")
    outside = next((token for token in out if token >= vocab_size), None)
    if outside is not None:
        raise RequestError(f"logit_bias: token id {outside} is outside the vocabulary [0, {vocab_size})")
    return out


def _bias(request: Request, vocab_size: int) -> tuple[float, ...] | None:
    """embedding_bias and logit_bias as one dense row: both are added to the logits before sampling, in
    the same pass (a token named by both gets both)."""
    dense = _embedding_bias(request.embedding_bias, vocab_size)
    sparse = _logit_bias(request.logit_bias, vocab_size)
    if not sparse:
        return dense
    row = list(dense) if dense is not None else [0.0] * vocab_size
    for token, bias in sparse.items():
        row[token] += bias
    return tuple(row)


def validate_request(request: Request, limits: RequestLimits) -> LlmRequest:
    """Check every field of ``request``; return the engine's record or raise :class:`RequestError`."""
    rid = request.request_id
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid <= UINT64_MAX:
        raise RequestError(f"request id {rid!r} is not a uint64")
    table = prompt_table(request, limits)
    num_virtual = len(table.rows) if table is not None else 0
    prompt = _token_ids("input_ids", request.input_ids, limits.vocab_size + num_virtual)
    if not prompt:
        raise RequestError("input_ids: the prompt is empty; give at least one token")
    if request.request_output_len is None:
        raise RequestError("missing mandatory input tensor 'request_output_len'")
    max_new = check_int("request_output_len", request.request_output_len, low=1)
    beam_width = _int("beam_width", request.beam_width, 1)
    if beam_width > limits.max_beam_width:  # an engine bound, not the field's: name the knob that sets it
        raise RequestError(
            f"beam_width: must be at most {limits.max_beam_width}, got {beam_width}; the engine takes beams up "
            f"to engine.max_beam_width (--set engine.max_beam_width={beam_width}; bm.LLM.beam_search raises it "
            "itself)"
        )
    _check_lengths(prompt, max_new, limits)

    temperature = _float("temperature", request.temperature, 0.0)
    top_k = _int("runtime_top_k", request.runtime_top_k, 0)
    top_p = _float("runtime_top_p", request.runtime_top_p, 1.0)
    min_p = _float("min_p", request.min_p, 0.0)
    if request.temperature is None and (top_k > 1 or top_p < 1 or min_p > 0):
        temperature = 1.0  # asking for a filter means asking to sample
    sampling = Sampling(
        temperature=temperature,
        runtime_top_k=top_k,
        runtime_top_p=top_p,
        min_p=min_p,
        random_seed=_int("random_seed", request.random_seed, 0),
        end_id=_int("end_id", request.end_id, -1, high=limits.vocab_size - 1),
        pad_id=_int("pad_id", request.pad_id, 0, high=limits.vocab_size - 1),
    )
    streaming = _bool("streaming", request.streaming)
    controls = _controls(request, limits, max_new)
    num_samples = _int("num_return_sequences", request.num_return_sequences, 1)
    if num_samples > 1:
        _check_samples_request(request, beam_width, streaming, controls)
    if beam_width > 1:
        _check_beam_request(sampling, streaming, controls)
    if table is not None:
        check_prompt_table_request(controls)
    lora = lora_spec(request)
    speculation = _drafts(request, limits, beam_width, controls)
    return LlmRequest(
        request_id=rid,
        prompt_ids=prompt,
        max_new_tokens=max_new,
        sampling=sampling,
        streaming=streaming,
        beam_width=beam_width,
        controls=controls if controls.needs_runtime_state or beam_width > 1 else None,
        output_log_probs=[] if controls.return_log_probs and beam_width == 1 else None,
        model_inputs=ModelInputs(prompt_table=table, lora=lora) if table or lora else None,
        speculation=speculation,
        output_top_log_probs=[] if controls.top_log_probs and beam_width == 1 else None,
        num_return_sequences=num_samples,
        num_pending_samples=num_samples - 1,
    )


def check_prompt_length(
    num_tokens: int, max_seq_len: int, setting: str = "engine.max_seq_len", *, at_least: bool = False
) -> None:
    """The one verdict on a prompt's length: more tokens than ``max_seq_len`` (which ``setting`` names)
    is refused. ``at_least``: ``num_tokens`` is a lower bound, counted on a prefix of a text too long to
    tokenize whole (:mod:`bm.runfiles.prompts`)."""
    if num_tokens > max_seq_len:
        count = f"at least {num_tokens}" if at_least else str(num_tokens)
        raise RequestError(
            f"input_ids: the prompt has {count} tokens, longer than the model's maximum of {max_seq_len} "
            f"({setting})"
        )


def _check_lengths(prompt: Sequence[int], max_new: int, limits: RequestLimits) -> None:
    check_prompt_length(len(prompt), limits.max_seq_len)
    if len(prompt) + max_new > limits.max_seq_len:
        raise RequestError(
            f"request_output_len: prompt ({len(prompt)}) + output ({max_new}) tokens exceed the maximum "
            f"sequence length {limits.max_seq_len}; lower request_output_len to at most "
            f"{limits.max_seq_len - len(prompt)}"
        )
    if limits.max_num_tokens is not None and len(prompt) > limits.max_num_tokens:
        raise RequestError(
            f"input_ids: the prompt has {len(prompt)} tokens but an iteration computes at most "
            f"{limits.max_num_tokens} (engine.max_num_tokens); raise it or set engine.enable_chunked_context"
        )


def _controls(request: Request, limits: RequestLimits, max_new: int) -> Controls:
    repetition = _float("repetition_penalty", request.repetition_penalty, 1.0)
    processor = request.logits_post_processor
    if processor is not None and not callable(processor):
        raise RequestError(
            "logits_post_processor: expected a callable (request_id, logits, tokens) -> logits"
        )
    top = _int("top_logprobs", request.top_logprobs, 0)
    if top and request.beam_width not in (None, 1):
        raise RequestError("top_logprobs: not supported with beam_width > 1; set it to 0")
    return Controls(
        repetition_penalty=repetition,
        presence_penalty=_float("presence_penalty", request.presence_penalty, 0.0),
        frequency_penalty=_float("frequency_penalty", request.frequency_penalty, 0.0),
        min_length=_int("min_length", request.min_length, 0, high=max_new),
        no_repeat_ngram_size=_int("no_repeat_ngram_size", request.no_repeat_ngram_size, 0),
        embedding_bias=_bias(request, limits.vocab_size),
        bad_words_list=_words("bad_words_list", request.bad_words_list, limits.vocab_size),
        stop_words_list=_words("stop_words_list", request.stop_words_list, limits.vocab_size),
        return_log_probs=_bool("return_log_probs", request.return_log_probs) or top > 0,
        top_log_probs=top,
        return_context_logits=_bool("return_context_logits", request.return_context_logits),
        return_generation_logits=_bool("return_generation_logits", request.return_generation_logits),
        logits_post_processor=processor,
        # Validated whatever the width; they only act on beams (as in TensorRT-LLM and HF).
        len_penalty=_float("len_penalty", request.len_penalty, 1.0),
        early_stopping=_int("early_stopping", request.early_stopping, 1),
        guided=_guided(request.guided_decoding),
    )


def _guided(value: Any) -> Any:
    """The request's structured-output spec, checked by the one reader of its forms."""
    if value is None:
        return None
    from bm.engine.requests.structured import SpecError, guided_spec

    try:
        return guided_spec("guided_decoding", value)
    except SpecError as exc:
        raise RequestError(str(exc)) from None


def _check_samples_request(request: Request, beam_width: int, streaming: bool, controls: Controls) -> None:
    """What n samples are not built for is refused by name, never silently ignored."""
    n = request.num_return_sequences
    if beam_width > 1:
        raise RequestError(
            f"num_return_sequences: {n} samples with beam_width > 1 is not supported; beam search already "
            "returns beam_width sequences (use one or the other)"
        )
    if streaming:
        raise RequestError("num_return_sequences: not supported with streaming; set streaming to false")
    if controls.return_generation_logits:
        raise RequestError("num_return_sequences: not supported with return_generation_logits")
    if request.draft_input_ids is not None:
        raise RequestError("num_return_sequences: not supported with draft_input_ids")
    if request.lora_task_id is not None:
        raise RequestError("num_return_sequences: not supported with a LoRA adapter yet; send n lines")


def _check_beam_request(sampling: Sampling, streaming: bool, controls: Controls) -> None:
    """Combinations bm does not implement with beam search are refused, never silently ignored."""
    if not sampling.is_greedy:
        raise RequestError(
            "beam_width: beam search is deterministic in bm; drop temperature / runtime_top_k / runtime_top_p "
            "or use beam_width 1"
        )
    if streaming:
        raise RequestError("streaming: not supported with beam_width > 1; set streaming to false")
    if controls.stop_words_list:
        raise RequestError("stop_words_list: not supported with beam_width > 1")
    if controls.return_generation_logits:
        raise RequestError("return_generation_logits: not supported with beam_width > 1")
    if controls.guided is not None:
        raise RequestError("guided_decoding: structured output is not supported with beam_width > 1")


def _drafts(request: Request, limits: RequestLimits, beam_width: int, controls: Controls) -> Any:
    from bm.engine.requests.speculative import SpecState

    drafts, logits = request.draft_input_ids, request.draft_logits
    if drafts is None:
        if logits is not None:
            raise RequestError("draft_logits: given without draft_input_ids; give the drafts too or drop it")
        return None
    drafts = _token_ids("draft_input_ids", drafts, limits.vocab_size)
    if beam_width > 1:
        raise RequestError("draft_input_ids: not supported with beam_width > 1")
    if controls.guided is not None:
        raise RequestError(
            "draft_input_ids: not supported with structured output (drafts are not checked against the "
            "grammar's mask); drop the drafts or the response_format / guided_* field"
        )
    if controls.needs_runtime_state:
        raise RequestError(
            "draft_input_ids: not supported beside logits controls, stop words, log probs or returned logits "
            "(each draft position would need them); drop the drafts or those fields"
        )
    if logits is not None:
        try:
            rows = len(logits)
            widths = {len(logits[i]) for i in range(rows)}
        except TypeError:
            raise RequestError("draft_logits: expected rows [num_draft_tokens, vocab_size]") from None
        if rows != len(drafts) or widths - {limits.vocab_size}:
            raise RequestError(
                f"draft_logits: expected shape [{len(drafts)}, {limits.vocab_size}] (one row per draft token)"
            )
    return SpecState(tuple(drafts), logits)
