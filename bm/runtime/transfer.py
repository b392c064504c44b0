"""Small host values to the device without making the host wait for the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory, and a blocking copy waits for
every kernel already queued on the stream. Under overlap scheduling (docs/scheduling.md) that queue
holds the step in flight, so one such copy while the next step is being launched (a sampling row's
temperature, a block copy's indices) makes the host wait for the whole step, and host and device run in
turn again. Through pinned memory the copy is queued like a kernel and the host goes on; the pinned
block is not reused before the copy has read it (torch's caching host allocator records the copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (numbers, or rows of them) as a ``dtype`` tensor on ``device``, queued behind the
    stream's work on CUDA instead of waiting for it; a plain tensor elsewhere."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host ``tensor`` on ``device``, queued as :func:`to_device` queues a list (it is itself where
    ``device`` is the CPU)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
