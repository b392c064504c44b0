"""Per-iteration statistics, as the seed's JSON string plus a few fields of bm's own.

Field names are the seed's exactly ("Iteration Counter", "Used KV cache blocks", ...), so existing tooling
that parses TensorRT-LLM stats reads bm's; extra fields use the same spelling style.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bm.engine.execution.peft_cache import PeftCacheCounts

if TYPE_CHECKING:
    from bm.engine.execution.protocol import ExecutionResult
    from bm.kv import KVCacheManager
    from bm.scheduling import SchedulerOutput


def hit_rate(reused: int, missed: int) -> float:
    """Reused over looked-up context blocks (0 when nothing was looked up)."""
    looked_up = reused + missed
    return reused / looked_up if looked_up else 0.0


@dataclass
class IterationStats:
    iteration: int
    active_requests: int
    max_requests: int
    max_blocks: int
    free_blocks: int
    used_blocks: int
    tokens_per_block: int
    context_requests: int
    generation_requests: int
    context_tokens: int
    generation_tokens: int
    empty_generation_slots: int
    padding_tokens: int
    computed_tokens: int
    num_forwards: int
    paused_requests: int
    queued_requests: int
    finished_requests: int
    elapsed_s: float
    latency_ms: float
    micro_batch_id: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    cached_blocks: int = 0
    peft: PeftCacheCounts = field(default_factory=PeftCacheCounts)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_steps: int = 0  # requests that verified drafts this iteration
    # KV blocks counted once per layer they hold (full attention's unit, whatever pools the layers use):
    # in use, and released behind attention windows (what full attention would hold on top)
    used_layer_blocks: int = 0
    saved_layer_blocks: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """Reused over looked-up context blocks this iteration (0 when no lookup happened)."""
        return hit_rate(self.reused_blocks, self.missed_blocks)

    def to_json(self) -> str:
        """The stats line TensorRT-LLM's executor reports (its field names), as JSON."""
        return json.dumps(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The stats line as a dict (the simulator's rows are built from it without a JSON round trip)."""
        return {
            "Timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
            "Iteration Counter": self.iteration,
            "Active Request Count": self.active_requests,
            "Max Request Count": self.max_requests,
            "Max KV cache blocks": self.max_blocks,
            "Free KV cache blocks": self.free_blocks,
            "Used KV cache blocks": self.used_blocks,
            "Tokens per KV cache block": self.tokens_per_block,
            "Scheduled Requests": self.context_requests + self.generation_requests,
            "Context Requests": self.context_requests,
            "Generation Requests": self.generation_requests,
            "Total Context Tokens": self.context_tokens,
            "MicroBatch ID": self.micro_batch_id,
            # the seed's V1 fields, reported for every scheme so schemes compare field by field
            "Total Generation Tokens": self.generation_tokens,
            "Empty Generation Slots": self.empty_generation_slots,
            # bm's additions
            "Padded Context Tokens": self.padding_tokens,
            "Computed Tokens": self.computed_tokens,
            "Forwards": self.num_forwards,
            "Paused Requests": self.paused_requests,
            "Queued Requests": self.queued_requests,
            "Finished Requests": self.finished_requests,
            "Elapsed Time (s)": round(self.elapsed_s, 6),
            "Iteration Latency (ms)": round(self.latency_ms, 3),
            # block reuse: blocks taken from the cache by requests started this iteration, context
            # blocks those requests had to compute, and unreferenced blocks kept for reuse
            "Reused Blocks": self.reused_blocks,
            "Missed Blocks": self.missed_blocks,
            "Cache Hit Rate": round(self.cache_hit_rate, 6),
            "Reusable KV cache blocks": self.cached_blocks,
            # attention windows: blocks per layer in use, and released behind the windows
            "Used KV layer blocks": self.used_layer_blocks,
            "KV layer blocks saved by window": self.saved_layer_blocks,
            # the PEFT (LoRA) cache: adapters loaded / waiting for a slot, their bytes, requests
            # waiting for their adapter, and loads and evictions since the engine started
            "PEFT Loaded Adapters": self.peft.loaded,
            "PEFT Pending Adapters": self.peft.pending,
            "PEFT Loaded Bytes": self.peft.loaded_bytes,
            "PEFT Waiting Requests": self.peft.waiting_requests,
            "PEFT Loads": self.peft.loads,
            "PEFT Evictions": self.peft.evictions,
            # requests that verified drafts this iteration, their draft tokens, how many were accepted
            "Draft Steps": self.draft_steps,
            "Draft Tokens": self.draft_tokens,
            "Accepted Draft Tokens": self.accepted_draft_tokens,
            "Draft Acceptance Rate": round(self.accepted_draft_tokens / self.draft_tokens, 6)
            if self.draft_tokens
            else 0.0,
        }


@dataclass(frozen=True)
class CacheUsage:
    """The cache's occupancy after a step's work, before finished requests free their blocks."""

    used_blocks: int
    layer_blocks: int
    saved_layer_blocks: int

    @classmethod
    def of(cls, kv: KVCacheManager) -> CacheUsage:
        return cls(
            kv.pool.num_used_blocks, kv.num_layer_blocks_in_use(), kv.num_layer_blocks_saved_by_window()
        )


def iteration_stats(
    plan: SchedulerOutput,
    counts: Any,
    kv: KVCacheManager,
    *,
    iteration: int,
    num_active: int,
    max_requests: int,
    usage: CacheUsage,
    result: ExecutionResult,
    num_finished: int,
    elapsed_s: float,
    latency_ms: float,
    reuse: tuple[int, int],
    peft: PeftCacheCounts,
) -> IterationStats:
    """One iteration's stats from its plan and what it computed (``counts``: context, generation,
    padding, empty-slot and computed tokens; ``result``: forwards and drafts; ``usage``: the cache's
    occupancy before finished requests freed their blocks)."""
    used_blocks = usage.used_blocks
    context_ids = {r.request_id for r in plan.context_requests} | {w.request.request_id for w in plan.padding}
    num_generation = len(plan.generation_requests) + len(plan.empty_slots)
    return IterationStats(
        iteration=iteration,
        active_requests=num_active,
        max_requests=max_requests,
        max_blocks=kv.get_max_resource_count(),
        free_blocks=kv.get_max_resource_count() - used_blocks,
        used_blocks=used_blocks,
        tokens_per_block=kv.tokens_per_block,
        context_requests=len(context_ids),
        generation_requests=num_generation,
        context_tokens=counts.context,
        generation_tokens=counts.generation,
        empty_generation_slots=counts.empty_slots,
        padding_tokens=counts.padding,
        computed_tokens=counts.computed,
        num_forwards=result.num_forwards,
        paused_requests=len(plan.paused_requests),
        queued_requests=num_active - len(context_ids) - num_generation,
        finished_requests=num_finished,
        elapsed_s=elapsed_s,
        latency_ms=latency_ms,
        reused_blocks=reuse[0],
        missed_blocks=reuse[1],
        cached_blocks=kv.pool.num_cached_blocks,
        used_layer_blocks=usage.layer_blocks,
        saved_layer_blocks=usage.saved_layer_blocks,
        peft=peft,
        draft_steps=len(result.drafts),
        draft_tokens=sum(o.num_draft for o in result.drafts.values()),
        accepted_draft_tokens=sum(o.num_accepted for o in result.drafts.values()),
    )
