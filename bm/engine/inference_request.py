"""``InferenceRequest`` as in the seed (a uint64 id plus named tensors) and its validation.

Validation turns the tensor map into the scheduler's plain :class:`LlmRequest`, or raises
:class:`RequestError` with a message naming the tensor and the allowed range. Every spec tensor bm does
not implement yet is refused by name, never silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from bm.runtime.beam_search import BeamSearch
from bm.runtime.logits import DecodingOptions, LogitsPostProcessor
from bm.scheduling.request import LlmRequest, SamplingParams

UINT64_MAX = 2**64 - 1

# name -> (dtype, description); the InferenceRequest table of the spec.
SPEC_INPUT_TENSORS: dict[str, tuple[torch.dtype, str]] = {
    "input_ids": (torch.int32, "[1, num_input_tokens] prompt token ids"),
    "request_output_len": (torch.int32, "[1, 1] most output tokens"),
    "streaming": (torch.bool, "[1] stream tokens as they are generated"),
    "beam_width": (torch.int32, "[1] beam width (1: no beam search)"),
    "temperature": (torch.float32, "[1] sampling temperature (0: greedy)"),
    "runtime_top_k": (torch.int32, "[1] top-k (0: off)"),
    "runtime_top_p": (torch.float32, "[1] top-p in (0, 1]"),
    "len_penalty": (torch.float32, "[1] beam length penalty"),
    "early_stopping": (torch.int32, "[1] beam early stopping"),
    "repetition_penalty": (torch.float32, "[1] repetition penalty"),
    "min_length": (torch.int32, "[1] minimum output length"),
    "presence_penalty": (torch.float32, "[1] presence penalty"),
    "frequency_penalty": (torch.float32, "[1] frequency penalty"),
    "no_repeat_ngram_size": (torch.int32, "[1] no-repeat n-gram size"),
    "random_seed": (torch.uint64, "[1] sampling seed"),
    "end_id": (torch.int32, "[1] end token id (-1: none)"),
    "pad_id": (torch.int32, "[1] pad token id"),
    "embedding_bias": (torch.float32, "[1, vocab_size] logit bias"),
    "bad_words_list": (torch.int32, "[2, n] bad words"),
    "stop_words_list": (torch.int32, "[2, n] stop words"),
    "prompt_embedding_table": (torch.float16, "p-tuning table"),
    "prompt_vocab_size": (torch.int32, "p-tuning vocab size"),
    "lora_task_id": (torch.int64, "LoRA task id"),
    "lora_weights": (torch.float32, "LoRA weights"),
    "lora_config": (torch.int32, "LoRA config"),
    "return_log_probs": (torch.bool, "[1] return log probs"),
    "return_context_logits": (torch.bool, "[1] return context logits"),
    "return_generation_logits": (torch.bool, "[1] return generation logits"),
    "draft_input_ids": (torch.int32, "draft tokens"),
    "draft_logits": (torch.float32, "draft logits"),
}

# LoRA, p-tuning and draft tokens are refused by name until they are implemented.
SUPPORTED_INPUT_TENSORS = frozenset(SPEC_INPUT_TENSORS) - {
    "prompt_embedding_table",
    "prompt_vocab_size",
    "lora_task_id",
    "lora_weights",
    "lora_config",
    "draft_input_ids",
    "draft_logits",
}
WORD_LISTS = ("bad_words_list", "stop_words_list")


class RequestError(ValueError):
    """A request the batch manager refuses; the message is sent back as the error response."""


class InferenceRequest:
    """A request id (uint64) and a map of named input tensors, as the seed's batch manager takes them."""

    def __init__(
        self,
        request_id: int,
        tensors: Mapping[str, torch.Tensor] | None = None,
        logits_post_processor: LogitsPostProcessor | None = None,
    ) -> None:
        self.request_id = request_id
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        # Called as fn(request_id, logits [rows, vocab], tokens so far per row) -> logits, before bm's own
        # controls, each step this request samples (rows: 1, or one per beam).
        self.logits_post_processor = logits_post_processor

    @classmethod
    def from_values(cls, request_id: int, input_ids: list[int], request_output_len: int, **fields: Any):
        """Build the tensors with the spec's shapes and dtypes from plain Python values."""
        req = cls(request_id)
        req.tensors["input_ids"] = torch.tensor([list(input_ids)], dtype=torch.int32)
        req.tensors["request_output_len"] = torch.tensor([[request_output_len]], dtype=torch.int32)
        for name, value in fields.items():
            req.set(name, value)
        return req

    def set(self, name: str, value: Any) -> None:
        if name not in SPEC_INPUT_TENSORS:
            raise RequestError(f"unknown input tensor {name!r}; known: {', '.join(SPEC_INPUT_TENSORS)}")
        dtype = SPEC_INPUT_TENSORS[name][0]
        if isinstance(value, torch.Tensor):
            self.tensors[name] = value
        elif name in WORD_LISTS:
            self.tensors[name] = word_list_tensor(value)
        else:
            self.tensors[name] = torch.tensor([value], dtype=dtype)

    def __repr__(self) -> str:
        return f"InferenceRequest(request_id={self.request_id}, tensors={sorted(self.tensors)})"


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_seq_len: int
    max_num_tokens: int | None  # None: chunked context, any prompt fits piece by piece
    max_beam_width: int


