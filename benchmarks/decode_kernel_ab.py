#!/usr/bin/env python3
"""The paged decode kernel of a git ref against this checkout's, bit for bit and by time, in one process.

    python benchmarks/decode_kernel_ab.py [--ref main] [--isa avx512,avx2,scalar] [--threads 1]

Builds ``bm/runtime/native/paged_decode.c`` as ``--ref`` has it and as the working tree has it (the
same flags, bm.runtime.native.build), then

* checks that both give the same bits on random shapes (head sizes with and without a vector tail, any
  grouping, block sizes 1..32, lengths 1..1000, soft-capping, ALiBi, windows and sink logits), per
  variant: a kernel change must not move a single bit (batch invariance and the oracles rest on it);
* times both on one layer of SmolLM2-135M's shape (9 query heads over 3 kv heads of 64) for ``--rows``
  decoding rows with context lengths in ``--min-len``..``--max-len`` on shuffled blocks, interleaved, and
  prints the median milliseconds and the keys-and-values bandwidth of each.

Then the two pieces of the forward's remainder this checkout replaced, old and new in turns: each
layer's KV write (two ``index_copy_`` against the compiled copy) and the residual add + RMSNorm (torch's
add then the C norm against the fused kernel), at 1 to 2048 tokens, bitwise compared too.

One thread by default: on a machine shared with other work, two OpenMP threads wait on the slower one
and the ratio drifts; ``--threads 2`` measures what the engine runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import kernel_sources_at

from bm.cpu_isa import machine_isas
from bm.runtime.attention import LayerExtras
from bm.runtime.native import DecodeRows, PagedDecodeKernel, elementwise_kernels, paged_decode_kernel
from bm.runtime.native.build import compile_kernel

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "bm" / "runtime" / "native" / "paged_decode.c"


def build(source: Path, isa: str, tag: str) -> PagedDecodeKernel:
    """The kernel compiled from ``source`` (and the headers beside it) for variant ``isa``."""
    lib = compile_kernel(source, isa)
    if lib is None:
        raise SystemExit(f"{tag}: the {isa} build failed")
    if not hasattr(lib, "bm_kv_write_f32"):  # older sources: attention only
        lib.bm_kv_write_f32 = lib["bm_paged_decode_f32"]
    return PagedDecodeKernel(lib)


def layer(rng: random.Random, heads: int, kv: int, d: int, bs: int, lengths: list[int], scale: float = 1.0):
    """A cache with ``lengths`` rows on shuffled blocks, their tables and queries: the kernel's inputs."""
    num_blocks = sum(-(-n // bs) for n in lengths) + 3
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    cache = torch.randn(2, kv, num_blocks, bs, d, generator=g) * scale
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lengths]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lengths) + 2, heads, d, generator=g).transpose(0, 1)  # [heads, tokens, d] view
    token_index = torch.tensor(rng.sample(range(len(lengths) + 2), len(lengths)))
    return q, cache, token_index, table, torch.tensor(lengths), max(lengths), d**-0.5


FEATURES = [{}, {"softcap": 2.0}, {"alibi": True}, {"window": 5}, {"window": 37, "alibi": True},
            {"sink": True}, {"softcap": 0.5, "window": 9}]  # fmt: skip
SHAPES = [(9, 3, 64, 32), (9, 3, 64, 16), (6, 2, 64, 32), (4, 4, 16, 8), (6, 3, 12, 4), (8, 1, 40, 16),
          (8, 2, 32, 4), (12, 4, 128, 32), (16, 2, 128, 16), (4, 1, 64, 1), (14, 2, 64, 7), (8, 8, 80, 32),
          (8, 2, 96, 32), (3, 3, 48, 16), (10, 2, 256, 16), (5, 1, 8, 8), (2, 1, 24, 5)]  # fmt: skip


def check(old: PagedDecodeKernel, new: PagedDecodeKernel, rng: random.Random) -> int:
    """Cases compared; exits naming the first that differs in any bit."""
    cases = 0
    for heads, kv, d, bs in SHAPES:
        for extra in FEATURES:
            for rows, longest in [(1, 1), (3, 20), (8, 300), (5, 1000)]:
                lengths = [rng.randint(1, longest) for _ in range(rows)]
                q, cache, idx, table, lens, max_len, scale = layer(
                    rng, heads, kv, d, bs, lengths, 3.0 if "softcap" in extra else 1.0
                )
                slopes = (
                    2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32) if extra.get("alibi") else None
                )
                sinks = torch.randn(heads) * 3 if extra.get("sink") else None
                decode_rows = DecodeRows(idx, table, lens, max_len, extra.get("window"))
                extras = LayerExtras(extra.get("softcap"), slopes, sinks)
                outs = []
                for kernel in (old, new):
                    out = torch.full((rows + 2, heads, d), float("nan"))
                    kernel(out, q, cache, decode_rows, scale, extras)
                    outs.append(out.view(torch.int32))  # bits, NaN included
                if not torch.equal(*outs):
                    raise SystemExit(
                        f"bits differ: heads {heads}/{kv}, d {d}, block {bs}, {extra}, {lengths}"
                    )
                cases += 1
    return cases


