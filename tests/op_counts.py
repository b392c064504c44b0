"""The torch operators a piece of code runs, counted on the CPU as stand-ins for what it would do on CUDA:
the kernels it would launch, and the device values it would read on the host (each a sync there)."""

from __future__ import annotations

import sys
from collections import Counter

import torch
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


class HostReads(TorchDispatchMode):
    """Records, into ``sites``, where code run under it reads a tensor's values on the host: the innermost
    ``bm`` function (path, name) of each call that hands values to Python (``tolist``, ``item``,
    ``numpy``, a conversion to bool, int or float, a copy to the CPU) or of each host-reading operator
    (:data:`HOST_READS`). On the CPU every tensor is a host tensor, so these are the places that would wait
    for the device on CUDA, except where the tensor really lives on the host (a CPU generator's draw)."""

    _METHODS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu")

    def __init__(self, sites: Counter) -> None:
        super().__init__()
        self.sites = sites
        self._saved: dict[str, object] = {}

    def _site(self) -> tuple[str, str]:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename.replace("\\", "/")
            if "/bm/" in path and "/tests/" not in path:
                return path[path.rindex("/bm/") + 1 :], frame.f_code.co_name
            frame = frame.f_back
        return "outside bm", ""

    def __enter__(self):
        for name in self._METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def recorded(tensor, *args, __original=original, **kwargs):
                self.sites[self._site()] += 1
                return __original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, recorded)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten.{func.overloadpacket.__name__}"
        if name in HOST_READS and name not in ("aten.item", "aten._local_scalar_dense"):  # item: above
            self.sites[self._site()] += 1
        return func(*args, **(kwargs or {}))
