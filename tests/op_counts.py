"""The torch operators a piece of code runs, counted on the CPU as stand-ins for what it would do on CUDA:
the kernels it would launch, and the device values it would read on the host (each a sync there)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# allocations and bookkeeping: no kernel on CUDA
NO_KERNEL = {"empty", "empty_like", "new_empty", "empty_strided", "detach", "detach_", "lift_fresh", "set_"}
# operators that hand a device value to the host: on CUDA each waits for every kernel queued before it
HOST_READS = {"aten.is_nonzero", "aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.item"}


class Operators(TorchDispatchMode):
    """Counts into ``counts``, as ``aten.<name>``, every torch operator run under it that would launch a
    kernel on CUDA (views, allocations and no-op conversions launch none)."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        no_op = name in ("to", "_to_copy") and out is args[0]
        if not (func.is_view or name in NO_KERNEL or no_op):
            self.counts[f"aten.{name}"] += 1
        return out
