#!/usr/bin/env python3
"""A model's GEMM shapes: torch's default path against the two packed paths of ``bm.runtime.prepack``.

    python benchmarks/small_gemm.py --model-config CFG.json [--rows 1,2,4,8,16,32,64,128,256,512,2048]
        [--baseline main] [--cold-mb 300] [--cold-x] [--threads 1] [--shapes gate/up,down,lm_head]
        [--skip-torch]

For each distinct linear shape of the model (and its vocabulary projection) and each row count, the
best-of-N time of ``F.linear`` (MKL), of oneDNN with the weight prepacked, and of bm's compiled panel GEMM
(``native/small_gemm.c``), interleaved in the same run. Prints JSON: GFLOP/s of each path, the speed-up
of each packed path over ``F.linear``, and the panel GEMM's share of a 2048-cubed ``torch.mm``'s FLOP/s
measured in the same run (``peak_gflop_s``; ``--peak-gflop-s`` gives it instead, where a loaded machine's
``torch.mm`` falls short of the FMA peak).

``--baseline REF`` also compiles ``native/small_gemm.c`` as it is at git revision REF (e.g. ``main``) and
times it in turns with the working tree's (``bm_panel_REF``; ``bm_panel_vs_REF`` is the speed-up), so a
kernel change is judged against its predecessor in one sitting on a shared machine. ``--cold-mb``
cycles each call through enough copies of the weight to fill that many MiB, as a forward pass sees it
(every layer's weight comes from memory); without it the weight stays in cache between repeats and
the small-row figures are above what a forward gets. ``--cold-x`` writes the input again before each call
(a torch add on every thread), as the op before a GEMM does in a forward: the input is then in the
other core's cache or in L3, not in this one's L2.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import kernel_at
from roofline import best_time, measure_gemm_peak
from transformers import AutoConfig

from bm.cpu_isa import kernel_isa
from bm.runtime.native.small_gemm import SOURCE, SmallGemmKernel, small_gemm_kernel
from bm.runtime.prepack import _PACK_HINT


def baseline_kernel(ref: str, workdir: Path) -> SmallGemmKernel:
    """The panel GEMM compiled from ``native/small_gemm.c`` at git revision ``ref``, same variant."""
    return kernel_at(ref, workdir, SOURCE.name, kernel_isa("small_gemm"), SmallGemmKernel)


def cold_time(
    call: Callable[[object], object], weights: list, repeats: int, before: Callable[[], object] | None = None
) -> float:
    """Shortest single call over ``repeats`` passes through ``weights``, one call per (cold) copy; the
    copy used to warm up is never timed. ``before`` runs, untimed, ahead of each call."""
    call(weights[-1])
    best = float("inf")
    for _ in range(repeats):
        for w in weights[:-1] or weights:
            if before is not None:
                before()
            start = time.perf_counter()
            call(w)
            best = min(best, time.perf_counter() - start)
    return best


def model_shapes(config: str) -> dict[str, tuple[int, int]]:
    cfg = AutoConfig.from_pretrained(config)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q = cfg.num_attention_heads * head_dim
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
    return {"q": (q, hidden), "k/v": (kv, hidden), "qkv": (q + 2 * kv, hidden), "o": (hidden, q),
            "gate/up": (inter, hidden), "down": (hidden, inter), "lm_head": (cfg.vocab_size, hidden)}  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", required=True)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--baseline", metavar="REF", help="also time native/small_gemm.c as of git REF")
    p.add_argument("--cold-mb", type=int, default=0, help="cycle weight copies filling this many MiB")
    p.add_argument("--cold-x", action="store_true", help="write the input again before each call")
    p.add_argument("--threads", type=int, help="torch (and kernel) threads; default: torch's")
    p.add_argument("--shapes", help="comma-separated subset of q,k/v,qkv,o,gate/up,down,lm_head")
    p.add_argument("--peak-gflop-s", type=float, help="the FLOP/s peak to compare with; default: measured")
    p.add_argument("--skip-torch", action="store_true", help="time only the panel GEMM(s)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = model_shapes(args.model_config)
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    kernel = small_gemm_kernel()
    tmp = tempfile.TemporaryDirectory(prefix="bm-gemm-baseline-")
    base = baseline_kernel(args.baseline, Path(tmp.name)) if args.baseline and kernel else None
    peak = args.peak_gflop_s or measure_gemm_peak() / 1e9
    result: dict = {"torch_threads": torch.get_num_threads(), "pack_hint": _PACK_HINT, "shapes": {}}
    result |= {"native_kernel": kernel is not None, "peak_gflop_s": round(peak, 1), "cold_mb": args.cold_mb}
    result["cold_x"] = args.cold_x
    for name, (n, k) in shapes.items():
        result["shapes"][f"{name} {n}x{k}"] = time_shape(n, k, rows, kernel, base, peak, args)
    result["torch_mm_2048_gflop_s_after"] = round(measure_gemm_peak() / 1e9, 1)
    print(json.dumps(result, indent=1))


def time_path(fn: Callable, x: torch.Tensor, ws: list, args: argparse.Namespace) -> float:
    """One path's best time on ``x``: through cold weight copies, or on one weight kept in cache; with
    ``--cold-x``, ``x`` is written again (by torch, on every thread) before each call, as the op before
    a GEMM in a forward writes its input."""
    if args.cold_x:
        a, b = torch.randn_like(x), torch.randn_like(x)
        return cold_time(
            lambda w: fn(x, w), ws, max(1, args.repeats // len(ws)), lambda: torch.add(a, b, out=x)
        )
    if args.cold_mb:
        return cold_time(lambda w: fn(x, w), ws, max(1, args.repeats // len(ws)))
    return best_time(lambda: fn(x, ws[0]), args.repeats)


def shape_paths(n: int, k: int, kernel, base, args: argparse.Namespace) -> tuple[dict, dict]:
    """Each path's call ``(x, weight)`` and its list of weight copies (one unless ``--cold-mb``)."""
    weight = torch.randn(n, k) * 0.02
    copies = max(3, (args.cold_mb << 20) // (weight.numel() * 4)) if args.cold_mb else 1
    plain = [weight] + [weight.clone() for _ in range(copies - 1)]
    paths: dict[str, Callable] = {}
    weights: dict[str, list] = {}
    if not args.skip_torch:
        paths["torch"] = lambda x, w: F.linear(x, w)
        weights["torch"] = plain
        paths["onednn_packed"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x, w, None, "none", [None], ""
        )
        weights["onednn_packed"] = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT) for w in plain]
    if kernel:
        paths["bm_panel"] = lambda x, w: kernel(x, w, None, n)
        weights["bm_panel"] = [SmallGemmKernel.pack(w) for w in plain]
    if base:
        paths[f"bm_panel_{args.baseline}"] = lambda x, w: base(x, w, None, n)
        weights[f"bm_panel_{args.baseline}"] = weights["bm_panel"]
    return paths, weights


