"""No blocking host-to-device copy on the path that launches a step.

Under overlap scheduling the next step is launched while the previous one runs; a pageable
``torch.tensor(values, device=...)`` there waits for everything queued on the stream, the step in flight
included, and the host and device take turns again. CI has no GPU to see that wait, so this pins the
source: the modules a launch runs through build device tensors with :func:`bm.runtime.transfer.to_device`
(pinned, non-blocking on CUDA). ``decoding.py`` is left out on purpose: the rows it decodes on the host
(beams, grammars, kept generation logits) read their results there within the launch, so that step
waits anyway; its device path goes through ``sampler.py`` and ``logits.py``, listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from bm.runtime.transfer import to_device

ROOT = Path(__file__).resolve().parent.parent / "bm" / "runtime"
LAUNCH_PATH = [
    "executor.py",
    "model_runner.py",
    "sampler.py",
    "logits.py",
    "backends/triton_backend.py",
    "triton/graphs.py",
    "triton/batch.py",
    "triton/ops.py",
]


def _blocking_copies(path: Path) -> list[int]:
    """Lines calling ``torch.tensor(..., device=X)`` with X anything but the literal "cpu"."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("tensor", "as_tensor") or getattr(node.func.value, "id", None) != "torch":
            continue
        for kw in node.keywords:
            if kw.arg == "device" and not (isinstance(kw.value, ast.Constant) and kw.value.value == "cpu"):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", LAUNCH_PATH)
def test_the_launch_path_builds_device_tensors_without_a_blocking_copy(module):
    assert _blocking_copies(ROOT / module) == []


def test_the_guard_sees_a_blocking_copy(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch\nx = torch.tensor([1], device=dev)\ny = torch.tensor([1], device='cpu')\n"
    )
    assert _blocking_copies(planted) == [2]


def test_to_device_gives_the_values_in_the_dtype_asked():
    out = to_device([3, 1, 2], torch.long, torch.device("cpu"))
    assert out.dtype == torch.long and out.tolist() == [3, 1, 2]
    assert to_device([0.5], torch.float32, torch.device("cpu")).dtype == torch.float32
