"""Draft tokens: which ones a generation step verifies, and what a request counts of them (no torch).

A step of a request with drafts feeds its last token followed by ``k`` draft tokens; the runtime reads the
``k + 1`` positions' logits in the same forward, accepts the longest valid prefix of the drafts and adds
the next token (greedy: exact match; sampling: rejection sampling, so the output distribution is the
model's). The core then rolls back the KV entries written for rejected drafts.

Drafts come from the request (``draft_input_ids``, a guess of its continuation: used as long as the
output follows it) or from prompt lookup (``engine.speculative: {method: ngram}``): the tokens that
followed the latest earlier occurrence of the sequence's last n-gram.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bm.kv import KVCacheManager, ResourcePlan
from bm.scheduling import SchedulerOutput
from bm.scheduling.request import LlmRequest, SpecState

__all__ = ["NgramConfig", "SpecState", "can_speculate", "ngram_drafts", "propose_drafts", "request_drafts"]

DraftRows = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class NgramConfig:
    num_draft_tokens: int
    max_ngram: int


def ngram_drafts(tokens: Sequence[int], max_ngram: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the last n tokens (n from ``max_ngram``
    down to 1; the longest match wins). Among occurrences, the latest with ``k`` tokens after it, else
    the latest (one near the end has few tokens after it: a short draft)."""
    total = len(tokens)
    for n in range(min(max_ngram, total - 1), 0, -1):
        suffix = list(tokens[total - n :])
        first = suffix[0]
        partial: list[int] = []
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == first and list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if len(follow) == k:
                    return follow
                partial = partial or follow
        if partial:
            return partial
    return []


def request_drafts(req: LlmRequest, ngram: NgramConfig | None, k: int) -> tuple[list[int], DraftRows | None]:
    """At most ``k`` drafts for the request's next step, and their draft logits rows (or None)."""
    spec: SpecState | None = req.speculation
    if spec is not None and spec.drafts:
        done = len(req.output_ids)
        if done < len(spec.drafts) and tuple(req.output_ids) == spec.drafts[:done]:
            drafts = list(spec.drafts[done : done + k])
            logits = spec.draft_logits[done : done + len(drafts)] if spec.draft_logits is not None else None
            return drafts, logits
    if ngram is None:
        return [], None
    tokens = [*req.prompt_ids, *req.output_ids]
    return ngram_drafts(tokens, ngram.max_ngram, min(k, ngram.num_draft_tokens)), None


def can_speculate(req: LlmRequest) -> bool:
    """Drafts need a plain request: one beam and no per-token controls (their state would have to follow
    every draft position)."""
    return req.beam_width == 1 and req.controls is None


def propose_drafts(
    plan: SchedulerOutput, kv: KVCacheManager, ngram: NgramConfig | None, max_num_tokens: int
) -> dict[int, tuple[list[int], DraftRows | None]]:
    """Drafts for this step's generation requests and for the requests whose last prompt chunk runs
    now (its forward samples the first output token, so it verifies drafts too: a perfect draft costs
    the prompt's forward alone), within the token budget the plan leaves and the free KV blocks (a
    draft never pauses or delays anything: short of room, fewer drafts). Their blocks are a second
    plan the KV manager applies, after the scheduler's."""
    budget = max_num_tokens - sum(plan.context_chunk_sizes.values()) - len(plan.generation_requests)
    budget -= sum(w.num_tokens for w in plan.padding) + len(plan.empty_slots)
    free = kv.get_num_free_blocks()
    grows = ResourcePlan()
    out: dict[int, tuple[list[int], DraftRows | None]] = {}
    last_chunks = [
        req
        for req in plan.context_requests
        if req.num_computed_tokens + plan.context_chunk_sizes[req.request_id] == req.num_tokens
    ]
    for req in [*plan.generation_requests, *last_chunks]:
        if budget <= 0:
            break
        if (req.speculation is None and ngram is None) or not can_speculate(req):
            continue
        if req.num_pending_samples:  # its last chunk forks the samples from a sampled token
            continue
        room = min(budget, req.max_new_tokens - len(req.output_ids) - 1)
        if room <= 0:
            continue
        drafts, logits = request_drafts(req, ngram, room)
        while drafts and kv.num_blocks_to_allocate(req.request_id, req.num_tokens + len(drafts)) > free:
            drafts.pop()
        if not drafts:
            continue
        free -= kv.num_blocks_to_allocate(req.request_id, req.num_tokens + len(drafts))
        grows.grow.append((req.request_id, req.num_tokens + len(drafts)))
        budget -= len(drafts)
        if logits is not None:
            logits = logits[: len(drafts)]
        out[req.request_id] = (drafts, logits)
    kv.prepare_resources(grows)  # in request order, as the blocks were counted
    return out
