"""Verifying draft tokens against the model's logits at every draft position, from one forward.

Greedy requests accept drafts while each equals the argmax at its position, then add the argmax after
the last accepted one: output identical to decoding one token at a time. Sampled requests use rejection
sampling (Leviathan et al., Chen et al.): draft ``d`` at a position is accepted with probability
``min(1, p(d) / q(d))``, where ``p`` is the model's sampling distribution there (temperature, top-k,
top-p applied) and ``q`` the draft's (softmax of ``draft_logits``, or all mass on ``d`` for drafts without
logits: prompt lookup, or ids alone); on rejection the token is drawn from ``max(0, p - q)`` renormalized,
and after all accepted from ``p`` at the next position. Each output token then follows ``p`` exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from bm.engine.execution.protocol import DraftOutcome
from bm.runtime.sampler import Sampler
from bm.scheduling.request import LlmRequest


def verify_drafts(
    logits: torch.Tensor,
    drafts: list[int],
    request: LlmRequest,
    sampler: Sampler,
    draft_logits: Any,
    targets: list[int] | None = None,
) -> DraftOutcome:
    """``logits [k + 1, vocab]``: row i follows the fed token then drafts ``[:i]``. ``targets``: the
    rows' argmax when the caller computed it already (for a whole batch in one copy to the host)."""
    k = len(drafts)
    params = request.sampling
    if params.is_greedy:
        if targets is None:
            targets = logits.argmax(dim=-1).tolist()
        n = 0
        while n < k and drafts[n] == targets[n]:
            n += 1
        return DraftOutcome([*drafts[:n], targets[n]], k, n)
    p = sampler.probabilities(logits, params).cpu()  # read entry by entry below: on the host once
    q = _draft_probabilities(draft_logits, drafts, p)
    rid, seed = request.request_id, params.random_seed
    for i, d in enumerate(drafts):
        ratio = float(p[i, d] / q[i, d]) if q[i, d] > 0 else float("inf")
        if sampler.uniform(rid, seed) < ratio:
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:
            residual = p[i]
        return DraftOutcome([*drafts[:i], _draw(residual, sampler.uniform(rid, seed))], k, i)
    return DraftOutcome([*drafts, _draw(p[k], sampler.uniform(rid, seed))], k, k)


def _draft_probabilities(draft_logits: Any, drafts: list[int], p: torch.Tensor) -> torch.Tensor:
    k, vocab = len(drafts), p.shape[1]
    if draft_logits is None:
        q = torch.zeros(k, vocab, dtype=p.dtype, device=p.device)
        q[torch.arange(k), torch.tensor(drafts)] = 1.0
        return q
    rows = torch.stack([torch.as_tensor(draft_logits[i], dtype=torch.float32) for i in range(k)])
    return torch.softmax(rows.to(p.device), dim=-1)


def _draw(probs: torch.Tensor, u: float) -> int:
    cdf = probs.cumsum(dim=0)
    target = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    return int(torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[0] - 1))
