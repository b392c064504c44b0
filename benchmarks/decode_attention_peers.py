#!/usr/bin/env python3
"""bm's Triton paged decode attention beside xformers' Triton split-K decode (triton_splitKF), one layer.

    python benchmarks/decode_attention_peers.py [--shapes llama-1b,smollm2-135m] [--out peers.json]
    python benchmarks/decode_attention_peers.py --device cpu --small     # the logic, in Triton's interpreter

Why: bm adopts a library kernel only where it measures better than its own. For each shape (query
heads, KV heads, head size, layers) one layer's paged KV cache is filled with random values, ``--requests``
sequences of ``--min-context``..``--context`` keys each on shuffled (scattered) ``--block-size``-token
blocks, and one decode query per sequence attends to it. Kernels timed, interleaved, ``--repeat`` times:

- ``bm``: ``paged_attention`` as the Triton backend calls it in a decode step (its own split-KV choice
  for this device, a kept scratch buffer); ``bm_splits_N``: the same with the split count forced
  (``N`` = 1: the single-pass kernel). A forced count equal to the automatic one is not timed twice
  (``same_as``).
- ``xformers``: ``triton_splitk.FwOp`` (``triton_splitKF``) with its defaults: its split heuristic and
  64-key tiles. It takes a paged cache only where the page size is a multiple of its tile
  (``BLOCK_N``), so it reads its own copy of the keys and values, laid out as it wants them
  (``[1, pages x page, KV heads, 1 -> group, head]``, GQA as a stride-0 group axis) on 64-token pages,
  the smallest it accepts, with a shuffled table of its own.
- ``xformers_bm_cache``: the same op with 16-key tiles (a subclass with ``BLOCK_N`` = bm's block size),
  reading bm's own cache in place through a strided view: what adopting it in bm would run.
- ``xformers_splits_N``: the default op with the split count forced (``FwOp.get_operator(N)``).

Each xformers call goes through ``memory_efficient_attention_forward(op=...)``, or, where the op's only
objections are the C++ extension (not needed by the Triton op; a wheel built for another torch) or the
device (CPU, for the interpreter), through ``op.apply``, which is what that function runs after its
checks; ``call`` says which. xformers is imported in a probe subprocess first on CUDA (an extension built
for another torch could abort the process as it loads), and any failure, of the import or of one call,
is reported in the JSON rather than raised: bm is still timed.

On CUDA each kernel is timed both ways: ``--inner`` calls back to back between two events (``eager``,
launch overhead included where the host is slower than the kernel) and the same calls captured in a
CUDA graph and replayed (``graph``, as the engine's decode steps run; the headline ``median_ms``). Every
output is compared with a float32 torch reference (gather, mask, softmax) computed once per shape.

Prints one JSON document (progress goes to stderr): per shape and kernel the median ms per layer call,
the effective KV bandwidth (keys and values read / time) and its fraction of the copy bandwidth measured
in the same run, the step's ms (x the shape's layers), the max abs difference from the reference, and
the ratio to bm's automatic choice (``over_bm``: above 1, bm is faster). ``--out`` writes it to a file as
well, after every shape, so a run cut short keeps what it measured. Optional variants (forced splits,
xformers' explicit splits) start only while the run is within ``--budget-s`` (the Triton compiles, not
the timing, dominate the run).

On CPU (``--device cpu``, Triton's interpreter; the script sets TRITON_INTERPRET=1 itself when run with
``--device cpu``) the dtype defaults to float16: Triton 3.6's interpreter computes bf16 ``tl.dot`` wrong
(bm's kernels widen to float32 there; xformers' do not), so bf16 would report interpreter errors, not
xformers'. Times on CPU are the interpreter's, meaningless; the run proves the logic.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if "--device=cpu" in sys.argv or ("--device", "cpu") in itertools.pairwise(sys.argv):
    # triton.jit picks compiling or interpreting as torch imports triton: the choice is made here
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("XFORMERS_ENABLE_TRITON", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also when imported

from common import copy_bandwidth

from bm.runtime.triton import load_kernels
from bm.runtime.triton.batch import BatchBuilder, PagedBatch, cdiv
from bm.runtime.triton.ops import SplitScratch, decode_split, device_sm_count, paged_attention


@dataclass(frozen=True)
class Shape:
    """One model's attention: query heads, KV heads, head size, and layers (a decode step's calls)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    layers: int


