"""Compiling bm's Triton kernels for an H100 without one, for the tests of each kernel file.

Triton's front end, its MLIR passes, LLVM and the ptxas that ships in the triton wheel need no GPU, so a
kernel that runs compiled only on a GPU (CI has none) is at least compiled here: the interpreter the
other tests use forgives what the compiler refuses (a value's type changing across a branch, a scalar
where a block is due). It runs in a process of its own, without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hang import HANG_S

KERNELS = Path(__file__).resolve().parents[1] / "bm" / "runtime" / "triton"

# loads the kernel file alone (bm's imports are slow) as ``kernels``, after the row format and the dot
# the kernel files import (each registered under its own name, so their imports find them without
# importing bm), and defines ``build``
_PREAMBLE = """
import importlib.util
import sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

load("bm.runtime.triton.kv_rows", Path(sys.argv[1]).with_name("kv_rows.py"))
load("bm.runtime.triton.dots", Path(sys.argv[1]).with_name("dots.py"))
kernels = load("kernels", sys.argv[1])

def build(fn, args, consts):
    sig = {**args, **dict.fromkeys(consts, "constexpr")}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], fn.__name__
    print(fn.__name__)
"""


def compile_for_h100(kernel_file: str, builds: str, cache_dir: Path) -> list[str]:
    """Run ``builds`` (calls of ``build(kernels.<fn>, {arg: type}, {CONSTEXPR: value})``) over
    ``bm/runtime/triton/<kernel_file>``, each compiled to an sm_90 cubin; returns the names of the kernels
    compiled, in order, and fails with the compiler's words."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    script = _PREAMBLE + builds
    done = subprocess.run(
        [sys.executable, "-c", script, str(KERNELS / kernel_file)],
        env=env, capture_output=True, text=True, timeout=HANG_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()
