"""``InferenceRequest`` as in the seed (a uint64 id plus named tensors): an adapter at the edge.

:func:`to_core_request` reads the tensor map into the typed core :class:`~bm.engine.requests.request.Request`
(plain values), checking what only a tensor can get wrong (shape, dtype); every value is then validated
in one place, :func:`bm.engine.requests.validate.validate_request`. Every spec tensor bm does not implement
yet is refused by name, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from bm.engine.requests.fields import BOOL_FIELDS, WORD_LISTS, token_id_list
from bm.engine.requests.request import COUNTERS, Request, RequestError, RequestLimits, Response, SampleOutput
from bm.engine.requests.validate import UNSUPPORTED_FIELDS, validate_request
from bm.runtime.logits import LogitsPostProcessor
from bm.scheduling.request import FinishReason, LlmRequest

__all__ = ["InferenceRequest", "RequestError", "RequestLimits", "parse_request", "to_core_request"]

# name -> (dtype, description); the InferenceRequest table of the spec.
SPEC_INPUT_TENSORS: dict[str, tuple[torch.dtype, str]] = {
    "input_ids": (torch.int32, "[1, num_input_tokens] prompt token ids"),
    "request_output_len": (torch.int32, "[1, 1] most output tokens"),
    "streaming": (torch.bool, "[1] stream tokens as they are generated"),
    "beam_width": (torch.int32, "[1] beam width (1: no beam search)"),
    "temperature": (torch.float32, "[1] sampling temperature (0: greedy)"),
    "runtime_top_k": (torch.int32, "[1] top-k (0: off)"),
    "runtime_top_p": (torch.float32, "[1] top-p in (0, 1]"),
    "min_p": (torch.float32, "[1] min-p in [0, 1] (0: off)"),
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
    "prompt_embedding_table": (torch.float32, "[1, num_virtual_tokens, hidden] p-tuning table (any float)"),
    "prompt_vocab_size": (torch.int32, "[1] rows of the p-tuning table"),
    "lora_task_id": (torch.uint64, "[1] LoRA task id"),
    "lora_weights": (torch.float32, "[num_lora_modules_layers, D x Hi + Ho x D] LoRA weights"),
    "lora_config": (torch.int32, "[num_lora_modules_layers, 3] rows [module_id, layer_idx, adapter_size]"),
    "return_log_probs": (torch.bool, "[1] return log probs"),
    "return_context_logits": (torch.bool, "[1] return context logits"),
    "return_generation_logits": (torch.bool, "[1] return generation logits"),
    "draft_input_ids": (torch.int32, "[num_draft_tokens] a guess of the continuation"),
    "draft_logits": (torch.float32, "[num_draft_tokens, vocab_size] the drafts' logits"),
    "num_return_sequences": (torch.int32, "[1] samples of the prompt (one prefill, a forked table each)"),
    "top_logprobs": (torch.int32, "[1] most likely tokens returned per position (0-20)"),
}

SUPPORTED_INPUT_TENSORS = frozenset(SPEC_INPUT_TENSORS) - set(UNSUPPORTED_FIELDS)


class InferenceRequest:
    """A request id (uint64) and a map of named input tensors, as the seed's batch manager takes them."""

    def __init__(
        self,
        request_id: int,
        tensors: Mapping[str, torch.Tensor] | None = None,
        logits_post_processor: LogitsPostProcessor | None = None,
        guided_decoding: Any = None,
    ) -> None:
        self.request_id = request_id
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        # Called as fn(request_id, logits [rows, vocab], tokens so far per row) -> logits, before bm's own
        # controls, each step this request samples (rows: 1, or one per beam).
        self.logits_post_processor = logits_post_processor
        # Structured output, as TensorRT-LLM's guided_decoding_params: not a tensor, so an attribute
        # beside the map ({"json": schema}, {"regex": ...}, ...; docs/structured-output.md).
        self.guided_decoding = guided_decoding

    @classmethod
    def from_values(cls, request_id: int, input_ids: list[int], request_output_len: int, **fields: Any):
        """Build the tensors with the spec's shapes and dtypes from plain Python values.

        ``input_ids`` may also be what a transformers tokenizer returns (a mapping with ``input_ids``, one
        row or a flat list) or a tensor; anything else is refused with bm's own message."""
        req = cls(request_id, guided_decoding=fields.pop("guided_decoding", None))
        req.tensors["input_ids"] = torch.tensor([token_id_list(input_ids)], dtype=torch.int32)
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


