"""The typed core request and response: plain Python values, no tensors, no torch.

:class:`Request` holds the InferenceRequest table's fields under their spec names, as plain values (lists
of ints, floats, bools); a field left ``None`` was not given and takes the spec's default. The seed's
tensor-map API (:mod:`bm.engine.inference_request`) is an adapter that builds one of these; ``bm run``,
``bm bench`` and ``bm compare`` build them directly. :func:`validate_request` is the one place every
value is checked, so both doors refuse the same things with the same messages, and a value of the wrong
type is refused, never coerced (``beam_width: 1.9`` is an error, not 1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bm.engine.fields import (
    RequestError,
    check_bool,
    check_float,
    check_int,
    is_number,
    logit_bias,
)
from bm.scheduling.request import FinishReason, LlmRequest, SamplingParams

UINT64_MAX = 2**64 - 1

# Fields of the spec table bm refuses by name until they are implemented.
UNSUPPORTED_FIELDS: tuple[str, ...] = ()


__all__ = ["RequestError"]  # defined with the field table, raised here too


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_seq_len: int
    max_num_tokens: int | None  # None: chunked context, any prompt fits piece by piece
    max_beam_width: int
    hidden_size: int | None = None  # the model's embedding width (checks a prompt table's rows)


@dataclass
class Request:
    """One generation request with the InferenceRequest table's fields (None: not given)."""

    request_id: int
    input_ids: list[int]
    request_output_len: int
    streaming: bool | None = None
    beam_width: int | None = None
    temperature: float | None = None
    runtime_top_k: int | None = None
    runtime_top_p: float | None = None
    len_penalty: float | None = None
    early_stopping: int | None = None
    repetition_penalty: float | None = None
    min_length: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    random_seed: int | None = None
    end_id: int | None = None
    pad_id: int | None = None
    embedding_bias: list[float] | None = None
    bad_words_list: list[list[int]] | None = None
    stop_words_list: list[list[int]] | None = None
    return_log_probs: bool | None = None
    return_context_logits: bool | None = None
    return_generation_logits: bool | None = None
    # Prompt tuning: [num_virtual_tokens, hidden] rows; prompt id vocab_size + i embeds as row i.
    prompt_embedding_table: list[list[float]] | None = None
    prompt_vocab_size: int | None = None
    # LoRA: the adapter's task id; its first request also carries the weights
    # [num_lora_modules_layers, D x Hi + Ho x D] (rows of A [D, Hi] then B [Ho, D], row-major; a list of
    # lists or any array the runtime reads) and config rows [module_id, layer_idx, adapter_size D].
    lora_task_id: int | None = None
    lora_weights: Any = None
    lora_config: list[list[int]] | None = None
    # Draft tokens: a guess of the continuation, verified in one forward; draft_logits [num_draft, vocab]
    # (rows as lists or an array) make sampled requests accept them by rejection sampling.
    draft_input_ids: list[int] | None = None
    draft_logits: Any = None
    # n samples of the prompt (OpenAI's n, TensorRT-LLM's num_return_sequences): one prefill, then a
    # forked block table and a generator (seed derived from random_seed and the index) per sample.
    num_return_sequences: int | None = None
    # The most likely tokens and their log probs at each generated position (0-20; implies log probs).
    top_logprobs: int | None = None
    # OpenAI's sparse logit bias: token id -> bias in [-100, 100], added with embedding_bias.
    logit_bias: dict[int, float] | None = None
    # Called as fn(request_id, logits [rows, vocab], tokens so far per row) -> logits, before bm's own
    # controls, each step this request samples (rows: 1, or one per beam). Runs inside the runtime.
    logits_post_processor: Callable[..., Any] | None = None
    # Structured output: the output follows this constraint (a bm.engine.structured.GuidedSpec, or any
    # form bm.engine.structured.guided_spec reads, e.g. {"json": schema}).
    guided_decoding: Any = None


@dataclass
class SampleOutput:
    """One of a request's n samples (final response only), in the order of its index."""

    index: int
    output_ids: list[int]
    finish_reason: FinishReason
    output_log_probs: list[float] | None = None
    output_top_log_probs: list[list[tuple[int, float]]] | None = None


