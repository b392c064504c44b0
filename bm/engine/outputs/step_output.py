"""What one engine step hands back: its responses, its stats line and what it scheduled, by id.

Kept apart from the loop (:mod:`bm.engine.step.core`) because every driver reads it (the engine loop, the
simulator, the tensor-parallel leader) while only the core writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bm.engine.outputs.stats import IterationStats
from bm.engine.requests.request import Response
from bm.scheduling import SchedulerOutput


@dataclass
class ScheduleRecord:
    """Which requests an iteration scheduled, by id (what conformance tests and stats compare)."""

    context_ids: list[int] = field(default_factory=list)
    context_chunks: dict[int, int] = field(default_factory=dict)
    generation_ids: list[int] = field(default_factory=list)
    paused_ids: list[int] = field(default_factory=list)
    padding_ids: list[int] = field(default_factory=list)
    empty_slot_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, plan: SchedulerOutput) -> ScheduleRecord:
        return cls(
            context_ids=[r.request_id for r in plan.context_requests],
            context_chunks=dict(plan.context_chunk_sizes),
            generation_ids=[r.request_id for r in plan.generation_requests],
            paused_ids=[r.request_id for r in plan.paused_requests],
            padding_ids=[w.request.request_id for w in plan.padding],
            empty_slot_ids=[s.request.request_id for s in plan.empty_slots],
        )


@dataclass
class StepOutput:
    responses: list[Response] = field(default_factory=list)
    stats: IterationStats | None = None
    schedule: ScheduleRecord = field(default_factory=ScheduleRecord)
    finished_ids: list[int] = field(default_factory=list)
    computed_tokens: int = 0
    # the requests a token was applied to, one entry per token (a discarded row of an ended request is not)
    produced_ids: list[int] = field(default_factory=list)