def _scalar(tensors: Mapping[str, torch.Tensor], name: str) -> Any:
    t = tensors[name]
    if not isinstance(t, torch.Tensor):
        raise RequestError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.numel() != 1:
        raise RequestError(f"{name}: expected a single value (shape [1]), got shape {list(t.shape)}")
    value = t.reshape(-1)[0].item()
    if name in BOOL_FIELDS and not isinstance(value, bool) and value in (0, 1):
        return bool(value)  # a [1] int tensor of 0/1 is the seed's spelling of a flag too
    if t.dtype == torch.float32 and isinstance(value, float):
        return float(f"{value:.7g}")  # the value as written (1.01, not 1.0099999904632568)
    return value


def _prompt(tensors: Mapping[str, torch.Tensor]) -> list[int]:
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
    return ids.tolist()


def to_core_request(request: InferenceRequest) -> Request:
    """The typed core request for a seed ``InferenceRequest`` (values are validated later, in one place)."""
    tensors = request.tensors
    for name in tensors:
        if name not in SPEC_INPUT_TENSORS:
            raise RequestError(f"unknown input tensor {name!r}; known: {', '.join(SPEC_INPUT_TENSORS)}")
        if name not in SUPPORTED_INPUT_TENSORS:
            raise RequestError(f"input tensor {name!r} is not supported yet by bm")
    for name in ("input_ids", "request_output_len"):
        if name not in tensors:
            raise RequestError(f"missing mandatory input tensor {name!r}")
    values: dict[str, Any] = {}
    for name in tensors:
        if name == "input_ids":
            continue
        if name in WORD_LISTS:
            values[name] = [list(w) for w in _word_list(tensors, name)]
        elif name == "embedding_bias":
            values[name] = _embedding_bias(tensors)
        elif name == "prompt_embedding_table":
            values[name] = (
                _rows_tensor(tensors, name, True, "[1, num_virtual_tokens, hidden]").float().tolist()
            )
        elif name == "draft_input_ids":
            values[name] = _draft_ids(tensors)
        elif name == "draft_logits":
            values[name] = _rows_tensor(tensors, name, True, "[num_draft_tokens, vocab_size]")
        elif name == "lora_weights":
            values[name] = _rows_tensor(tensors, name, True, "[num_lora_modules_layers, D x Hi + Ho x D]")
        elif name == "lora_config":
            values[name] = _rows_tensor(tensors, name, False, "[num_lora_modules_layers, 3]").tolist()
        else:
            values[name] = _scalar(tensors, name)
    return Request(
        request_id=request.request_id,
        input_ids=_prompt(tensors),
        logits_post_processor=getattr(request, "logits_post_processor", None),
        guided_decoding=getattr(request, "guided_decoding", None),
        **values,
    )


def parse_request(request: InferenceRequest, limits: RequestLimits) -> LlmRequest:
    """Validate every tensor of ``request``; return the engine's record or raise :class:`RequestError`."""
    return validate_request(to_core_request(request), limits)


