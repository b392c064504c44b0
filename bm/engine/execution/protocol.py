"""The executor protocol: what the engine core hands to whatever computes tokens, and what it gets back.

The core decides everything (schedule, KV blocks, positions, which tokens to sample) and describes one
iteration as :class:`ExecutionBatch`: forwards of work items, each a run of tokens at positions with the
block table to read and write. An executor computes and returns sampled tokens; it never allocates or
frees a block. The torch ``ModelRunner`` path (:class:`bm.runtime.executor.TorchExecutor`) is one
executor, :class:`bm.engine.execution.fake_executor.FakeExecutor` (a token that is a pure function of request
and position) another, so the real loop runs in tests and what-ifs without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from bm.engine.requests.model_inputs import LoraSpec
from bm.kv.window_layout import AttentionWindowLayout
from bm.scheduling.request import PENDING_TOKEN as PENDING_TOKEN  # the batch's placeholder, re-exported
from bm.scheduling.request import LlmRequest


class WorkKind(Enum):
    CONTEXT = "context"
    PADDING = "padding"  # V1: pad tokens executed beside a shorter prompt
    GENERATION = "generation"
    EMPTY_SLOT = "empty_slot"  # V1: a finished member still computing while its batch runs on


@dataclass(slots=True)
class WorkItem:
    """Tokens ``token_ids`` at positions ``start_pos...`` of one sequence, read/written via ``block_ids``.

    ``sample``: a token is sampled from the last position. ``keep_all``: the runtime also keeps every
    position's logits (context logits were asked for). The attribute names are those the runtime's
    packed forward reads, so a work item is passed to it as is.
    """

    request: LlmRequest
    kind: WorkKind
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    beam: int = 0
    keep_all: bool = False
    # A generation step or a last prompt chunk with drafts: the last ``num_draft`` of ``token_ids`` are
    # draft tokens to verify (the runtime keeps the logits of the ``num_draft + 1`` last positions);
    # ``draft_logits`` their rows of the request's draft_logits (None: deterministic drafts).
    num_draft: int = 0
    draft_logits: Any = None
    # The request's table in each windowed pool, by window (None: every layer reads ``block_ids``).
    window_block_ids: dict[int, list[int]] | None = None
    # A context item: its positions from here on (the output a paused request recomputes) run as decode
    # rows, as they first ran, and the prompt's as prefill, however the chunks fall: a row's numbers then
    # never depend on pausing or chunking (batch invariance). None: the runtime decides by shape.
    decode_from: int | None = None


@dataclass
class ExecutionBatch:
    forwards: list[list[WorkItem]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # before the first forward


@dataclass
class BeamStep:
    """One beam-search step of a request: beam ``i`` continues beam ``parents[i]``."""

    parents: list[int]
    beam_tokens: list[list[int]]  # every running beam's tokens so far, after this step
    done: bool
    ended_by_end_id: bool = False


@dataclass
class DraftOutcome:
    """A verified step: ``tokens`` are the accepted drafts then the one token the model adds."""

    tokens: list[int]
    num_draft: int
    num_accepted: int


@dataclass
class ExecutionResult:
    # (item, token, log prob or None) for every sampled item that is not part of a beam request
    sampled: list[tuple[WorkItem, int, float | None]] = field(default_factory=list)
    beams: dict[int, BeamStep] = field(default_factory=dict)  # request id -> its step
    faults: dict[int, str] = field(default_factory=dict)  # request id -> why it must end with an error
    drafts: dict[int, DraftOutcome] = field(default_factory=dict)  # request id -> its verified step
    num_forwards: int = 0
    # request id -> the most likely (token, log prob) pairs at its sampled position, for requests that
    # asked for top log probs
    top_log_probs: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelLimits:
    """What the core needs to know of the model to size the cache and validate requests."""

    vocab_size: int
    max_position_embeddings: int | None = None
    sliding_window: int | None = None
    sliding_window_on_every_layer: bool = False
    # the model's own window per layer index (None: full attention); empty when not known
    layer_windows: tuple[int | None, ...] = ()
    hidden_size: int | None = None  # the embedding width, when the executor knows it
    weight_bytes: int = 4  # bytes of one LoRA weight value once loaded (the model's dtype)
    # where the forwards run: "cpu", or "cuda" for a GPU (real or simulated); the engine's per-device
    # defaults (bm.config.resolve_engine) are picked by it
    device_type: str = "cpu"


@dataclass(frozen=True)
class CacheLayout:
    """The KV cache the core manages, for the executor to allocate tensors for."""

    num_blocks: int
    tokens_per_block: int
    max_seq_len: int
    max_attention_window: int | None = None
    sink_token_length: int = 0
    # every layer's window, where they differ (max_attention_window is then the main table's, if any)
    window_layout: AttentionWindowLayout | None = None
    # windows whose layers keep a pool of their own -> its blocks (work items then carry their tables)
    window_pools: dict[int, int] = field(default_factory=dict)
    # kv_cache.dtype: how the executor stores keys and values (auto: the model's KV dtype; int8)
    dtype: str = "auto"


@dataclass(frozen=True)
class WarmupShapes:
    """The budgets a run's iterations stay within, for an executor to run its shape classes once at
    build (compiles, CUDA graph captures) instead of in the first measured steps."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int  # the longest sequence the cache holds
    # blocks to map before the first request, where the pool's size was set for this run (by the user or
    # for a benchmark's dataset): on a CPU their pages would otherwise fault in during the run. 0 leaves
    # a pool sized from free memory alone (most of RAM on a CPU) to be mapped as a run uses it.
    touch_blocks: int = 0


