"""vLLM's request-side types that are not sampling parameters: prompts, LoRA requests, beam search.

Why here and not in :mod:`bm.llm_params`: these are what a vLLM script passes *beside* its
``SamplingParams`` (``TokensPrompt``, ``LoRARequest``, ``BeamSearchParams``) or gets back from
``llm.beam_search`` and in ``RequestOutput.metrics``; keeping them apart keeps each module small. Every
constructor checks its values at once and raises :class:`~bm.llm_params.InvalidParameterError` naming
the field, as ``SamplingParams`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from bm.config.vllm import NotInBm
from bm.engine.requests.fields import RequestError, check_bool, check_int
from bm.llm_params import InvalidParameterError, Logprob, refusing_unknown_keywords


class TextPrompt(TypedDict, total=False):
    """vLLM's text prompt: ``{"prompt": "..."}`` (a plain dict; calling the class builds one)."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's token prompt: ``{"prompt_token_ids": [...]}`` (a plain dict; calling the class builds one)."""

    prompt_token_ids: list[int]


# Keys vLLM's prompt dicts may carry that bm cannot honour -> the bm way (any value but None is refused).
PROMPT_KEYS_NOT_IN_BM = {
    "multi_modal_data": "bm runs text-only models; pass text or token ids",
    "mm_processor_kwargs": "bm runs text-only models; drop it",
    "multi_modal_uuids": "bm runs text-only models; drop it",
    "token_type_ids": "bm runs decoder-only models, which take none; drop it",
    "prompt_embeds": "bm.LLM takes text or token ids; a prompt table runs through bm run's "
    "prompt_embedding_table lines (docs/request-fields.md)",
}
# Keys vLLM's prompt dicts may carry that change nothing bm computes (accepted, read by no one).
PROMPT_KEYS_INERT = ("cache_salt",)


@refusing_unknown_keywords(
    {
        "lora_local_path": NotInBm("vLLM's older name for lora_path", "pass lora_path=", inert=(None,)),
        "tensorizer_config_dict": NotInBm(
            "bm reads adapters saved by peft (safetensors)", "drop it", inert=(None,)
        ),
    }
)
@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for some prompts, in vLLM's positional order: ``LoRARequest(name, int_id, path)``.

    ``lora_path`` is a directory saved by ``peft`` (``adapter_config.json`` + ``adapter_model.safetensors``),
    read once per process and served from the engine's adapter cache (``peft_cache``), exactly as bm run's
    ``lora_dir`` lines are. ``lora_int_id`` names the adapter, as in vLLM: one id serves one path per
    ``LLM``, and a second path under the same id is refused rather than answered by the first adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    long_lora_max_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidParameterError(
                f"LoRARequest.lora_name: expected a non-empty string, got {self.lora_name!r}"
            )
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise InvalidParameterError(
                f"LoRARequest.lora_int_id: expected an integer >= 1 (vLLM's rule), got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidParameterError(
                f"LoRARequest.lora_path: expected the directory peft saved the adapter to, got {self.lora_path!r}"
            )
        if self.long_lora_max_len is not None:
            raise InvalidParameterError(
                "LoRARequest.long_lora_max_len: bm has no long-context LoRA scaling; drop it"
            )


@refusing_unknown_keywords({})
@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters for :meth:`bm.LLM.beam_search`, run by bm's engine beam search
    (TensorRT-LLM's, checked against HF ``generate(num_beams=...)``). bm's beam search is deterministic,
    so ``temperature`` must stay 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: the text keeps them, as a checkpoint's tokenizer spells them

    def __post_init__(self) -> None:
        try:
            check_int("beam_width", self.beam_width, "beam_width", low=1)
            check_int("request_output_len", self.max_tokens, "max_tokens", low=1)
            check_bool(self.ignore_eos, "ignore_eos")
            check_bool(self.include_stop_str_in_output, "include_stop_str_in_output")
            check_bool(self.skip_special_tokens, "skip_special_tokens")
        except RequestError as exc:
            raise InvalidParameterError(f"BeamSearchParams.{exc}") from None
        if self.temperature != 0:
            raise InvalidParameterError(
                f"BeamSearchParams.temperature: {self.temperature!r} asks for sampled beams, and bm's beam "
                "search is deterministic; leave temperature at 0, or sample with llm.generate("
                "prompts, SamplingParams(n=..., temperature=...))"
            )
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise InvalidParameterError(
                f"BeamSearchParams.length_penalty: expected a number, got {self.length_penalty!r}"
            )


@dataclass
class BeamSearchSequence:
    """One beam as vLLM's ``LLM.beam_search`` returns it: ``tokens`` and ``text`` hold the prompt and the
    beam's output; ``logprobs`` one dict per output token (the token chosen, its log probability and its
    rank under the beam it extended)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (by cumulative log probability over length ** length_penalty)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """When a request's milestones happened, under vLLM's ``RequestMetrics`` names, in seconds since the
    epoch (``time.time()``'s clock): the engine records arrival, first scheduled and first token; the
    library the moment the final response came back (``finished_time``, also ``last_token_time``)."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    time_in_queue: float | None
    finished_time: float | None


def prompt_keys_refusal(prompt: Any) -> None:
    """Refuse the keys of a vLLM prompt dict bm cannot honour, naming the key and the bm way."""
    known = {"prompt", "prompt_token_ids", "input_ids", *PROMPT_KEYS_INERT}
    for key, value in prompt.items():
        if key in known or value is None:
            continue
        why = PROMPT_KEYS_NOT_IN_BM.get(key)
        if why is None:
            raise InvalidParameterError(
                f"prompt[{key!r}]: unknown key; a prompt is text, token ids, {{'prompt': text}} "
                "(TextPrompt) or {'prompt_token_ids': ids} (TokensPrompt)"
            )
        raise InvalidParameterError(f"prompt[{key!r}]: {why}")


__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "LoRARequest",
    "RequestMetrics",
    "TextPrompt",
    "TokensPrompt",
    "prompt_keys_refusal",
]