SHAPES = {"llama-1b": Shape(32, 8, 64, 16), "smollm2-135m": Shape(9, 3, 64, 30)}
# --small: a group of 3 (as SmolLM2's), so xformers' head-swap and bm's padded group both run
SMALL_SHAPES = {"tiny-gqa3": Shape(6, 2, 64, 2)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Objections of xformers' FwOp that do not stop its Triton kernel from running: the C++ extension (the
# Triton op never calls it) and the device (the CPU run interprets the kernel); bf16 on CPU is refused for
# the same reason.
TOLERATED_REASONS = ("wasn't build with CUDA", "device=", "bf16 is only supported")


def log(message: str) -> None:
    print(f"[decode_attention_peers] {message}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def number(x: float | None, digits: int = 4) -> float | str | None:
    """A JSON-safe rounded number: NaN and infinities become strings (json.dumps would write bare NaN)."""
    if x is None:
        return None
    if not math.isfinite(x):
        return str(x)
    return round(x, digits)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:600]}"


# ----------------------------------------------------------------------------------------------- inputs


@dataclass
class Layer:
    """One layer's inputs in bm's layout, the logical keys/values and the float32 reference output."""

    cache: torch.Tensor  # [2, kv_heads, blocks, block, head_dim]
    batch: PagedBatch
    q_tokens: torch.Tensor  # [B, q_heads, head_dim], contiguous
    lens: list[int]
    logical: torch.Tensor  # [2, B, W x block, kv_heads, head_dim]: each sequence's keys, padded
    reference: torch.Tensor  # [B, q_heads, head_dim] float32
    kv_bytes: int  # keys and values a call must read