@dataclass
class Response:
    """What the engine reports for one request: new tokens (streaming) or everything (final).

    ``output_ids`` are the tokens this response carries: the new ones when streaming, all of them in a
    final non-streamed response. ``beams`` (beam search, final only) holds every beam best first, and
    ``output_ids`` is then the best. Logits are runtime objects (tensors), passed through untouched.
    """

    request_id: int
    output_ids: list[int] = field(default_factory=list)
    final: bool = False
    error: str = ""
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    output_log_probs: list[float] | None = None  # for the tokens this response carries
    cum_log_probs: list[float] | None = None  # one per beam (one for a plain request)
    beams: list[list[int]] | None = None
    beam_log_probs: list[list[float]] | None = None
    pad_fill: int = 0  # what pads shorter beams in a [beam_width, n] tensor (the end id, else pad id)
    context_logits: Any = None  # [prompt, vocab]
    generation_logits: Any = None  # [output, vocab]
    num_pauses: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    # Draft tokens verified and accepted over the request, and the steps that verified some.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_draft_steps: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Per token of ``output_ids`` when top log probs were asked for: (token, log prob), most likely first.
    output_top_log_probs: list[list[tuple[int, float]]] | None = None
    # n > 1 (final only): every sample, index 0 first; ``output_ids`` and the rest describe sample 0.
    samples: list[SampleOutput] | None = None


def error_response(request_id: int, message: str) -> Response:
    return Response(request_id, final=True, error=message, finish_reason=FinishReason.ERROR)


# -- validation --------------------------------------------------------------------------------------


def _int(name: str, value: Any, default: int, *, high: int | None = None) -> int:
    """A given integer field, checked against the one field table (bm.engine.fields), narrowed by ``high``."""
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


def processes_logits(controls: Any) -> bool:
    """Whether any control rewrites logits; one definition for the engine's plain ``Controls`` and the
    runtime's ``DecodingOptions``, which carry the same fields."""
    return (
        controls.logits_post_processor is not None
        or controls.embedding_bias is not None
        or controls.repetition_penalty != 1.0
        or controls.presence_penalty != 0.0
        or controls.frequency_penalty != 0.0
        or controls.min_length > 0
        or controls.no_repeat_ngram_size > 0
        or bool(controls.bad_words)
    )


@dataclass(frozen=True)
class Controls:
    """The validated controls beyond temperature / top-k / top-p, as plain values (the runtime turns them
    into its own decoding state)."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_length: int = 0
    no_repeat_ngram_size: int = 0
    embedding_bias: tuple[float, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    stop_words: tuple[tuple[int, ...], ...] = ()
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    logits_post_processor: Callable[..., Any] | None = None
    len_penalty: float = 1.0
    early_stopping: int = 1
    guided: Any = None  # a bm.engine.structured.GuidedSpec: the runtime masks tokens to follow it
    top_log_probs: int = 0  # most likely tokens returned per position (with return_log_probs)

    @property
    def processes_logits(self) -> bool:
        return processes_logits(self)

    @property
    def needs_runtime_state(self) -> bool:
        return bool(
            self.guided is not None
            or self.processes_logits
            or self.stop_words
            or self.return_log_probs
            or self.return_context_logits
            or self.return_generation_logits
        )


def validate_request(request: Request, limits: RequestLimits) -> LlmRequest:
    """Check every field of ``request``; return the engine's record or raise :class:`RequestError`."""
    rid = request.request_id
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid <= UINT64_MAX:
        raise RequestError(f"request id {rid!r} is not a uint64")
    table = _prompt_table(request, limits)
    num_virtual = len(table.rows) if table is not None else 0
    prompt = _token_ids("input_ids", request.input_ids, limits.vocab_size + num_virtual)
    if not prompt:
        raise RequestError("input_ids: the prompt is empty; give at least one token")
    if request.request_output_len is None:
        raise RequestError("missing mandatory input tensor 'request_output_len'")
    max_new = check_int("request_output_len", request.request_output_len, low=1)
    beam_width = _int("beam_width", request.beam_width, 1, high=limits.max_beam_width)
    _check_lengths(prompt, max_new, limits)

    temperature = _float("temperature", request.temperature, 0.0)
    top_k = _int("runtime_top_k", request.runtime_top_k, 0)
    top_p = _float("runtime_top_p", request.runtime_top_p, 1.0)
    if request.temperature is None and (top_k > 1 or top_p < 1):
        temperature = 1.0  # asking for a filter means asking to sample
    sampling = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
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
        _check_prompt_table_request(controls)
    lora = _lora(request)
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


