"""The batch manager's own record of a request, in plain Python so schedulers can run without a model.

State values are ordered as on the scheduler page, so "may be scheduled" is a range check:
``CONTEXT_INIT <= state < GENERATION_COMPLETE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from bm.scheduling.controls import Controls


class RequestState(IntEnum):
    CONTEXT_INIT = 1
    GENERATION_IN_PROGRESS = 2
    GENERATION_TO_COMPLETE = 3
    GENERATION_COMPLETE = 4


# The states of a request in its generation phase (:attr:`LlmRequest.is_generation_phase`), and the first
# state, as module constants: the schedulers' per-request loops test ``request.state`` against them rather
# than call the phase properties, and reading a member off its enum class costs more than the test itself.
GENERATION_STATES = (RequestState.GENERATION_IN_PROGRESS, RequestState.GENERATION_TO_COMPLETE)
CONTEXT_INIT = RequestState.CONTEXT_INIT

# The input token of a generation row whose previous token is still being sampled (overlap scheduling,
# bm.engine.step.overlap; :attr:`LlmRequest.num_pending`): the executor writes in the token that request's row
# of the previous launch sampled. Token ids are never negative.
PENDING_TOKEN = -1


class FinishReason(IntEnum):
    """Why a request ended; values follow TensorRT-LLM's executor, with ERROR added by bm."""

    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5
    ERROR = 6

    @property
    def label(self) -> str:
        """The one name users read, in ``bm run``'s records and ``bm.LLM``'s outputs alike: vLLM's and
        OpenAI's words where they have one (``stop`` for the end token and for a stop word, ``length``),
        else bm's (``cancelled``, ``error``, ``timed_out``)."""
        return _LABELS[self]


NOT_FINISHED = FinishReason.NOT_FINISHED

_LABELS = {
    FinishReason.NOT_FINISHED: "not_finished",
    FinishReason.END_ID: "stop",
    FinishReason.STOP_WORDS: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TIMED_OUT: "timed_out",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.ERROR: "error",
}


class TopLogProbs(list):
    """One position's most likely ``(token, log prob)`` pairs, most likely first (a plain list to every
    reader), and ``rank``: the chosen token's rank in the whole vocabulary there (1 + the tokens more
    likely than it), which vLLM reports even for a chosen token outside the top ones. Riding on the
    list the engine already carries per position keeps the response's shape unchanged."""

    rank: int | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across ranks with its rank
        return (_top_log_probs, (list(self), self.rank))


def _top_log_probs(pairs: list[tuple[int, float]], rank: int | None) -> TopLogProbs:
    top = TopLogProbs(pairs)
    top.rank = rank
    return top


@dataclass(frozen=True)
class Sampling:
    """Per-request decoding controls, already validated. ``temperature == 0`` means greedy. Named as the
    engine request names them (the seed's tensor names: ``runtime_top_k``, ``random_seed``), so a control
    keeps one name from validation to the sampler."""

    temperature: float = 0.0
    runtime_top_k: int = 0  # 0: no top-k filter
    runtime_top_p: float = 1.0  # 1.0: no nucleus filter
    min_p: float = 0.0  # 0.0: no min-p filter (keep tokens at least min_p x the top token's probability)
    random_seed: int = 0
    end_id: int = -1  # -1: never stop on a token
    pad_id: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.runtime_top_k == 1


class PromptTableInput(Protocol):
    """A validated prompt-tuning table: ``rows[i]`` embeds prompt id ``vocab_size + i``."""

    rows: tuple[tuple[float, ...], ...]
    key: str  # digest of the values


class LoraInput(Protocol):
    """A request's adapter: its task id, and on a task's first request its config and weight rows."""

    task_id: int
    config: tuple[tuple[int, int, int], ...] | None
    weights: Sequence[Sequence[float]] | None


class ModelInputValues(Protocol):
    """What changes a request's activations beside its token ids
    (:class:`bm.engine.requests.model_inputs.ModelInputs`)."""

    prompt_table: PromptTableInput | None
    lora: LoraInput | None

    @property
    def block_extra_keys(self) -> tuple[str | int, ...]: ...


@dataclass
class SpecState:
    """A request's drafts and their counts. ``draft_logits``: one row of floats per draft token (rows
    given as arrays are read into plain floats here, so the request holds no tensor)."""

    drafts: tuple[int, ...] = ()
    draft_logits: tuple[tuple[float, ...], ...] | None = None
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which accepted
    num_draft_steps: int = 0  # generation steps that verified drafts

    def __post_init__(self) -> None:
        rows = self.draft_logits
        if rows is not None:
            self.draft_logits = tuple(
                tuple(float(x) for x in (row.tolist() if hasattr(row, "tolist") else row)) for row in rows
            )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(eq=False)