def build_layer(
    shape: Shape, lens: list[int], block: int, dtype: torch.dtype, device: torch.device, seed: int
) -> Layer:
    """bm's cache on shuffled blocks and its batch (built by the engine's BatchBuilder), one query per
    sequence, and the reference computed from the keys gathered back through the tables."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    g, d = shape.kv_heads, shape.head_dim
    blocks = [cdiv(n, block) for n in lens]
    num_blocks = sum(blocks) + 8
    cache = torch.randn(2, g, num_blocks, block, d, generator=gen, device=device, dtype=torch.float32).to(
        dtype
    )
    order = torch.randperm(num_blocks, generator=cpu_gen).tolist()
    tables, used = [], 0
    for k in blocks:
        tables.append(order[used : used + k])
        used += k
    batch = BatchBuilder(device, block).build([[0]] * len(lens), [n - 1 for n in lens], tables, keep=[]).batch
    q_tokens = torch.randn(len(lens), shape.q_heads, d, generator=gen, device=device, dtype=torch.float32).to(
        dtype
    )
    table = batch.block_table.long()  # [B, W]; padding entries name block 0, never read below a length
    logical = cache[:, :, table].permute(0, 2, 3, 4, 1, 5).reshape(2, len(lens), -1, g, d)
    reference = attention_reference(q_tokens, logical, lens, d**-0.5)
    kv_bytes = sum(lens) * 2 * g * d * cache.element_size()
    return Layer(cache, batch, q_tokens, lens, logical, reference, kv_bytes)


def attention_reference(
    q_tokens: torch.Tensor, logical: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    """Dense float32 attention of each query to its sequence's first ``lens[b]`` keys (GQA: query head h
    reads KV head h // group, as bm and xformers' BMGHK layout both group them)."""
    b, hq, d = q_tokens.shape
    g = logical.shape[3]
    q = q_tokens.float().view(b, g, hq // g, d)
    keys, values = logical[0].float(), logical[1].float()
    scores = torch.einsum("bghd,blgd->bghl", q, keys) * scale
    positions = torch.arange(keys.shape[1], device=keys.device)
    beyond = positions[None, :] >= torch.tensor(lens, device=keys.device)[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    return torch.einsum("bghl,blgd->bghd", scores.softmax(-1), values).reshape(b, hq, d)


# ---------------------------------------------------------------------------------------------- kernels


@dataclass
class Variant:
    """One kernel configuration: ``run`` computes one layer call and returns ``[B, q_heads, head]``."""

    name: str
    run: Callable[[], torch.Tensor]
    info: dict[str, Any]
    priority: int  # 0: always run; higher: started later, and only within the time budget
    samplers: dict[str, Callable[[], float]] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)


def bm_variants(
    layer: Layer,
    shape: Shape,
    device: torch.device,
    splits: list[int],
    launches: list[tuple[int, int]] = (),
) -> list[Variant]:
    """bm's automatic choice, then each forced split count that differs from it, then the automatic
    choice under each (num_warps, num_stages) of ``launches`` (Triton's defaults are what the engine
    runs; a sweep says whether another launch reads the keys faster)."""
    q = layer.q_tokens.transpose(0, 1)  # [heads, T, d], a strided view, as the attention layer hands it over
    scale = shape.head_dim**-0.5
    sm = device_sm_count(device)
    auto = decode_split(layer.batch, shape.kv_heads, shape.head_dim, sm)

    def call(num_splits: int | None, launch: dict[str, int] | None = None) -> Callable[[], torch.Tensor]:
        scratch = SplitScratch(device)  # kept across calls, as the backend keeps one for its graphs

        def run() -> torch.Tensor:
            out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])
            paged_attention(
                out, q, layer.cache, layer.batch, scale, num_splits=num_splits, sm_count=sm, scratch=scratch,
                launch=launch,
            )  # fmt: skip
            return out

        return run

    kind = "single-pass kernel" if auto.num_splits == 1 else "split-KV kernel + combine"
    out = [Variant("bm", call(None), {"num_splits": auto.num_splits, "block_n": auto.block_n, "kernel": kind,
                                      "choice": f"automatic, for {sm} SMs"}, priority=0)]  # fmt: skip
    for n in splits:
        name = f"bm_splits_{n}"
        if n == auto.num_splits:
            out.append(Variant(name, call(n), {"same_as": "bm"}, priority=2))
        else:
            kind = "single-pass kernel" if n == 1 else "split-KV kernel + combine"
            out.append(
                Variant(name, call(n), {"num_splits": n, "kernel": kind, "choice": "forced"}, priority=2)
            )
    for warps, stages in launches:
        info = {
            "num_splits": auto.num_splits,
            "num_warps": warps,
            "num_stages": stages,
            "choice": "launch sweep",
        }
        out.append(Variant(f"bm_w{warps}_s{stages}", call(None, {"num_warps": warps, "num_stages": stages}),
                           info, priority=1))  # fmt: skip
    return out


def import_xformers(device: torch.device, probe: subprocess.Popen | None) -> tuple[Any, dict[str, Any]]:
    """xformers' modules, or None and the reason. ``probe``: a subprocess that imported it first (on CUDA,
    where a C++ extension built for another torch could abort the process that loads it)."""
    if probe is not None:
        try:
            _, err = probe.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            probe.kill()
            return None, {"error": "importing xformers took over 180 s in a probe process"}
        if probe.returncode != 0:
            tail = (err or "").strip().splitlines()[-1:] or [""]
            return None, {
                "error": f"importing xformers failed in a probe process (exit {probe.returncode}): {tail[0]}"
            }
    if device.type == "cpu":
        os.environ.setdefault("XFORMERS_ENABLE_TRITON", "1")  # xformers' Triton ops off CUDA: the interpreter
    try:
        import xformers
        from xformers.ops import fmha
        from xformers.ops.fmha import attn_bias, triton_splitk
    except Exception as exc:  # not installed, or a broken install: reported, bm still timed
        return None, {"error": error_text(exc)}
    xf = SimpleNamespace(fmha=fmha, attn_bias=attn_bias, FwOp=triton_splitk.FwOp)
    info = {
        "version": getattr(xformers, "__version__", "?"),
        "cpp_extension_loaded": bool(getattr(xformers, "_has_cpp_library", False)),
        "op": triton_splitk.FwOp.NAME,
        "default_block_n": triton_splitk.FwOp.BLOCK_N,
        "page_size": triton_splitk.FwOp.BLOCK_N,
        "page_size_note": "the default op refuses a page size that is not a multiple of its BLOCK_N (64): "
        "its own cache uses 64-token pages; xformers_bm_cache runs the op with BLOCK_N = bm's block size",
    }
    return xf, info


