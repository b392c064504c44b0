"""Overlap scheduling: the core schedules and launches iteration n+1 before it reads iteration n's tokens.

On a GPU the host's share of an iteration (scheduling, block tables, the step's metadata, the token
copy back) otherwise runs while the device waits. With overlap the core launches iteration n+1 with a
placeholder (:data:`~bm.engine.execution.protocol.PENDING_TOKEN`) where each generation row's input is the
token iteration n is still sampling; the executor fills it from n's output on the device, and only then does
the core collect n's tokens. What follows from that, as TensorRT-LLM's PyTorch overlap scheduler does it:

* a request that iteration n ends (its end id, a stop word) is found one iteration late: it already has a
  row in n+1, whose token is thrown away. Its length limit is known without the token, so a request that
  reaches it is not scheduled again;
* while n+1 is in flight, each request that sampled in n counts one pending token
  (:attr:`~bm.scheduling.LlmRequest.num_pending`; never in its ``output_ids``), so the scheduler, the
  cache and the batch see its true length. Collecting n settles one pending token per request and
  applies n's tokens exactly as a step without overlap does (same stop checks, same responses); those of
  n+1 stay pending.

Some steps cannot run ahead of their tokens, and the core collects them before scheduling the next one
(:func:`survey`): beam search (beams reorder on the host), draft verification (drafts are built from
the latest tokens), structured output and the controls that read the output's tokens on the host (a
grammar's mask, n-gram and multi-token bad words, a logits post-processor: each needs the token), an
n-sample request finishing its prompt (its samples fork from the prompt's first token), and a plan that
pauses a request whose token is pending (its recompute needs the token). Repetition, presence and
frequency penalties overlap: they need the output's token counts only, and the runtime adds the pending
token's on the device. The V1 scheme (static batches run in lockstep) and n-gram
drafts never overlap. Outputs are the same with overlap on or off: only when tokens become known moves.

Executors that compute synchronously (the fake one, the simulator) overlap through :class:`SyncLauncher`,
which resolves placeholders from the previous iteration's result on the host: the core's overlap logic
is then exercised, and tested, without a device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bm.engine.execution.protocol import PENDING_TOKEN, ExecutionBatch, ExecutionResult, WorkKind
from bm.engine.step.apply import WorkCounts
from bm.scheduling import LlmRequest, RequestState, SchedulerOutput

OVERLAP_SETTINGS = ("auto", "on", "off")


class Launcher(Protocol):
    """How the core runs an iteration in two halves: ``launch`` starts it and returns a handle at once
    (placeholders resolved from the previous launch's tokens); ``collect`` waits for its result."""

    def launch(self, batch: ExecutionBatch) -> Any: ...

    def collect(self, handle: Any) -> ExecutionResult: ...


class SyncLauncher:
    """Launch/collect over an executor that only has ``execute``: ``launch`` runs the iteration at once.
    With ``resolve`` (overlap on), each placeholder first gets the token its request sampled in the
    previous launch; without, it is the executor's ``execute`` and nothing more."""

    def __init__(self, execute: Callable[[ExecutionBatch], ExecutionResult], *, resolve: bool) -> None:
        self._execute = execute
        self._resolve = resolve
        self._last: dict[int, int] = {}  # request id -> the token the previous launch sampled for it

    def launch(self, batch: ExecutionBatch) -> ExecutionResult:
        if not self._resolve:
            return self._execute(batch)
        last, generation = self._last, WorkKind.GENERATION
        for forward in batch.forwards:
            for item in forward:
                # only a generation row's input can be pending: a step whose next one would need a
                # pending token anywhere else (a paused request's recompute) is collected first
                if item.kind is generation and item.token_ids[0] == PENDING_TOKEN:
                    # A request whose previous row ended in a fault sampled nothing: its row here is
                    # thrown away when that fault ends it, so any token does.
                    item.token_ids[0] = last.get(item.request.request_id, 0)
        result = self._execute(batch)
        self._last = {
            item.request.request_id: token
            for item, token, _ in result.sampled
            if item.kind is not WorkKind.EMPTY_SLOT
        }
        return result

    def collect(self, handle: ExecutionResult) -> ExecutionResult:
        return handle


def launcher_for(executor: Any, *, overlap: bool) -> Launcher:
    """The executor's own launch/collect when it overlaps and has them (it runs ahead on a device), else
    a :class:`SyncLauncher` over its ``execute``."""
    own = callable(getattr(executor, "launch", None)) and callable(getattr(executor, "collect", None))
    if overlap and own:
        return executor
    return SyncLauncher(executor.execute, resolve=overlap)


def resolve_overlap(setting: str, executor: Any, *, v1: bool, ngram: bool) -> tuple[bool, str | None]:
    """Whether the core overlaps, and a line to say when ``on`` cannot be honoured.

    ``auto`` overlaps where it pays: an executor that launches asynchronously on a GPU (one whose
    ``launch`` returns before the device is done, flagged ``overlaps_host``). Elsewhere iterations are
    synchronous, so overlapping would only add the discarded row of each ending request. ``on`` overlaps
    under any executor (the fake and simulated ones included), except where no step could."""
    if setting not in OVERLAP_SETTINGS:
        raise ValueError(f"engine.overlap_scheduler: {setting!r}; allowed: {', '.join(OVERLAP_SETTINGS)}")
    if setting == "off":
        return False, None
    blocker = "the V1 batching scheme" if v1 else "n-gram drafts (engine.speculative)" if ngram else None
    if setting == "auto":
        return blocker is None and bool(getattr(executor, "overlaps_host", False)), None
    if blocker is not None:
        return False, f"engine.overlap_scheduler: on has no effect with {blocker}; every step runs in order"
    return True, None


@dataclass
class Flight:
    """An iteration launched and not yet collected, with what its collection needs."""

    plan: SchedulerOutput
    batch: ExecutionBatch
    reuse: tuple[int, int]
    started: float
    num_active: int
    num_ready: int
    handle: Any = None
    # Under overlap, progress is counted at launch (the next plan needs it) and the lengths the cache
    # registers are those of this iteration, not of the one launched after it; what follows is read
    # once at launch (:func:`survey`), not on each of the four passes that need it.
    counts: WorkCounts | None = None
    computed: list[tuple[LlmRequest, int]] = field(default_factory=list)
    # the requests that sample one token in it, each counting it pending until it is collected
    sampling: list[LlmRequest] = field(default_factory=list)
    overlappable: bool = True


def survey(flight: Flight) -> None:
    """What the flight's collection needs of its batch, in one pass after its progress is counted:
    each request's computed length (what the cache registers blocks up to), the requests that sample
    (:attr:`Flight.sampling`), and whether the iteration after it may be scheduled before its tokens
    are read (:attr:`Flight.overlappable`: not after beams, drafts, controls that read the output, or
    the last prompt chunk of an n-sample request, whose samples fork from its first token)."""
    computed: list[tuple[LlmRequest, int]] = []
    sampling: list[LlmRequest] = []
    overlappable = True
    context, generation = WorkKind.CONTEXT, WorkKind.GENERATION
    for forward in flight.batch.forwards:
        for item in forward:
            req, kind = item.request, item.kind
            if overlappable and (
                req.beam_width > 1
                or item.num_draft
                or req.speculation is not None
                or (req.controls is not None and req.controls.reads_output)
                or (item.sample and kind is context and req.num_pending_samples)
            ):
                overlappable = False
            if (kind is context or kind is generation) and req.beam_width == 1:
                computed.append((req, req.num_computed_tokens))
                if item.sample:
                    sampling.append(req)
    flight.computed, flight.sampling, flight.overlappable = computed, sampling, overlappable


def mark_pending(sampling: Iterable[LlmRequest]) -> None:
    """One pending token for each token a launched batch samples (``sampling``: :attr:`Flight.sampling`);
    a last prompt chunk makes its request a generation."""
    generating = RequestState.GENERATION_IN_PROGRESS  # a local: read per request
    for req in sampling:
        req.num_pending += 1
        req.state = generating


def settle_pending(sampling: Iterable[LlmRequest]) -> None:
    """A collected batch's tokens are about to be applied: each of its requests has one pending token
    fewer (an iteration launched after it keeps its own)."""
    for req in sampling:
        if req.num_pending:
            req.num_pending -= 1


def short_of_length(requests: Iterable[LlmRequest]) -> list[LlmRequest]:
    """The requests but those whose pending token is their last: nothing is left to schedule for
    them, whatever the token."""
    return [
        r for r in requests if not (r.num_pending and len(r.output_ids) + r.num_pending >= r.max_new_tokens)
    ]


def pauses_pending(plan: SchedulerOutput) -> bool:
    """The plan pauses a request whose token is pending: its recompute needs the token."""
    return any(req.num_pending for req in plan.paused_requests)


def is_idle(plan: SchedulerOutput) -> bool:
    return not (plan.context_requests or plan.generation_requests or plan.paused_requests)
