"""What a step launched by the torch executor leaves in flight, and how its tokens come back.

Under overlap scheduling (bm.engine.step.overlap) :meth:`~bm.runtime.executor.TorchExecutor.launch` returns
before the device is done: the tokens sampled on the device are copied to the host right behind the
kernels that compute them, collected a step later, and meanwhile feed the next launch's pending rows
(:func:`sampled_tokens`). Kept apart from the executor, which decides what to run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from bm.engine.execution.protocol import ExecutionResult, WorkItem, WorkKind
from bm.runtime.decoding import DeviceDecode
from bm.runtime.transfer import to_device


@dataclass
class Launched:
    """A step queued by :meth:`TorchExecutor.launch`: what is known on the host already, and per forward
    the items sampled on the device with their tokens there (copied over by ``collect``)."""

    result: ExecutionResult
    # (items, their tokens and log probs on the device, the host copies under way and the event that
    # ends them)
    on_device: list[tuple[list[WorkItem], DeviceDecode, tuple[list[torch.Tensor], Any]]] = field(
        default_factory=list
    )


def take_samples(result: ExecutionResult, rows: Iterable[tuple[WorkItem, int, float | None, Any]]) -> None:
    """Each (item, token, log prob, top log probs) row into ``result``, from the device or the host path."""
    for item, token, lp, top in rows:
        result.sampled.append((item, token, lp))
        if top is not None:
            result.top_log_probs[item.request.request_id] = top


def copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """Start copying ``tensors`` (a step's tokens, its log probs) to the host right behind the kernels
    that compute them, so waiting for them later does not also wait for a step launched after (a copy
    queued then would run after it)."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors, strict=True):
        h.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def sampled_tokens(launched: Launched, device: torch.device) -> tuple[torch.Tensor, dict[int, int]]:
    """Every token ``launched`` sampled, on the device (those decoded on the host copied over), with
    each request's row; a last row holds 0 for requests that sampled nothing (a fault)."""
    parts: list[torch.Tensor] = []
    index: dict[int, int] = {}
    size = 0
    host = [
        (item, token) for item, token, _ in launched.result.sampled if item.kind is not WorkKind.EMPTY_SLOT
    ]
    if host:
        parts.append(to_device([t for _, t in host], torch.long, device))
        index.update((item.request.request_id, i) for i, (item, _) in enumerate(host))
        size = len(host)
    for items, decoded, _ in launched.on_device:
        parts.append(decoded.tokens.to(torch.long))
        index.update((item.request.request_id, size + i) for i, item in enumerate(items))
        size += len(items)
    parts.append(torch.zeros(1, dtype=torch.long, device=device))
    return torch.cat(parts), index