class LlmRequest:
    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    streaming: bool = False
    state: RequestState = RequestState.CONTEXT_INIT
    output_ids: list[int] = field(default_factory=list)
    # Tokens sampled by an iteration still in flight (overlap scheduling, bm.engine.step.overlap), not known
    # on the host yet: they count in the request's length (the scheduler, the cache and the batch see it)
    # and are never in ``output_ids``. Only the overlap path changes it.
    num_pending: int = 0
    # Tokens whose keys and values are in the cache. A context phase (first or after a pause) covers
    # every known token; generation then adds one token an iteration.
    num_computed_tokens: int = 0
    # Set by the micro-batch scheduler each iteration a context request is scheduled.
    context_chunk_size: int = 0
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    num_streamed_tokens: int = 0
    num_pauses: int = 0
    # Block reuse, summed over every start (a resumed request looks its context up again): blocks taken
    # from the cache, and context blocks that had to be computed.
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    # When the request last started holding KV blocks (set by the engine when it starts); MAX_UTILIZATION
    # pauses the most recent first.
    start_order: int = -1
    # Seconds on the engine's clock.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Beam search: beams share the prompt's blocks and fork them as they diverge (see bm.kv). While a beam
    # request runs, ``beam_tokens`` holds every beam's tokens so far and ``output_ids`` is beam 0's.
    beam_width: int = 1
    beam_tokens: list[list[int]] | None = None
    # The validated controls beyond temperature / top-k / top-p, plain values; None for a plain request,
    # which keeps its hot path untouched.
    controls: Controls | None = None
    # Runtime-owned decoding state built from ``controls`` (logits processors, beam hypotheses, requested
    # logits): opaque here, read only by the runtime that set it, so the engine core and schedulers stay
    # free of torch.
    decoding: object | None = None
    # Per generated token when return_log_probs is set (beam requests keep theirs in the runtime).
    output_log_probs: list[float] | None = None
    # Inputs beside the token ids that change the activations (prompt-tuning table, LoRA adapter), plain
    # values; None for a plain request.
    model_inputs: ModelInputValues | None = None
    # Draft tokens and their counts; None: no drafts so far.
    speculation: SpecState | None = None
    # Per generated token when top log probs were asked for: the most likely (token, log prob) pairs.
    output_top_log_probs: list[list[tuple[int, float]]] | None = None
    # n samples (num_return_sequences): the prompt is computed once, by sample 0; when its last chunk
    # runs, the engine forks ``num_pending_samples`` sibling requests whose tables share its blocks
    # (see bm.kv). ``sample_parent``: a sibling's sample 0; ``shares_blocks``: the table shares blocks
    # with siblings, so one write may copy a shared block first.
    num_return_sequences: int = 1
    num_pending_samples: int = 0
    sample_index: int = 0
    sample_parent: LlmRequest | None = None
    shares_blocks: bool = False

    @property
    def block_extra_keys(self) -> tuple[str | int, ...]:
        """What a cached block's key holds beside its tokens (blocks are shared only when equal)."""
        return self.model_inputs.block_extra_keys if self.model_inputs is not None else ()

    @property
    def computes_prompt(self) -> bool:
        """Its context logits were asked for: every prompt position is computed, none taken from the
        prefix cache (a cached position has no logits), whatever ``kv_cache.enable_block_reuse``."""
        return self.controls is not None and self.controls.return_context_logits

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far, pending ones included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_tokens_at_completion(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def is_context_phase(self) -> bool:
        return self.state == CONTEXT_INIT

    @property
    def is_generation_phase(self) -> bool:
        return self.state in GENERATION_STATES

    @property
    def num_context_tokens_remaining(self) -> int:
        """Tokens the current context phase still has to compute (all known tokens not yet in the cache)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason != NOT_FINISHED

    @property
    def holds_blocks(self) -> bool:
        """Started: some of its tokens are in the cache (a generation, or a chunked context under way)."""
        return self.num_computed_tokens > 0 or self.state in GENERATION_STATES

    def pause(self) -> None:
        """Back to the queue: its cache is gone (the caller frees it); prompt + output will be recomputed."""
        self.num_computed_tokens = 0
        self.context_chunk_size = 0
        self.state = RequestState.CONTEXT_INIT
        self.start_order = -1
        self.num_pauses += 1

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without building the concatenation."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    def last_token(self) -> int:
        """The latest token, or :data:`PENDING_TOKEN` while it is still being sampled."""
        if self.num_pending:
            return PENDING_TOKEN
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]