def start_probe(device: torch.device) -> subprocess.Popen | None:
    if device.type != "cuda":
        return None
    code = "import xformers.ops.fmha.triton_splitk"
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def xformers_variants(xf: Any, layer: Layer, shape: Shape, block: int, splits: list[int]) -> list[Variant]:
    """xformers' default op on its own 64-token pages, the op with bm-sized tiles on bm's cache, and the
    default op with forced split counts. A variant whose inputs cannot be built is reported, not raised."""
    out: list[Variant] = []
    b, hq, d = layer.q_tokens.shape
    g = shape.kv_heads
    group = hq // g
    device = layer.q_tokens.device
    q = layer.q_tokens.view(1, b, g, group, d)  # BMGHK: query head h -> (h // group, h % group)
    scale = d**-0.5
    base = xf.FwOp

    def paged_bias(table: torch.Tensor, page: int) -> Any:
        mask = xf.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=[1] * b, kv_padding=table.shape[1] * page, kv_seqlen=layer.lens, device=device
        )
        return mask.make_paged(
            block_tables=table,
            page_size=page,
            paged_type=xf.attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
        )

    def variant(
        name: str, priority: int, op: Any, k: torch.Tensor, v: torch.Tensor, bias: Any, page: int, extra: dict
    ) -> Variant:
        inputs = xf.fmha.Inputs(query=q, key=k, value=v, attn_bias=bias, scale=scale)
        inputs.validate_inputs()  # what memory_efficient_attention_forward checks first (run here on CPU too)
        reasons = list(op.not_supported_reasons(inputs))
        blocking = [r for r in reasons if not any(t in r for t in TOLERATED_REASONS)]
        split = op.SPLIT_K
        if split is None:  # the heuristic, as apply() calls it (H = 1 after the GQA head swap)
            split = base.get_split_k(b, g, 1, bias.block_tables.shape[1] * page, 1, page, True)
        info = {"op": op.NAME, "split_k": split, "block_n": op.BLOCK_N, "page_size": page, **extra}
        if reasons:
            info["not_supported_reasons"] = reasons
        if blocking:
            info["error"] = "not supported: " + "; ".join(blocking)
            return Variant(name, lambda: q, info, priority)
        if reasons:
            info["call"] = (
                "FwOp.apply (memory_efficient_attention_forward refuses only for the reasons listed)"
            )

            def run() -> torch.Tensor:
                inp = xf.fmha.Inputs(query=q, key=k, value=v, attn_bias=bias, scale=scale)
                return op.apply(inp, needs_gradient=False)[0].reshape(b, hq, d)
        else:
            info["call"] = "memory_efficient_attention_forward(op=...)"

            def run() -> torch.Tensor:
                return xf.fmha.memory_efficient_attention_forward(
                    q, k, v, attn_bias=bias, scale=scale, op=op
                ).reshape(b, hq, d)

        return Variant(name, run, info, priority)

    # its own layout: 64-token pages (its tile), a shuffled page table, the same keys and values
    page = base.BLOCK_N
    try:
        width = cdiv(max(layer.lens), page)
        gen = torch.Generator().manual_seed(1)
        table = torch.randperm(b * width, generator=gen).view(b, width).to(device=device, dtype=torch.int32)
        padded = layer.logical.new_zeros(2, b, width * page, g, d)
        padded[:, :, : layer.logical.shape[2]] = layer.logical
        pages = layer.logical.new_empty(2, b * width, page, g, d)
        pages[:, table.flatten().long()] = padded.view(2, b * width, page, g, d)
        del padded
        k, v = (pages[i].view(1, b * width * page, g, 1, d).expand(-1, -1, -1, group, -1) for i in range(2))
        bias = paged_bias(table, page)
        out.append(variant("xformers", 0, base, k, v, bias, page, {"cache": "its own, token-major"}))
        heuristic = base.get_split_k(b, g, 1, width * page, 1, page, True)
        for n in splits:
            if n == heuristic:  # the default op's own choice: not timed twice
                out.append(Variant(f"xformers_splits_{n}", lambda: q, {"same_as": "xformers"}, priority=3))
            else:
                out.append(variant(f"xformers_splits_{n}", 3, base.get_operator(n), k, v, bias, page,
                                   {"cache": "its own, token-major"}))  # fmt: skip
    except Exception as exc:
        out.append(Variant("xformers", lambda: q, {"error": error_text(exc)}, priority=0))

    # bm's cache in place: [kv, blocks, block, d] seen as [1, blocks x block, kv, group (stride 0), d]
    try:
        if block % 16:
            raise ValueError(f"block size {block}: xformers' tile (BLOCK_N) must be a multiple of 16")
        op = type(f"FwOp_N{block}", (base,), {"BLOCK_N": block, "NAME": f"{base.NAME}_n{block}"})
        n_keys = layer.cache.shape[2] * block

        def in_place(c: torch.Tensor) -> torch.Tensor:
            return c.reshape(g, n_keys, d).permute(1, 0, 2)[None, :, :, None, :].expand(-1, -1, -1, group, -1)

        bias = paged_bias(layer.batch.block_table, block)
        extra = {"cache": "bm's, read in place (strided view)"}
        out.append(
            variant(
                "xformers_bm_cache",
                1,
                op,
                in_place(layer.cache[0]),
                in_place(layer.cache[1]),
                bias,
                block,
                extra,
            )
        )
    except Exception as exc:
        out.append(Variant("xformers_bm_cache", lambda: q, {"error": error_text(exc)}, priority=1))
    return out


