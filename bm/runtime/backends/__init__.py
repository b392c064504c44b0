"""Attention backends: the ways bm computes paged attention, behind one interface (:mod:`.base`).

- ``torch`` (:class:`~bm.runtime.backends.torch_backend.TorchBackend`): bm's C kernels on the CPU in
  float32, gather + SDPA elsewhere. Serves every model on every device.
- ``triton`` (:class:`~bm.runtime.backends.triton_backend.TritonBackend`): bm's Triton kernels, one
  launch per layer for the whole batch, decode steps replayed as CUDA graphs. On CUDA.

A runner picks its backend once (:func:`backend_class`): the first of :data:`BACKENDS` that serves the
model where it is loaded, unless ``BM_ATTENTION`` names one (the tests run the Triton kernels on the CPU
that way, in Triton's interpreter). A library backend (issue 40) is one more class in :data:`BACKENDS`,
placed where it measures better.
"""

from __future__ import annotations

import os

from bm.runtime.backends.base import (
    AttentionBackend,
    BackendSetup,
    ForwardInputs,
    InputFill,
    PerLayer,
    WindowPlan,
)
from bm.runtime.backends.torch_backend import TorchBackend
from bm.runtime.backends.triton_backend import TritonBackend
from bm.runtime.model_loader import LoadedModel

ENV_SWITCH = "BM_ATTENTION"  # a backend's name, or auto (unset): which attention a runner uses

# In order of preference; the last serves every model.
BACKENDS: tuple[type[AttentionBackend], ...] = (TritonBackend, TorchBackend)


def backend_class(loaded: LoadedModel) -> type[AttentionBackend]:
    """The backend a runner over ``loaded`` uses: the one ``BM_ATTENTION`` names, else the first that
    serves the model (Triton on CUDA with triton installed and every head size <= 256; the torch backend
    everywhere else, and always on the CPU)."""
    forced = os.environ.get(ENV_SWITCH, "auto")
    for backend in BACKENDS:
        if backend.name == forced:
            return backend
    return next(backend for backend in BACKENDS if backend.serves(loaded))


__all__ = [
    "BACKENDS",
    "ENV_SWITCH",
    "AttentionBackend",
    "BackendSetup",
    "ForwardInputs",
    "InputFill",
    "PerLayer",
    "TorchBackend",
    "TritonBackend",
    "WindowPlan",
    "backend_class",
]
