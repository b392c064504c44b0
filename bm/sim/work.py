"""What a forward's cost depends on, counted from its work items: shared by the cost model, which prices
it, and the forward fit, which measures it (so neither imports the other's hardware side)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bm.engine.execution.protocol import WorkItem, WorkKind


@dataclass(frozen=True)
class WorkTotals:
    """What a forward's cost depends on: tokens computed, logit rows, (query, key) pairs attended, KV
    history read, and whether it carries prompt tokens (``eager``: anything but one sampled token per
    item, which no decode CUDA graph serves; see bm.runtime.triton.graphs)."""

    tokens: int
    rows: int
    pairs: int
    history: int
    eager: bool


def work_totals(items: Sequence[WorkItem]) -> WorkTotals:
    """The totals of one forward's work items (the cost model and the forward fit count alike)."""
    tokens = rows = pairs = history = 0
    eager = False
    for item in items:
        n = len(item.token_ids)
        p = item.start_pos
        tokens += n
        if item.keep_all:
            rows += n
        elif item.sample and item.kind is not WorkKind.PADDING:
            rows += 1
        # query i (0-based) of the item attends to p + i + 1 keys
        pairs += n * p + n * (n + 1) // 2
        history += p + n
        eager = eager or n != 1 or not item.sample or item.keep_all or item.num_draft > 0
    return WorkTotals(tokens, rows, pairs, history, eager)
