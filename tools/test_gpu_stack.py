"""Run the GPU path's CPU tests under the transformers release the GPU machines have (`make test-gpu-stack`).

Why: the lent GPU machines come with their own packages (transformers 5.17 there, the lock pins a later
one), and bm's rewrites of transformers' modules (fused elementwise chains, stacked projections, the
attention adapters) match its call conventions, which moved between those releases: 5.17 names the HF
cache ``past_key_values`` where later releases say ``cache``. One fault of that kind ended a device run
(the stacked attention's TypeError); two more were found only when these tests were run under 5.17 (the
fused decoder layer falling back to transformers' own code on every call, which a GPU profile had shown
without anyone seeing why; the Bloom and Falcon adapters importing a helper 5.17 lacks). Device time is
scarce; these run on the CPU in a few minutes.

How: that transformers release (and the huggingface_hub release it imports) is installed into a folder
of its own (reused on the next run) and put first on ``PYTHONPATH`` for one pytest run over the tests of
the code the GPU runs (everything else comes from the project's environment). Exits with pytest's code.

Usage: ``python tools/test_gpu_stack.py [--transformers SPEC] [--target DIR] [-- PYTEST_ARGS...]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# what the lent GPU machines have (their package list, 2026-11: torch 2.11, transformers 5.17, triton 3.6,
# and the huggingface_hub that transformers 5.17 imports, 1.33: the lock's 2.x dropped what it needs)
GPU_TRANSFORMERS = "transformers==5.17.0"
GPU_HUB = "huggingface_hub==1.33.0"
TESTS = [
    "tests/test_layer_launches.py",
    "tests/test_fusion.py",
    "tests/test_fused_projections.py",
    "tests/test_triton_elementwise.py",
    "tests/test_triton_runner.py",
    "tests/test_model_matrix.py",
    "tests/test_model_families.py",
    "tests/test_oracle.py",
    "tests/test_overlap_scheduler.py",
    "tests/test_triton_attention.py",
    "tests/test_triton_split_kv.py",
    "tests/test_bf16_oracle.py",
    "tests/test_launch_path_transfers.py",
    "tests/test_triton_weight_gemm.py",
    "tests/test_gpu_check.py",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers", default=GPU_TRANSFORMERS, help=f"(default: {GPU_TRANSFORMERS})")
    parser.add_argument("--target", type=Path, help="where to install it (default: bm-out/gpu-stack/<spec>)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    target = args.target or REPO / "bm-out" / "gpu-stack" / args.transformers.replace("=", "")
    if not (target / "transformers").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"]
        # transformers alone (numpy, tokenizers, safetensors: the project's own), then the hub with what it
        # needs (pure-Python http packages, and hf_xet)
        subprocess.run([*pip, str(target), "--no-deps", args.transformers], check=True)
        subprocess.run([*pip, str(target), "--upgrade", GPU_HUB], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(target)]))
    found = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    print(f"the GPU path's tests under transformers {found} (from {target})", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *TESTS, *args.pytest_args],
        cwd=REPO,
        env=env,
    )
    verdict = "passed" if done.returncode == 0 else f"FAILED (pytest exit {done.returncode}; see above)"
    print(f"the GPU path's tests under transformers {found}: {verdict}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
