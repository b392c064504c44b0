#!/usr/bin/env python3
"""bm's batch-invariant bf16 GEMM (``native/bf16_gemm.c``) against oneDNN's prepacked bf16 GEMM, per call.

    python benchmarks/bf16_gemm.py [--model-config CFG.json ...] [--rows 1,8,64,256,2048]
        [--repeats 15] [--cold-mb 96] [--threads N] [--baseline REF]

The two paths ``model.cpu_bf16_gemm`` chooses between (bm.runtime.prepack): ``onednn`` (the weight
reordered once by ``torch.ops.mkldnn._reorder_linear_weight``, called through ``_linear_pointwise``, as
bm's bf16 linears run by default) and ``invariant`` (bm's panel kernel, one fixed k-order per output: its
AMX build on AMX CPUs, its AVX512_BF16 build elsewhere; ``invariant_build`` says which).
For each distinct linear shape of each model (default: SmolLM2-135M's and the reference model's,
``configs/models/``) and each row count, one call of each path in turn, ``--repeats`` rounds, each call
on the next of enough weight copies to fill ``--cold-mb`` MiB (a forward reads every layer's weight from
memory, not from cache). Prints JSON: the median and best microseconds of each and
``invariant_over_onednn``, the ratio of medians (above 1: the invariant kernel is slower).
``--baseline REF`` also compiles ``native/bf16_gemm.c`` as it is at git revision REF and times it in the
same turns (``invariant_REF``; ``invariant_vs_REF`` is its median over the working tree's, above 1: the
working tree is faster), so a kernel change is judged against its predecessor in one sitting.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import kernel_at
from small_gemm import model_shapes

from bm.cpu_isa import cpu_features
from bm.runtime.native.bf16_gemm import Bf16GemmKernel, bf16_gemm_kernel
from bm.runtime.prepack import _PACK_HINT

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"
DEFAULT_MODELS = [CONFIGS / "smollm2-135m-shape.json", CONFIGS / "bench-llama-15m.json"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", action="append", help="model config JSON (repeatable)")
    p.add_argument("--rows", default="1,8,64,256,2048", help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=15, help="rounds of one call of each path")
    p.add_argument("--cold-mb", type=float, default=96.0, help="MiB of weight copies to cycle through")
    p.add_argument("--threads", type=int, help="torch (and kernel) threads; default: torch's")
    p.add_argument("--baseline", metavar="REF", help="also time bf16_gemm.c as at git revision REF")
    return p.parse_args()


def baseline_kernel(ref: str, workdir: Path) -> Bf16GemmKernel:
    """The bf16 GEMM compiled from ``native/bf16_gemm.c`` at git revision ``ref``."""
    return kernel_at(ref, workdir, "bf16_gemm.c", bf16_gemm_kernel().isa, Bf16GemmKernel)


def time_pair(
    calls: dict[str, object], x: torch.Tensor, weights: dict[str, list], repeats: int
) -> dict[str, list[float]]:
    """Seconds of each call, the paths in turns (the order rotated each round: the call after another
    one measured up to 10% apart from the same call first), each call on the next (cold) weight copy."""
    for name, fn in calls.items():
        fn(x, weights[name][-1])
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    copies = len(next(iter(weights.values())))
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            w = weights[name][r % copies]
            start = time.perf_counter()
            calls[name](x, w)
            times[name].append(time.perf_counter() - start)
    return times


def time_shape(
    n: int,
    k: int,
    rows: list[int],
    kernel: Bf16GemmKernel,
    args: argparse.Namespace,
    base: Bf16GemmKernel | None = None,
) -> dict:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=g).bfloat16()
    copies = max(2, int(args.cold_mb * 2**20 / weight.nbytes))
    packs = {
        "onednn": lambda: torch.ops.mkldnn._reorder_linear_weight(weight.clone(), _PACK_HINT),
        "invariant": lambda: Bf16GemmKernel.pack(weight),
    }
    calls = {
        "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], ""),
        "invariant": lambda x, w: kernel(x, w, None, n),
    }
    if base is not None:  # its own copies of the same packing (not the ones the tree's call just read)
        packs[f"invariant_{args.baseline}"] = packs["invariant"]
        calls[f"invariant_{args.baseline}"] = lambda x, w: base(x, w, None, n)
    # the copies allocated in turns, so that no path's weights sit apart in memory from the others'
    weights: dict[str, list] = {name: [] for name in packs}
    for _ in range(copies):
        for name, pack in packs.items():
            weights[name].append(pack())
    out = {}
    for m in rows:
        x = torch.randn(m, k, generator=g).bfloat16()
        times = time_pair(calls, x, weights, max(args.repeats, copies))
        med = {name: statistics.median(t) for name, t in times.items()}
        out[m] = {
            **{f"{name}_us": round(v * 1e6, 1) for name, v in med.items()},
            **{f"{name}_best_us": round(min(t) * 1e6, 1) for name, t in times.items()},
            "invariant_over_onednn": round(med["invariant"] / med["onednn"], 3),
        }
        if base is not None:
            out[m][f"invariant_vs_{args.baseline}"] = round(
                med[f"invariant_{args.baseline}"] / med["invariant"], 3
            )
    return out


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = bf16_gemm_kernel()
    if kernel is None:
        raise SystemExit("bm's bf16 GEMM is not available here (it needs AVX512_BF16 and a C compiler)")
    rows = [int(r) for r in args.rows.split(",")]
    workdir = tempfile.TemporaryDirectory(prefix="bm-bf16-gemm-base-")
    base = baseline_kernel(args.baseline, Path(workdir.name)) if args.baseline else None
    features = cpu_features()
    result: dict = {
        "machine": platform.processor() or platform.machine(),
        "amx": "amx_bf16" in features,
        "avx512_bf16": "avx512_bf16" in features,
        "invariant_build": kernel.isa,  # amx_bf16 (AMX tiles) or avx512_bf16 (vdpbf16ps)
        "torch_threads": torch.get_num_threads(),
        "baseline": args.baseline,
        "models": {},
    }
    with torch.inference_mode():
        for config in args.model_config or DEFAULT_MODELS:
            shapes = {}
            for name, (n, k) in model_shapes(str(config)).items():
                if name == "qkv":  # bm's CPU forward runs q, k and v apart
                    continue
                shapes[f"{name} {n}x{k}"] = time_shape(n, k, rows, kernel, args, base)
            result["models"][Path(config).stem] = shapes
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