# ----------------------------------------------------------------------------------------------- timing


def samplers(
    fn: Callable[[], torch.Tensor], device: torch.device, inner: int, graphs: bool
) -> tuple[dict, dict]:
    """Per mode, a callable returning ms per call over ``inner`` calls; and errors (a failed capture)."""
    if device.type != "cuda":

        def wall() -> float:
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - start) * 1e3 / inner

        return {"eager": wall}, {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def eager() -> float:
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner

    out: dict[str, Callable[[], float]] = {"eager": eager}
    errors: dict[str, str] = {}
    if graphs:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(inner):
                    fn()

            def replay() -> float:
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / inner

            replay()
            out["graph"] = replay
        except Exception as exc:
            errors["graph_error"] = error_text(exc)
            try:
                torch.cuda.synchronize(device)
            except Exception as again:
                errors["after_graph_error"] = error_text(again)
    return out, errors


def warm(variant: Variant, layer: Layer, device: torch.device, inner: int, graphs: bool) -> None:
    """First call (the compile), its difference from the reference, then the timing callables."""
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            result = variant.run()
            sync(device)
            variant.info["first_call_s"] = number(time.perf_counter() - start, 2)
            diff = (result.float() - layer.reference).abs()
            variant.info["max_abs_diff"] = number(diff.max().item(), 6)
            variant.info["mean_abs_diff"] = number(diff.mean().item(), 8)
            if device.type == "cuda":
                variant.run()  # a second call: anything allocated lazily is allocated before a capture
                sync(device)
            variant.samplers, errors = samplers(variant.run, device, inner, graphs)
        variant.info.update(errors)
    except Exception as exc:
        variant.info["error"] = error_text(exc)
        log(f"  {variant.name}: {variant.info['error']}")


def cuda_copy_bandwidth(device: torch.device, small: bool) -> float | None:
    """The copy bandwidth the kernels' KV reads are measured against (benchmarks/common.py, as
    gpu_check measures it); None off CUDA, where the interpreter's times mean nothing."""
    return copy_bandwidth(device, small) if device.type == "cuda" else None


# ------------------------------------------------------------------------------------------------- main


def run_shape(
    name: str,
    shape: Shape,
    args: argparse.Namespace,
    device: torch.device,
    xf_state: dict,
    budget_until: float,
) -> dict[str, Any]:
    """Every variant of one shape: warmed (compiled), then timed interleaved; the shape's JSON entry."""
    rng = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_context, args.context + 1, (args.requests,), generator=rng).tolist()
    layer = build_layer(shape, lens, args.block_size, DTYPES[args.dtype], device, args.seed)
    entry: dict[str, Any] = {
        "q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "layers": shape.layers, "requests": len(lens), "mean_context": statistics.mean(lens),
        "kv_bytes_per_call": layer.kv_bytes,
    }  # fmt: skip
    variants = bm_variants(layer, shape, device, args.bm_splits, args.bm_launch)
    if xf_state.get("module") is None and "info" not in xf_state:
        xf_state["module"], xf_state["info"] = import_xformers(device, xf_state.pop("probe", None))
        log(f"xformers: {xf_state['info']}")
    if xf_state["module"] is not None:
        variants += xformers_variants(xf_state["module"], layer, shape, args.block_size, args.xformers_splits)
    # bm's and xformers' defaults first, always; the others only while the budget lasts
    variants.sort(key=lambda v: v.priority)
    for v in variants:
        if "error" in v.info or "same_as" in v.info:
            continue
        if v.priority and time.monotonic() > budget_until:
            v.info["skipped"] = "time budget (--budget-s) spent before it started"
            continue
        log(f"{name}: warming {v.name}")
        warm(v, layer, device, args.inner, not args.no_graphs)
    ready = [v for v in variants if v.samplers]
    log(f"{name}: timing {len(ready)} kernels x {args.repeat}")
    for r in range(args.repeat):
        turn = r % len(ready) if ready else 0
        for v in ready[turn:] + ready[:turn]:  # a rotating start: no kernel always runs first
            for mode, sample in v.samplers.items():
                try:
                    v.samples.setdefault(mode, []).append(sample())
                except Exception as exc:
                    v.info.setdefault("error", error_text(exc))
    kernels: dict[str, Any] = {}
    headline = "graph" if device.type == "cuda" and not args.no_graphs else "eager"
    for v in variants:
        figures = dict(v.info)
        mode = headline if headline in v.samples else "eager"
        if v.samples.get(mode):
            ms = statistics.median(v.samples[mode])
            figures["timing"] = mode
            figures["median_ms"] = number(ms)
            figures["step_ms"] = number(ms * shape.layers, 3)
            figures["kv_gb_per_s"] = number(layer.kv_bytes / ms / 1e6, 2)
            if args.copy_bytes_per_s:
                figures["fraction_of_copy"] = number(layer.kv_bytes / (ms * 1e-3) / args.copy_bytes_per_s, 3)
            for other, values in v.samples.items():
                figures[f"{other}_median_ms"] = number(statistics.median(values))
        kernels[v.name] = figures
    bm_ms = kernels["bm"].get("median_ms")
    ratios = {}
    for k, figures in kernels.items():
        if isinstance(bm_ms, float) and isinstance(figures.get("median_ms"), float) and bm_ms > 0:
            figures["over_bm"] = number(figures["median_ms"] / bm_ms, 3)
            if k.startswith("xformers"):
                ratios[k] = figures["over_bm"]
    entry["kernels"] = kernels
    entry["xformers_over_bm"] = ratios
    if ratios:
        best = min(ratios, key=ratios.get)
        entry["best_xformers"] = {"kernel": best, "over_bm": ratios[best]}
    del layer, variants
    return entry