def response_tensors(response: Response) -> dict[str, torch.Tensor]:
    """A core response as the seed's ``send_response`` tensors (the spec's response table, plus bm's
    per-request counters on a final response)."""
    tensors: dict[str, torch.Tensor] = {}
    if response.samples is not None:
        _sample_tensors(response, tensors)
    elif response.beams is not None:
        beams, lps = response.beams, response.beam_log_probs or [[] for _ in response.beams]
        width = max((len(b) for b in beams), default=0)
        ids = torch.full((len(beams), width), response.pad_fill, dtype=torch.int32)
        lp = torch.zeros((1, len(beams), width), dtype=torch.float32)
        for b, (tokens, values) in enumerate(zip(beams, lps, strict=True)):
            ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            lp[0, b, : len(values)] = torch.tensor(values, dtype=torch.float32)
        tensors["output_ids"] = ids
        tensors["sequence_length"] = torch.tensor([len(b) for b in beams], dtype=torch.int32)
        if response.cum_log_probs is not None:
            tensors["output_log_probs"] = lp
            tensors["cum_log_probs"] = torch.tensor([response.cum_log_probs], dtype=torch.float32)
    else:
        tokens = response.output_ids
        tensors["output_ids"] = torch.tensor([tokens], dtype=torch.int32).reshape(1, len(tokens))
        tensors["sequence_length"] = torch.tensor([len(tokens)], dtype=torch.int32)
        if response.output_log_probs is not None:
            values = response.output_log_probs
            tensors["output_log_probs"] = torch.tensor([[values]], dtype=torch.float32).reshape(
                1, 1, len(values)
            )
            tensors["cum_log_probs"] = torch.tensor([response.cum_log_probs or [0.0]], dtype=torch.float32)
    if response.context_logits is not None:
        tensors["context_logits"] = response.context_logits[None]
    if response.generation_logits is not None:
        tensors["generation_logits"] = response.generation_logits[None, None]
    if response.final:
        scheduled = response.first_scheduled_time
        tensors.update(
            finish_reason=torch.tensor([int(response.finish_reason)], dtype=torch.int32),
            # the response's counters, each under its own name (bm.engine.requests.request.RequestCounters)
            **{name: torch.tensor([getattr(response, name)], dtype=torch.int32) for name in COUNTERS},
            # seconds from admission to the first iteration that computed part of it (-1: never scheduled)
            queue_time=torch.tensor(
                [scheduled - response.arrival_time if scheduled is not None else -1.0], dtype=torch.float64
            ),
        )
    if response.finish_reason is FinishReason.ERROR and not response.output_ids and response.beams is None:
        tensors["output_ids"] = torch.zeros((1, 0), dtype=torch.int32)
    return tensors


def _sample_tensors(response: Response, tensors: dict[str, torch.Tensor]) -> None:
    """n samples as the beams' shapes: ``output_ids [n, longest]`` (padded with the end id, else the
    pad id), ``sequence_length [n]``, log probs ``[1, n, longest]`` and ``cum_log_probs [n]`` when asked
    for, and ``num_return_sequences [1]`` and each sample's ``finish_reasons [n]`` so a reader tells
    samples from beams."""
    samples = response.samples or []
    width = max((len(s.output_ids) for s in samples), default=0)
    ids = torch.full((len(samples), width), response.pad_fill, dtype=torch.int32)
    for i, sample in enumerate(samples):
        ids[i, : len(sample.output_ids)] = torch.tensor(sample.output_ids, dtype=torch.int32)
    tensors["output_ids"] = ids
    tensors["sequence_length"] = torch.tensor([len(s.output_ids) for s in samples], dtype=torch.int32)
    tensors["num_return_sequences"] = torch.tensor([len(samples)], dtype=torch.int32)
    tensors["finish_reasons"] = torch.tensor([int(s.finish_reason) for s in samples], dtype=torch.int32)
    if all(s.output_log_probs is not None for s in samples) and samples:
        lp = torch.zeros((1, len(samples), width), dtype=torch.float32)
        for i, sample in enumerate(samples):
            lp[0, i, : len(sample.output_log_probs)] = torch.tensor(sample.output_log_probs)
        tensors["output_log_probs"] = lp
        tensors["cum_log_probs"] = torch.tensor([sum(s.output_log_probs) for s in samples])