@dataclass
class FinalOutputs:
    """What a finished request's final response carries beyond its tokens (beams, logits)."""

    beams: list[list[int]] | None = None
    beam_log_probs: list[list[float]] | None = None
    # per beam, per token: the token's rank in the distribution it was chosen from (1: the most likely)
    beam_log_prob_ranks: list[list[int]] | None = None
    cum_log_probs: list[float] | None = None
    context_logits: Any = None
    generation_logits: Any = None


class Executor(Protocol):
    """Computes what the core schedules. Implementations: TorchExecutor, FakeExecutor.

    Three optional methods, looked up with ``getattr``: ``warm_up(shapes)``, called once right after
    :meth:`bind` with the run's :class:`WarmupShapes` (returns a JSON-able report, or None when it ran
    nothing); ``hand_over_threads()``, called on the thread that built the engine right before a worker
    thread takes over its steps; and ``close()``, when the engine is done with the executor."""

    @property
    def limits(self) -> ModelLimits: ...

    def num_kv_blocks(self, kv_config: Any, max_useful_tokens: int) -> int:
        """How many blocks of ``kv_config.tokens_per_block`` tokens the cache gets."""
        ...

    def bind(self, layout: CacheLayout) -> None:
        """Allocate the cache for ``layout``; called once, before the first :meth:`execute`."""
        ...

    def admit(self, request: LlmRequest) -> None:
        """Build the runtime's per-request state from ``request.controls`` (may raise RequestError)."""
        ...

    def load_adapter(self, slot: int, adapter: LoraSpec) -> None:
        """Write a LoRA adapter into cache slot ``slot`` (replacing whatever was there); requests of
        ``adapter.task_id`` then run with it. Called by the core's PEFT cache, which picks the slot."""
        ...

    def execute(self, batch: ExecutionBatch) -> ExecutionResult: ...

    def final_outputs(self, request: LlmRequest) -> FinalOutputs: ...

    def release(self, request: LlmRequest) -> None:
        """Forget the request's runtime state (its id may be reused afterwards)."""
        ...


def warm_up(executor: Any, shapes: WarmupShapes) -> dict[str, Any] | None:
    """The executor's warm-up report for ``shapes``, None when it has none or ran nothing."""
    run = getattr(executor, "warm_up", None)
    return run(shapes) if run is not None else None


def hand_over_threads(executor: Any) -> None:
    """Tell ``executor`` that a worker thread takes over its steps from the calling thread (for the
    torch executor: the caller's OpenMP team is given back, which halved small forwards' time on a
    worker thread of a 2-core machine)."""
    hand_over = getattr(executor, "hand_over_threads", None)
    if hand_over is not None:
        hand_over()
