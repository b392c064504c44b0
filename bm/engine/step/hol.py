"""Head-of-line blocking, said once during the run, with the key that fixes it.

A request at the head of the queue that cannot start makes every request behind it wait, and the
batch drains while it does: without chunked context a prompt near ``max_num_tokens`` starts only in an
iteration with almost no generating request, so the batch empties before each such prompt (a user's
first 1,024-request Azure trace averaged 7 requests an iteration of a 128 budget that way). bm's
defaults avoid it; when a run meets it anyway (the seed's defaults, a small KV cache), the user should
hear it while the run is still going, not read it off a finished run's stats. Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from bm.config.engine import EngineConfig
from bm.kv import KVCacheManager
from bm.scheduling import LlmRequest, RequestState, SchedulerOutput

# Iterations the same head must wait, the batch below half full, before it is called blocking.
PATIENCE = 8


class HeadOfLineWatch:
    """Watches each iteration's plan; :meth:`observe` returns a message the first time the oldest
    waiting request has gone unscheduled for :data:`PATIENCE` iterations while fewer than half of
    ``max_batch_size`` requests were scheduled, and names why (token budget or KV blocks)."""

    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: int,
        chunked: bool,
        patience: int = PATIENCE,
        policy: str = "guaranteed_no_evict",
    ):
        """``policy``: engine.scheduler_policy, so a message never suggests the policy already set."""
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunked = chunked
        self.policy = policy
        self.patience = patience
        self.message: str | None = None  # what was said (once)
        self._head: int | None = None
        self._waited = 0

    @classmethod
    def for_engine(cls, engine: EngineConfig) -> HeadOfLineWatch:
        """The watch over an engine of these resolved budgets and policy."""
        return cls(
            engine.max_batch_size,
            engine.max_num_tokens,
            bool(engine.enable_chunked_context),
            policy=engine.scheduler_policy,
        )

    def observe(self, ready: Sequence[LlmRequest], plan: SchedulerOutput, kv: KVCacheManager) -> str | None:
        """``ready``: the requests the scheduler saw, oldest first. Returns the message once, else None."""
        if self.message is not None:
            return None
        if 2 * plan.num_scheduled >= self.max_batch_size:
            self._head = None
            return None
        head = next((r for r in ready if r.state == RequestState.CONTEXT_INIT and not r.holds_blocks), None)
        if head is None or any(r is head for r in plan.context_requests):
            self._head = None
            return None
        if head.request_id != self._head:
            self._head, self._waited = head.request_id, 0
        self._waited += 1
        if self._waited < self.patience:
            return None
        self.message = self._cause(head, plan, kv)
        return self.message

    def _cause(self, head: LlmRequest, plan: SchedulerOutput, kv: KVCacheManager) -> str | None:
        waited = (
            f"request {head.request_id} has waited {self._waited} iterations at the head of the queue while "
            f"the batch drained to {plan.num_scheduled} of {self.max_batch_size} requests"
        )
        used = sum(plan.context_chunk_sizes.values()) + len(plan.generation_requests)
        prompt = head.num_context_tokens_remaining
        if not self.chunked and prompt > self.max_num_tokens - used:
            return (
                f"{waited}: its {prompt}-token prompt fits the iteration's token budget "
                f"(engine.max_num_tokens {self.max_num_tokens}) only once the generating requests are "
                "done, and chunked context is off; set engine.enable_chunked_context=true (bm's default) "
                "so it starts in chunks beside them"
            )
        needed = kv.get_needed_resource_to_completion(head)
        free = kv.get_num_free_blocks()
        if needed > free:
            other_policy = (
                ""
                if self.policy == "max_utilization"
                else " (or set engine.scheduler_policy=max_utilization, which starts requests before their "
                "whole output fits)"
            )
            return (
                f"{waited}: it needs {needed} KV cache blocks to completion and {free} of "
                f"{kv.get_max_resource_count()} are free; raise kv_cache.max_tokens or "
                f"kv_cache.free_memory_fraction{other_policy}"
            )
        return None
