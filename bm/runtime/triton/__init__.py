"""bm's Triton kernels over the paged KV cache (the Triton attention backend's, bm.runtime.backends).

Importing this package does not import triton: bm imports (and its CPU path runs) without it. The
kernels load on first use (:func:`load_kernels`); without a CUDA device they load in Triton's
interpreter, which is how the tests run them on CPU.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType


def triton_available() -> bool:
    """Whether the triton package is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


class TritonUnavailableError(RuntimeError):
    pass


def load_kernels(module: str = "kernels") -> ModuleType:
    """A kernels module of this package, ``kernels`` (attention) or ``elementwise_kernels``: compiled
    for the GPU, or in Triton's interpreter (``TRITON_INTERPRET=1``).

    ``triton.jit`` (triton's own library functions included) picks compiling or interpreting when it
    decorates, which happens as torch imports triton: the interpreter has to be asked for in the
    environment before torch is imported (the test suite's conftest does), not switched on here.
    """
    import torch
    import triton

    if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        raise TritonUnavailableError(
            "bm's Triton kernels need a CUDA device; without one they run only in Triton's interpreter, "
            "which must be set before Python starts: TRITON_INTERPRET=1"
        )
    if triton.knobs.runtime.interpret:
        _patch_interpreter_scalars()
    return importlib.import_module(f"bm.runtime.triton.{module}")


def _patch_interpreter_scalars() -> None:
    """Let a scalar loaded from memory bound a ``range`` loop in Triton 3.6's interpreter under numpy 2.

    The interpreter holds such a scalar as a one-element array, and its ``__index__`` calls ``int()`` on
    it, which numpy 2 refuses. The compiled kernel is unaffected; this keeps the interpreted kernel the
    very same code as the compiled one (instead of a ``while`` loop written for the interpreter alone).
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "bm_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.bm_patched = True
    interpreter._patch_lang_tensor = patched