def parse_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("split counts are >= 1")
    return values


def parse_launches(text: str) -> list[tuple[int, int]]:
    """``"4:2,8:3"`` -> [(4, 2), (8, 3)]: (num_warps, num_stages) pairs."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        warps, _, stages = part.partition(":")
        pairs.append((int(warps), int(stages or 1)))
    return pairs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a tiny shape and few requests (CPU, tests)")
    p.add_argument(
        "--shapes", default=None, help=f"comma-separated, of {', '.join([*SHAPES, *SMALL_SHAPES])}"
    )
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="keys per sequence (the longest)")
    p.add_argument("--min-context", type=int, default=None, help="the shortest (default: --context)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16, float16 on CPU")
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block (the engine defaults to 32; gpu_check runs 16)",
    )
    p.add_argument("--repeat", type=int, default=None, help="timed samples per kernel (default 20; CPU 2)")
    p.add_argument("--inner", type=int, default=None, help="calls per sample (default 20; CPU 1)")
    p.add_argument("--bm-splits", type=parse_list, default=[1, 2, 4], help="bm's forced split counts")
    p.add_argument("--bm-launch", type=parse_launches, default=parse_launches("2:1,4:1,8:1,4:2,8:2,4:3,8:3,4:4"),
                   help="(num_warps:num_stages,...) for bm's automatic choice: a launch sweep ('' for none)")  # fmt: skip
    p.add_argument(
        "--xformers-splits", type=parse_list, default=[1, 2, 8], help="xformers' forced split counts"
    )
    p.add_argument("--no-graphs", action="store_true", help="time eagerly only (CUDA)")
    p.add_argument("--budget-s", type=float, default=40.0,
                   help="optional variants start only within this many seconds of the start")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if args.small:
        args.requests, args.context = min(args.requests, 3), min(args.context, 150)
        args.min_context = args.min_context or 40
    args.min_context = min(args.min_context or args.context, args.context)
    args.dtype = args.dtype or ("float16" if cpu else "bfloat16")
    args.repeat = args.repeat or (2 if cpu else 20)
    args.inner = args.inner or (1 if cpu else 20)
    table = {**SHAPES, **SMALL_SHAPES}
    names = args.shapes.split(",") if args.shapes else list(SMALL_SHAPES if args.small else SHAPES)
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown shape {unknown[0]!r}; allowed: {', '.join(table)}")

    xf_state: dict[str, Any] = {"probe": start_probe(device)}  # overlaps the first shape's bm compiles
    import triton

    args.copy_bytes_per_s = cuda_copy_bandwidth(device, args.small)
    report: dict[str, Any] = {
        "benchmark": "decode_attention_peers",
        "device": torch.cuda.get_device_name(device) if not cpu else "cpu (Triton interpreter)",
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "xformers": None,
                     "python": platform.python_version()},
        "settings": {"requests": args.requests, "context": args.context, "min_context": args.min_context,
                     "dtype": args.dtype, "block_size": args.block_size, "repeat": args.repeat,
                     "inner": args.inner, "graphs": not cpu and not args.no_graphs, "seed": args.seed},
        "copy_gb_per_s": number(args.copy_bytes_per_s / 1e9, 1) if args.copy_bytes_per_s else None,
        "shapes": {},
    }  # fmt: skip
    if not cpu:
        props = torch.cuda.get_device_properties(device)
        report["sm_count"] = props.multi_processor_count
        report["l2_cache_mb"] = round(getattr(props, "L2_cache_size", 0) / 2**20, 1)

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    try:
        load_kernels()  # bm's kernels, and on CPU the interpreter's numpy-2 scalar patch xformers needs too
    except Exception as exc:
        report["error"] = error_text(exc)
    for i, name in enumerate(names):
        budget_until = t0 + args.budget_s * (i + 1) / len(names)
        try:
            report["shapes"][name] = run_shape(name, table[name], args, device, xf_state, budget_until)
        except Exception as exc:
            report["shapes"][name] = {"error": error_text(exc)}
            log(f"{name}: {report['shapes'][name]['error']}")
        report["xformers"] = xf_state.get("info", {"error": "not imported"})
        report["versions"]["xformers"] = report["xformers"].get("version")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    probe = xf_state.get("probe")
    if probe is not None and probe.poll() is None:
        probe.kill()
    save()
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
