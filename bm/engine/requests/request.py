"""The typed core request and response: plain Python values, no tensors, no torch.

:class:`Request` holds the InferenceRequest table's fields under their spec names, as plain values (lists
of ints, floats, bools); a field left ``None`` was not given and takes the spec's default. The seed's
tensor-map API (:mod:`bm.batch_manager.inference_request`) is an adapter that builds one of these; ``bm run``,
``bm bench`` and ``bm compare`` build them directly. :func:`bm.engine.requests.validate.validate_request` is
the one place every value is checked, into the scheduler's :class:`~bm.scheduling.LlmRequest`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from bm.engine.requests.fields import RequestError
from bm.scheduling.request import FinishReason

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
    # vLLM's min-p: drop tokens less likely than min_p times the most likely one (0: off).
    min_p: float | None = None
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
    # Structured output: the output follows this constraint (a bm.engine.requests.structured.GuidedSpec, or
    # any form bm.engine.requests.structured.guided_spec reads, e.g. {"json": schema}).
    guided_decoding: Any = None


@dataclass
class SampleOutput:
    """One of a request's n samples (final response only), in the order of its index."""

    index: int
    output_ids: list[int]
    finish_reason: FinishReason
    output_log_probs: list[float] | None = None
    output_top_log_probs: list[list[tuple[int, float]]] | None = None


@dataclass(kw_only=True)
class RequestCounters:
    """What a request's final response counts over its life: one type for the engine's response, the
    offline client's result and the seed's response tensors (which name each counter as its field)."""

    num_pauses: int = 0
    num_reused_blocks: int = 0  # block reuse: blocks taken from the cache, every start summed
    num_missed_blocks: int = 0  # context blocks looked up and computed
    # Draft tokens verified and accepted over the request, and the steps that verified some.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_draft_steps: int = 0

    def copy_counters(self, other: RequestCounters) -> None:
        """Take ``other``'s counters (a final response's, onto another record of the request)."""
        for name in COUNTERS:
            setattr(self, name, getattr(other, name))

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified draft tokens (0 without drafts)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Reused over looked-up context blocks (0 when block reuse looked nothing up)."""
        looked_up = self.num_reused_blocks + self.num_missed_blocks
        return self.num_reused_blocks / looked_up if looked_up else 0.0


COUNTERS = tuple(f.name for f in fields(RequestCounters))


@dataclass
class Response(RequestCounters):
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
    beam_log_prob_ranks: list[list[int]] | None = None  # per beam token: its rank where it was chosen
    pad_fill: int = 0  # what pads shorter beams in a [beam_width, n] tensor (the end id, else pad id)
    context_logits: Any = None  # [prompt, vocab]
    generation_logits: Any = None  # [output, vocab]
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Per token of ``output_ids`` when top log probs were asked for: (token, log prob), most likely first.
    output_top_log_probs: list[list[tuple[int, float]]] | None = None
    # n > 1 (final only): every sample, index 0 first; ``output_ids`` and the rest describe sample 0.
    samples: list[SampleOutput] | None = None

    @property
    def ok(self) -> bool:
        return not self.error


def error_response(request_id: int, message: str) -> Response:
    return Response(request_id, final=True, error=message, finish_reason=FinishReason.ERROR)