def time_shape(n: int, k: int, rows: list[int], kernel, base, peak: float, args: argparse.Namespace) -> dict:
    """Every path's GFLOP/s (and ratios) for one weight shape at each row count."""
    paths, weights = shape_paths(n, k, kernel, base, args)
    ref = f"bm_panel_{args.baseline}"
    line = {}
    for m in rows:
        x = torch.randn(m, k)
        if base and not torch.equal(
            kernel(x, weights["bm_panel"][0], None, n), base(x, weights[ref][0], None, n)
        ):
            raise SystemExit(f"{n}x{k}, {m} rows: the panel GEMM's bits differ from {args.baseline}'s")
        flop = 2 * m * n * k / 1e9
        times = dict.fromkeys(paths, float("inf"))
        for _ in range(3):  # in turns, so a burst of load on the shared machine hits every path alike
            for path, fn in paths.items():
                times[path] = min(times[path], time_path(fn, x, weights[path], args))
        line[m] = {f"{path}_gflop_s": round(flop / t, 1) for path, t in times.items()}
        if "torch" in times:
            line[m] |= {
                f"{p}_speedup": round(times["torch"] / t, 2) for p, t in times.items() if p != "torch"
            }
        if kernel:
            line[m]["bm_panel_of_peak"] = round(flop / times["bm_panel"] / peak, 3)
        if base:
            line[m][f"bm_panel_vs_{args.baseline}"] = round(times[ref] / times["bm_panel"], 3)
    return line


if __name__ == "__main__":
    main()