def timed(old: PagedDecodeKernel, new: PagedDecodeKernel, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.rows)]
    q, cache, _, table, lens, max_len, scale = layer(rng, 9, 3, 64, 32, lengths)
    inputs = (q, cache, DecodeRows(torch.arange(args.rows), table, lens, max_len), scale)
    outs = {name: torch.empty(args.rows + 2, 9, 64) for name in ("old", "new")}
    samples: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(args.repeat + 3):
        for name, kernel in (("old", old), ("new", new)):
            start = time.perf_counter()
            kernel(outs[name], *inputs)
            if i >= 3:
                samples[name].append(time.perf_counter() - start)
    if not torch.equal(outs["old"][: args.rows], outs["new"][: args.rows]):
        raise SystemExit("bits differ on the timed layer")
    kv_bytes = sum(lengths) * 2 * 3 * 64 * 4
    return {name: statistics.median(s) for name, s in samples.items()} | {"bytes": kv_bytes}


def median_s(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def remainder_at(tokens: int, kernel: PagedDecodeKernel, elementwise: Any) -> str:
    """One line: the KV write and the add + RMSNorm at ``tokens``, torch's way against the compiled one."""
    cache = torch.zeros(2, 3, 4000, 32, 64)
    flat = cache.view(2, 3, 4000 * 32, 64)
    weight = torch.randn(576)
    k = torch.randn(1, tokens, 3, 64).transpose(1, 2)[0]  # as the rotary kernel leaves them
    v = torch.randn(1, tokens, 192).view(1, tokens, 3, 64).transpose(1, 2)[0]  # as v_proj does
    slots = torch.arange(tokens) + 32 * 1000  # a chunk's slots, consecutive within its blocks
    a, b = torch.randn(1, tokens, 576), torch.randn(1, tokens, 576)

    def torch_kv() -> None:
        flat[0].index_copy_(1, slots, k)
        flat[1].index_copy_(1, slots, v)

    def torch_add_norm() -> tuple[torch.Tensor, torch.Tensor]:
        total = a + b
        return total, elementwise.rms_norm(total, weight, 1e-5)

    torch_kv()
    expected = cache.clone()
    cache.zero_()
    kernel.write_kv(cache, slots, k, v)
    fused = elementwise.add_rms_norm(a, b, weight, 1e-5)
    same = torch.equal(cache, expected) and all(map(torch.equal, fused, torch_add_norm()))
    repeat = 400 if tokens <= 64 else 60
    kv = (median_s(torch_kv, repeat), median_s(lambda: kernel.write_kv(cache, slots, k, v), repeat))
    add_norm = (
        median_s(torch_add_norm, repeat),
        median_s(lambda: elementwise.add_rms_norm(a, b, weight, 1e-5), repeat),
    )
    return (
        f"{tokens:5d} tokens: KV write index_copy_ x2 {kv[0] * 1e6:.1f} us, compiled {kv[1] * 1e6:.1f} us "
        f"({kv[0] / kv[1]:.2f}x); add + RMSNorm {add_norm[0] * 1e6:.1f} us, fused {add_norm[1] * 1e6:.1f} us "
        f"({add_norm[0] / add_norm[1]:.2f}x); bitwise equal: {same}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default="main", help="the git ref to compare with (default: main)")
    p.add_argument("--isa", default=",".join(machine_isas()), help="variants, comma-separated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=700)
    p.add_argument("--repeat", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    ref_source = kernel_sources_at(args.ref, Path(tempfile.mkdtemp(prefix="bm-ab-ref-"))) / SOURCE.name
    for isa in args.isa.split(","):
        old, new = build(ref_source, isa, "ref"), build(SOURCE, isa, "tree")
        cases = check(old, new, random.Random(1))
        t = timed(old, new, args)
        print(
            f"{isa}: bitwise equal on {cases} cases; threads {args.threads}: {args.ref} {t['old'] * 1e3:.3f} ms "
            f"({t['bytes'] / t['old'] / 1e9:.1f} GB/s), this tree {t['new'] * 1e3:.3f} ms "
            f"({t['bytes'] / t['new'] / 1e9:.1f} GB/s), {t['old'] / t['new']:.2f}x"
        )
    with torch.inference_mode():
        for tokens in (1, 64, 512, 2048):
            print(remainder_at(tokens, paged_decode_kernel(), elementwise_kernels()))


if __name__ == "__main__":
    main()