def _check_lengths(prompt: Sequence[int], max_new: int, limits: RequestLimits) -> None:
    if len(prompt) > limits.max_seq_len:
        raise RequestError(
            f"input_ids: the prompt has {len(prompt)} tokens, longer than the model's maximum of "
            f"{limits.max_seq_len} (engine.max_seq_len)"
        )
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
        bad_words=_words("bad_words_list", request.bad_words_list, limits.vocab_size),
        stop_words=_words("stop_words_list", request.stop_words_list, limits.vocab_size),
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
    from bm.engine.structured import SpecError, guided_spec

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


def _check_beam_request(sampling: SamplingParams, streaming: bool, controls: Controls) -> None:
    """Combinations bm does not implement with beam search are refused, never silently ignored."""
    if not sampling.is_greedy:
        raise RequestError(
            "beam_width: beam search is deterministic in bm; drop temperature / runtime_top_k / runtime_top_p "
            "or use beam_width 1"
        )
    if streaming:
        raise RequestError("streaming: not supported with beam_width > 1; set streaming to false")
    if controls.stop_words:
        raise RequestError("stop_words_list: not supported with beam_width > 1")
    if controls.return_generation_logits:
        raise RequestError("return_generation_logits: not supported with beam_width > 1")
    if controls.guided is not None:
        raise RequestError("guided_decoding: structured output is not supported with beam_width > 1")


# -- inputs beyond token ids ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptTable:
    """A validated prompt-tuning table: ``rows[i]`` is the embedding of prompt id ``vocab_size + i``."""

    rows: tuple[tuple[float, ...], ...]
    key: str  # digest of the values: block reuse only between requests with an identical table


# TensorRT-LLM's LoRA module ids (its LoraModule types), by name; bm maps each to the model's layers.
LORA_MODULES = {
    "attn_qkv": 0,
    "attn_q": 1,
    "attn_k": 2,
    "attn_v": 3,
    "attn_dense": 4,
    "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6,
    "mlp_gate": 7,
}
LORA_MODULE_NAMES = {v: k for k, v in LORA_MODULES.items()}


@dataclass(frozen=True, eq=False)
class LoraSpec:
    """A request's adapter: its task id, and on the first request of a task its weights and config
    (``weights`` stays as given, a list of rows or an array; the runtime checks its widths)."""

    task_id: int
    config: tuple[tuple[int, int, int], ...] | None = None
    weights: Any = None

    @property
    def num_values(self) -> int:
        return sum(len(row) for row in self.weights) if self.weights is not None else 0


@dataclass(frozen=True)
class ModelInputs:
    """What changes a request's activations beside its token ids, as plain values the runtime turns into
    tensors. Blocks computed under different inputs never share a cache entry (:attr:`block_extra_keys`)."""

    prompt_table: PromptTable | None = None
    lora: LoraSpec | None = None

    @property
    def block_extra_keys(self) -> tuple:
        keys: tuple = ()
        if self.prompt_table is not None:
            keys += ("ptable", self.prompt_table.key)
        if self.lora is not None:
            keys += ("lora", self.lora.task_id)
        return keys


