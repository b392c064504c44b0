"""What ``bm.LLM``'s calls take, read once: prompts in vLLM's shapes, per-prompt parameters and LoRA
requests, and the vLLM call keywords bm has no counterpart for.

Why apart from :mod:`bm.llm`: judging what a caller handed over is the library's edge (every refusal
an :class:`~bm.llm_params.InvalidParameterError` naming the field and the bm way); the front door
keeps to running what was judged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bm.config.vllm import NotInBm
from bm.engine.requests.fields import RequestError, token_id_list
from bm.llm_params import InvalidParameterError, SamplingParams, refuse_unknown
from bm.llm_types import BeamSearchParams, LoRARequest, prompt_keys_refusal

Loras = LoRARequest | Sequence[LoRARequest | None] | None

# vLLM keywords of generate/chat/beam_search bm has no counterpart for (accepted at the inert values).
CALL_ONLY: dict[str, NotInBm] = {
    "priority": NotInBm("bm admits a batch's requests first come, first served", "drop it", inert=(None,)),
    "prompt_adapter_request": NotInBm("bm has no prompt adapters", "drop it", inert=(None,)),
    "guided_options_request": NotInBm(
        "structured output is a sampling parameter in bm, as in current vLLM",
        "pass SamplingParams(structured_outputs=StructuredOutputsParams(...))",
        inert=(None,),
    ),
    "tokenization_kwargs": NotInBm(
        "bm encodes prompts as the tokenizer's files say", "drop it", inert=(None,)
    ),
    "chat_template_content_format": NotInBm(
        "bm hands the template each message's content as text (OpenAI's text parts joined), vLLM's 'string'",
        "drop it, or pass 'string'",
        inert=("auto", "string"),
    ),
    "mm_processor_kwargs": NotInBm("bm runs text-only models", "drop it", inert=(None,)),
    "concurrency_limit": NotInBm(
        "bm runs every beam request of the call in one engine, bounded by engine.max_batch_size",
        "drop it",
        inert=(None,),
    ),
}
_CALL_KEYWORDS = (
    "sampling_params",
    "use_tqdm",
    "lora_request",
    "chat_template",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
)


def refuse_call_keywords(owner: str, unknown: Mapping[str, Any]) -> None:
    """A keyword ``generate``/``chat``/``beam_search`` has no parameter for, judged as ``LLM(...)``'s are:
    :class:`InvalidParameterError` (not Python's ``TypeError``) with the nearest name or the bm way."""
    for name, value in unknown.items():
        refuse_unknown(owner, name, value, _CALL_KEYWORDS, CALL_ONLY)


def parse_prompts(prompts: Any, encode: Callable[[str], list[int]]) -> list[tuple[str | None, list[int]]]:
    """``(text or None, ids)`` per prompt: text, token ids, a tokenizer's result, or vLLM's
    ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` dicts, one or a list of them."""
    single = isinstance(prompts, (str, Mapping)) or hasattr(prompts, "tolist") or _is_ids(prompts)
    out = []
    for p in [prompts] if single else list(prompts):
        if isinstance(p, Mapping):
            prompt_keys_refusal(p)
            if "prompt" in p and ("prompt_token_ids" in p or "input_ids" in p):
                raise InvalidParameterError("prompt: give 'prompt' (text) or 'prompt_token_ids', not both")
            if "prompt" in p:
                out.append((p["prompt"], encode(p["prompt"])))
                continue
        out.append((p, encode(p)) if isinstance(p, str) else (None, _ids(p)))
    return out


def per_prompt_params(params: Any, count: int, default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt (``default()`` when none is given)."""
    if params is None:
        return [default()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, BeamSearchParams):
        raise InvalidParameterError(
            "sampling_params: BeamSearchParams go to llm.beam_search(prompts, params), as in vLLM"
        )
    params = list(params)
    if not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidParameterError("sampling_params: expected bm.SamplingParams, or a list of them")
    if len(params) != count:
        raise InvalidParameterError(
            f"sampling_params: {len(params)} given for {count} prompts; give one, or one per prompt"
        )
    return params


class LoraRequests:
    """``lora_request`` arguments judged as vLLM judges them, then carried on bm's PEFT path."""

    def __init__(self, enable: bool, max_rank: int | None) -> None:
        self.enable, self.max_rank = enable, max_rank
        self._paths: dict[int, str] = {}  # lora_int_id -> its path: one adapter per id, as in vLLM

    def per_prompt(self, loras: Loras, count: int) -> list[LoRARequest | None]:
        if loras is None or isinstance(loras, LoRARequest):
            given = [loras] * count
        elif isinstance(loras, Sequence) and all(r is None or isinstance(r, LoRARequest) for r in loras):
            given = list(loras)
            if len(given) != count:
                raise InvalidParameterError(
                    f"lora_request: {len(given)} given for {count} prompts; give one, or one per prompt"
                )
        else:
            raise InvalidParameterError(
                "lora_request: expected bm.LoRARequest(name, int_id, path), or a list with one per prompt"
            )
        if any(r is not None for r in given) and not self.enable:
            raise InvalidParameterError(
                "lora_request: this LLM was built without LoRA; build it with LLM(..., enable_lora=True) "
                "(max_loras= bounds the adapters kept loaded, peft_cache.max_adapters)"
            )
        return given

    def fields(self, lora: LoRARequest | None) -> dict[str, Any]:
        """The engine fields that carry ``lora``'s adapter (bm.adapters: the path bm run's ``lora_dir``
        takes), after vLLM's checks: one path per id, and ranks within ``max_lora_rank``."""
        if lora is None:
            return {}
        from bm.adapters import lora_fields

        path = str(Path(lora.lora_path).resolve())
        known = self._paths.setdefault(lora.lora_int_id, path)
        if known != path:
            raise InvalidParameterError(
                f"LoRARequest.lora_int_id: {lora.lora_int_id} already names the adapter at {known}; give "
                f"{lora.lora_path} an id of its own"
            )
        try:
            fields_ = lora_fields(lora.lora_path)
        except ValueError as exc:
            raise InvalidParameterError(f"LoRARequest.lora_path: {exc}") from None
        rank = max((int(row[2]) for row in fields_["lora_config"]), default=0)
        bound = self.max_rank
        if bound is not None and rank > bound:
            raise InvalidParameterError(
                f"LoRARequest.lora_path: adapter {lora.lora_name!r} has rank {rank}, above "
                f"LLM(max_lora_rank={bound}); raise max_lora_rank"
            )
        return fields_


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(t, int) for t in value)
        and bool(value)
    )


def _ids(value: Any) -> list[int]:
    try:
        ids = token_id_list(value)
    except RequestError as exc:
        raise InvalidParameterError(f"prompt: {exc}") from None
    if not ids:
        raise InvalidParameterError(
            "a prompt must be text or a non-empty list of token ids, got an empty list"
        )
    return ids