def _scalar(tensors: Mapping[str, torch.Tensor], name: str) -> Any:
    t = tensors[name]
    if not isinstance(t, torch.Tensor):
        raise RequestError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.numel() != 1:
        raise RequestError(f"{name}: expected a single value (shape [1]), got shape {list(t.shape)}")
    return t.reshape(-1)[0].item()


def _int(tensors: Mapping[str, torch.Tensor], name: str, low: int, high: int | None, default: int) -> int:
    if name not in tensors:
        return default
    value = _scalar(tensors, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name}: expected an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"{name}: {value} is out of range; allowed {bound}")
    return value


def _float(tensors: Mapping[str, torch.Tensor], name: str, default: float) -> float:
    if name not in tensors:
        return default
    value = _scalar(tensors, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise RequestError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def _show(value: float) -> str:
    """A float32 tensor's value as the user wrote it (1.01, not 1.0099999904632568)."""
    return repr(float(f"{value:.7g}"))


def _prompt(tensors: Mapping[str, torch.Tensor], vocab_size: int) -> list[int]:
    ids = tensors["input_ids"]
    if not isinstance(ids, torch.Tensor):
        raise RequestError(f"input_ids: expected a tensor, got {type(ids).__name__}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise RequestError(
            f"input_ids: expected shape [1, num_input_tokens], got {list(tensors['input_ids'].shape)}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise RequestError(f"input_ids: expected integer token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        raise RequestError("input_ids: the prompt is empty; give at least one token")
    prompt = ids.tolist()
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise RequestError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return prompt


def parse_request(request: InferenceRequest, limits: RequestLimits) -> LlmRequest:
    """Validate every tensor of ``request``; return the scheduler's record or raise :class:`RequestError`."""
    rid = request.request_id
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid <= UINT64_MAX:
        raise RequestError(f"request id {rid!r} is not a uint64")
    tensors = request.tensors
    for name in tensors:
        if name not in SPEC_INPUT_TENSORS:
            raise RequestError(f"unknown input tensor {name!r}; known: {', '.join(SPEC_INPUT_TENSORS)}")
        if name not in SUPPORTED_INPUT_TENSORS:
            raise RequestError(f"input tensor {name!r} is not supported yet by bm")
    for name in ("input_ids", "request_output_len"):
        if name not in tensors:
            raise RequestError(f"missing mandatory input tensor {name!r}")

    prompt = _prompt(tensors, limits.vocab_size)
    max_new = _int(tensors, "request_output_len", 1, None, 0)
    beam_width = _int(tensors, "beam_width", 1, limits.max_beam_width, 1)
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

    temperature = _float(tensors, "temperature", 0.0)
    if temperature < 0:
        raise RequestError(f"temperature: {_show(temperature)} is out of range; allowed >= 0 (0 is greedy)")
    top_k = _int(tensors, "runtime_top_k", 0, None, 0)
    top_p = _float(tensors, "runtime_top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"runtime_top_p: {_show(top_p)} is out of range; allowed (0, 1]")
    if "temperature" not in tensors and (top_k > 1 or top_p < 1):
        temperature = 1.0  # asking for a filter means asking to sample
    sampling = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        random_seed=_int(tensors, "random_seed", 0, UINT64_MAX, 0),
        end_id=_int(tensors, "end_id", -1, limits.vocab_size - 1, -1),
        pad_id=_int(tensors, "pad_id", 0, limits.vocab_size - 1, 0),
    )
    streaming = _bool(tensors, "streaming")
    options = _decoding_options(request, tensors, limits, max_new)
    # Validated whatever the width; they only act on beams (as in TensorRT-LLM and HF).
    len_penalty = _float(tensors, "len_penalty", 1.0)
    early_stopping = _int(tensors, "early_stopping", 0, None, 1)
    if beam_width > 1:
        _check_beam_request(sampling, streaming, options)
        options = options or DecodingOptions()
        options.beam = BeamSearch(beam_width, max_new, sampling.end_id, len_penalty, early_stopping)
    return LlmRequest(
        request_id=rid,
        prompt_ids=prompt,
        max_new_tokens=max_new,
        sampling=sampling,
        streaming=streaming,
        beam_width=beam_width,
        decoding=options,
        output_log_probs=[] if options is not None and options.return_log_probs else None,
    )


def _bool(tensors: Mapping[str, torch.Tensor], name: str) -> bool:
    if name not in tensors:
        return False
    value = _scalar(tensors, name)
    if value not in (0, 1):
        raise RequestError(f"{name}: expected true or false, got {value!r}")
    return bool(value)


def _decoding_options(
    request: InferenceRequest, tensors: Mapping[str, torch.Tensor], limits: RequestLimits, max_new: int
) -> DecodingOptions | None:
    """The controls beyond temperature / top-k / top-p; None when the request asks for none of them."""
    repetition = _float(tensors, "repetition_penalty", 1.0)
    if repetition <= 0:
        raise RequestError(f"repetition_penalty: {_show(repetition)} is out of range; allowed > 0 (1 is off)")
    options = DecodingOptions(
        repetition_penalty=repetition,
        presence_penalty=_float(tensors, "presence_penalty", 0.0),
        frequency_penalty=_float(tensors, "frequency_penalty", 0.0),
        min_length=_int(tensors, "min_length", 0, max_new, 0),
        no_repeat_ngram_size=_int(tensors, "no_repeat_ngram_size", 0, None, 0),
        embedding_bias=_embedding_bias(tensors, limits.vocab_size),
        bad_words=_word_list(tensors, "bad_words_list", limits.vocab_size),
        stop_words=_word_list(tensors, "stop_words_list", limits.vocab_size),
        return_log_probs=_bool(tensors, "return_log_probs"),
        return_context_logits=_bool(tensors, "return_context_logits"),
        return_generation_logits=_bool(tensors, "return_generation_logits"),
        logits_post_processor=getattr(request, "logits_post_processor", None),
    )
    if options.logits_post_processor is not None and not callable(options.logits_post_processor):
        raise RequestError(
            "logits_post_processor: expected a callable (request_id, logits, tokens) -> logits"
        )
    asked = (
        options.processes_logits
        or options.stop_words
        or options.return_log_probs
        or options.return_context_logits
        or options.return_generation_logits
    )
    return options if asked else None


def _check_beam_request(
    sampling: SamplingParams,
    streaming: bool,
    options: DecodingOptions | None,
) -> None:
    """Combinations bm does not implement with beam search are refused, never silently ignored."""
    if not sampling.is_greedy:
        raise RequestError(
            "beam_width: beam search is deterministic in bm; drop temperature / runtime_top_k / runtime_top_p "
            "or use beam_width 1"
        )
    if streaming:
        raise RequestError("streaming: not supported with beam_width > 1; set streaming to false")
    if options is not None and options.stop_words:
        raise RequestError("stop_words_list: not supported with beam_width > 1")
    if options is not None and options.return_generation_logits:
        raise RequestError("return_generation_logits: not supported with beam_width > 1")


def _embedding_bias(tensors: Mapping[str, torch.Tensor], vocab_size: int) -> torch.Tensor | None:
    if "embedding_bias" not in tensors:
        return None
    bias = tensors["embedding_bias"]
    if not isinstance(bias, torch.Tensor) or bias.dtype == torch.bool or bias.dtype.is_complex:
        raise RequestError("embedding_bias: expected a float tensor of shape [1, vocab_size]")
    if bias.dim() == 2 and bias.shape[0] == 1:
        bias = bias[0]
    if bias.dim() != 1 or bias.shape[0] != vocab_size:
        raise RequestError(
            f"embedding_bias: expected shape [1, {vocab_size}] (one value per vocabulary token), "
            f"got {list(tensors['embedding_bias'].shape)}"
        )
    bias = bias.to(torch.float32)
    if not bool(torch.isfinite(bias).all()):
        raise RequestError("embedding_bias: values must be finite numbers")
    return bias


def word_list_tensor(words: Any) -> torch.Tensor:
    """A list of token-id lists as TensorRT-LLM's ``[2, n]`` form: flattened ids over end offsets (padded -1)."""
    if not isinstance(words, (list, tuple)) or not all(
        isinstance(w, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in w)
        for w in words
    ):
        raise RequestError("word list: expected a list of token-id lists")
    flat = [t for w in words for t in w]
    offsets, end = [], 0
    for w in words:
        end += len(w)
        offsets.append(end)
    n = max(len(flat), 1)
    return torch.tensor(
        [flat + [0] * (n - len(flat)), offsets + [-1] * (n - len(offsets))], dtype=torch.int32
    )


def _word_list(
    tensors: Mapping[str, torch.Tensor], name: str, vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """Parse the ``[2, n]`` form: row 0 the words' ids back to back, row 1 each word's end offset, then -1."""
    if name not in tensors:
        return ()
    t = tensors[name]
    form = f"{name}: expected the [2, n] form (row 0: token ids of all words back to back; row 1: each word's end offset, then -1 padding)"
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise RequestError(form)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or t.shape[0] != 2:
        raise RequestError(f"{form}; got shape {list(t.shape)}")
    ids, offsets = t[0].tolist(), t[1].tolist()
    words, start = [], 0
    for i, end in enumerate(offsets):
        if end < 0:
            if any(o >= 0 for o in offsets[i:]):
                raise RequestError(
                    f"{name}: offset -1 (padding) is followed by a real offset; {form[len(name) + 2 :]}"
                )
            break
        if end <= start or end > len(ids):
            raise RequestError(
                f"{name}: offsets must increase strictly and stay within the {len(ids)} token ids; got {offsets}"
            )
        word = ids[start:end]
        if min(word) < 0 or max(word) >= vocab_size:
            raise RequestError(f"{name}: token id outside the vocabulary [0, {vocab_size}) in word {word}")
        words.append(tuple(word))
        start = end
    return tuple(words)