def _prompt_table(request: Request, limits: RequestLimits) -> PromptTable | None:
    table, size = request.prompt_embedding_table, request.prompt_vocab_size
    if table is None:
        if size is not None:
            raise RequestError(
                "prompt_vocab_size: given without prompt_embedding_table; give the table too or drop it"
            )
        return None
    if not isinstance(table, (list, tuple)) or not table:
        raise RequestError(
            "prompt_embedding_table: expected a non-empty list of rows [num_virtual_tokens, hidden_size]"
        )
    width = limits.hidden_size
    rows = []
    for i, row in enumerate(table):
        if not isinstance(row, (list, tuple)):
            raise RequestError(f"prompt_embedding_table: row {i} is not a list of numbers")
        if width is None:
            width = len(row)
        if len(row) != width:
            raise RequestError(
                f"prompt_embedding_table: row {i} has {len(row)} values; every row needs the model's "
                f"hidden size {width}"
            )
        for v in row:
            if not is_number(v):
                raise RequestError(
                    f"prompt_embedding_table: row {i} holds {v!r}; values must be finite numbers"
                )
        rows.append(tuple(float(v) for v in row))
    if size is not None:
        _int("prompt_vocab_size", size, len(rows))
        if size != len(rows):
            raise RequestError(
                f"prompt_vocab_size: {size} does not match prompt_embedding_table's {len(rows)} rows; "
                "give the number of rows (or leave it out)"
            )
    frozen = tuple(rows)
    digest = hashlib.sha256(repr(frozen).encode()).hexdigest()
    return PromptTable(frozen, digest)


def _check_prompt_table_request(controls: Controls) -> None:
    """Controls that read the prompt's ids as vocabulary entries have no meaning for virtual tokens."""
    if controls.repetition_penalty != 1.0:
        raise RequestError(
            "repetition_penalty: not supported with prompt_embedding_table (the prompt holds virtual tokens)"
        )
    if controls.no_repeat_ngram_size > 0:
        raise RequestError(
            "no_repeat_ngram_size: not supported with prompt_embedding_table (the prompt holds virtual tokens)"
        )


def _lora(request: Request) -> LoraSpec | None:
    task, weights, config = request.lora_task_id, request.lora_weights, request.lora_config
    if task is None:
        if weights is not None or config is not None:
            raise RequestError(
                "lora_task_id: missing; lora_weights and lora_config need the task id they load"
            )
        return None
    task = _int("lora_task_id", task, 0)
    if (weights is None) != (config is None):
        given, missing = (
            ("lora_weights", "lora_config") if config is None else ("lora_config", "lora_weights")
        )
        raise RequestError(f"{missing}: missing; {given} needs it (the first request of a task carries both)")
    if config is None:
        return LoraSpec(task)
    if not isinstance(config, (list, tuple)) or not config:
        raise RequestError("lora_config: expected rows [module_id, layer_idx, adapter_size]")
    rows = []
    seen = set()
    for i, row in enumerate(config):
        if (
            not isinstance(row, (list, tuple))
            or len(row) != 3
            or any(isinstance(v, bool) or not isinstance(v, int) for v in row)
        ):
            raise RequestError(
                f"lora_config: row {i} is {row!r}; expected [module_id, layer_idx, adapter_size]"
            )
        module, layer, size = row
        if module not in LORA_MODULE_NAMES:
            known = ", ".join(f"{v} ({k})" for k, v in LORA_MODULES.items())
            raise RequestError(f"lora_config: row {i} has module id {module}; supported module ids: {known}")
        if layer < 0 or size < 1:
            raise RequestError(
                f"lora_config: row {i} needs layer_idx >= 0 and adapter_size >= 1, got {list(row)}"
            )
        if (module, layer) in seen:
            raise RequestError(
                f"lora_config: row {i} repeats module {LORA_MODULE_NAMES[module]} of layer {layer}"
            )
        seen.add((module, layer))
        rows.append((module, layer, size))
    try:
        num_rows = len(weights)
    except TypeError:
        raise RequestError("lora_weights: expected rows [num_lora_modules_layers, D x Hi + Ho x D]") from None
    if num_rows != len(rows):
        raise RequestError(
            f"lora_weights: {num_rows} rows but lora_config has {len(rows)}; give one weight row per config row"
        )
    return LoraSpec(task, tuple(rows), weights)


def _drafts(request: Request, limits: RequestLimits, beam_width: int, controls: Controls) -> Any:
    from bm.engine.speculative import SpecState

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
