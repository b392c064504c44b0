"""``InferenceRequest`` as in the seed (a uint64 id plus named tensors) and its validation.

Validation turns the tensor map into the scheduler's plain :class:`LlmRequest`, or raises
:class:`RequestError` with a message naming the tensor and the allowed range. Every spec tensor bm does
not implement yet is refused by name, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

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

SUPPORTED_INPUT_TENSORS = frozenset(
    {
        "input_ids",
        "request_output_len",
        "streaming",
        "beam_width",
        "temperature",
        "runtime_top_k",
        "runtime_top_p",
        "random_seed",
        "end_id",
        "pad_id",
    }
)


class RequestError(ValueError):
    """A request the batch manager refuses; the message is sent back as the error response."""


class InferenceRequest:
    """A request id (uint64) and a map of named input tensors, as the seed's batch manager takes them."""

    def __init__(self, request_id: int, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        self.request_id = request_id
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})

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
        self.tensors[name] = value if isinstance(value, torch.Tensor) else torch.tensor([value], dtype=dtype)

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
    return float(value)


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
    _int(tensors, "beam_width", 1, limits.max_beam_width, 1)
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
        raise RequestError(f"temperature: {temperature} is out of range; allowed >= 0 (0 is greedy)")
    top_k = _int(tensors, "runtime_top_k", 0, None, 0)
    top_p = _float(tensors, "runtime_top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"runtime_top_p: {top_p} is out of range; allowed (0, 1]")
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
    streaming = bool(_scalar(tensors, "streaming")) if "streaming" in tensors else False
    return LlmRequest(
        request_id=rid, prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling, streaming=streaming
    )