def response_from_tensors(
    request_id: int, tensors: Mapping[str, torch.Tensor], final: bool, error: str
) -> Response:
    """A seed ``send_response`` call read back into a core response (for clients that take either)."""
    response = Response(request_id, final=final, error=error)
    ids, lengths = tensors.get("output_ids"), tensors.get("sequence_length")
    lp = tensors.get("output_log_probs")
    if "num_return_sequences" in tensors and ids is not None:  # n samples
        lens = lengths.tolist() if lengths is not None else [ids.shape[1]] * ids.shape[0]
        reasons = tensors["finish_reasons"].tolist()
        response.samples = [
            SampleOutput(
                i,
                ids[i, :n].tolist(),
                FinishReason(reasons[i]),
                lp[0, i, :n].tolist() if lp is not None else None,
            )
            for i, n in enumerate(lens)
        ]
        response.output_ids = list(response.samples[0].output_ids) if response.samples else []
        response.output_log_probs = response.samples[0].output_log_probs if response.samples else None
    elif ids is not None and ids.dim() == 2 and ids.shape[0] > 1:  # beams
        lens = lengths.tolist() if lengths is not None else [ids.shape[1]] * ids.shape[0]
        response.beams = [ids[b, :n].tolist() for b, n in enumerate(lens)]
        response.output_ids = list(response.beams[0])
        if lp is not None:
            response.beam_log_probs = [lp[0, b, :n].tolist() for b, n in enumerate(lens)]
    elif ids is not None and ids.numel():
        response.output_ids = ids.reshape(-1).tolist()
        if lp is not None:
            response.output_log_probs = lp.reshape(-1).tolist()
    cum = tensors.get("cum_log_probs")
    if cum is not None:
        response.cum_log_probs = cum.reshape(-1).tolist()
    if "context_logits" in tensors:
        response.context_logits = tensors["context_logits"][0]
    if "generation_logits" in tensors:
        response.generation_logits = tensors["generation_logits"][0, 0]
    reason = tensors.get("finish_reason")
    response.finish_reason = FinishReason(int(reason[0])) if reason is not None else FinishReason.NOT_FINISHED
    if final and reason is None:
        response.finish_reason = FinishReason.ERROR
    for name in COUNTERS:
        value = tensors.get(name)
        if value is not None:
            setattr(response, name, int(value[0]))
    return response


def _rows_tensor(tensors: Mapping[str, torch.Tensor], name: str, floating: bool, shape: str) -> torch.Tensor:
    """A 2-D tensor field ([1, rows, width] accepted too); float rows stay a tensor for the runtime."""
    value = tensors[name]
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point != floating:
        kind = "float" if floating else "integer"
        raise RequestError(f"{name}: expected a {kind} tensor {shape}")
    if value.dim() == 3 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 2:
        raise RequestError(f"{name}: expected shape {shape}, got {list(value.shape)}")
    return value


def _draft_ids(tensors: Mapping[str, torch.Tensor]) -> list[int]:
    ids = tensors["draft_input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise RequestError("draft_input_ids: expected an integer tensor [num_draft_tokens]")
    return ids.reshape(-1).tolist()


def _embedding_bias(tensors: Mapping[str, torch.Tensor]) -> list[float]:
    bias = tensors["embedding_bias"]
    if not isinstance(bias, torch.Tensor) or bias.dtype == torch.bool or bias.dtype.is_complex:
        raise RequestError("embedding_bias: expected a float tensor of shape [1, vocab_size]")
    if bias.dim() == 2 and bias.shape[0] == 1:
        bias = bias[0]
    if bias.dim() != 1:
        raise RequestError(
            f"embedding_bias: expected shape [1, vocab_size] (one value per vocabulary token), "
            f"got {list(tensors['embedding_bias'].shape)}"
        )
    return bias.to(torch.float32).tolist()


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


def _word_list(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[tuple[int, ...], ...]:
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
        words.append(tuple(ids[start:end]))
        start = end
    return tuple(words)
