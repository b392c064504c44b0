"""Shared pieces of the benchmark scripts: reading a workload and timing bm on it offline."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bm.baselines import PeerResult
from bm.batch_manager import OfflineClient, torch_executor
from bm.config import BmConfig, parse_override
from bm.config.model import model_override
from bm.engine import EngineLoop, Request
from bm.runtime import LoadedModel

Workload = list[tuple[list[int], int]]
REPO = Path(__file__).resolve().parent.parent
BENCH_CONFIG = REPO / "configs" / "bench.yaml"
NATIVE_SOURCES = REPO / "bm" / "runtime" / "native"


def kernel_sources_at(ref: str, workdir: Path) -> Path:
    """Every C kernel source and header as git revision ``ref`` has them, written into ``workdir``: a
    kernel compiled from there is that revision's build (the headers it includes too), for an A/B of a
    kernel change in one process. Returns ``workdir``."""
    folder = NATIVE_SOURCES.relative_to(REPO).as_posix()
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", ref, f"{folder}/"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for path in (p for p in listed if p.endswith((".c", ".h"))):
        text = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{ref}:{path}"], check=True, capture_output=True, text=True
        ).stdout
        (workdir / Path(path).name).write_text(text)
    return workdir


def kernel_at(ref: str, workdir: Path, source_name: str, isa: str, wrap: Callable[[Any], Any]) -> Any:
    """The C kernel ``source_name`` (e.g. ``small_gemm.c``) compiled for ``isa`` as git revision ``ref``
    has it (:func:`kernel_sources_at`), wrapped by ``wrap`` (its Python class); exits where it does not
    compile."""
    from bm.runtime.native.build import compile_kernel

    lib = compile_kernel(kernel_sources_at(ref, workdir) / source_name, isa)
    if lib is None:
        raise SystemExit(f"could not compile {source_name} at {ref}")
    return wrap(lib)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model-config`` or ``--model``, ``-c`` (bm config file, the benchmark one by default) and ``-s``."""
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-config", help="model config JSON (random weights)")
    model.add_argument(
        "--model", help="a preset (smollm2-135m) or a checkpoint directory (config.json + weights)"
    )
    p.add_argument("-c", "--config", type=Path, default=BENCH_CONFIG)
    p.add_argument("-s", "--set", action="append", default=[], help="bm config override SECTION.KEY=VALUE")


def model_overrides(args: argparse.Namespace, seed: int = 0) -> dict[str, Any]:
    """The ``-s`` overrides plus the model :func:`add_model_arguments` named (random weights from ``seed``)."""
    overrides = dict(parse_override(o) for o in args.set)
    if args.model:  # a preset or a directory, by the rule bm's own --model follows
        key, value = model_override(args.model)
        overrides.update({"model.preset": None, "model.path": None, key: value, "model.config": None})
    else:
        overrides.update({"model.config": args.model_config, "model.seed": seed, "model.path": None})
    return overrides


def read_workload(path: Path, limit: int | None = None) -> Workload:
    """``input_ids`` and ``request_output_len`` of each line (other fields, like arrival times, ignored)."""
    workload = []
    with path.open() as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                workload.append((row["input_ids"], int(row["request_output_len"])))
    return workload[:limit] if limit else workload


def run_bm(loaded: LoadedModel, config: BmConfig, workload: Workload) -> tuple[PeerResult, list[dict]]:
    """Everything submitted at t=0; wall time from the batch manager's construction to the last result."""
    requests = [Request(i, list(p), n) for i, (p, n) in enumerate(workload)]
    client = OfflineClient(requests)
    stats: list[str] = []
    start = time.perf_counter()
    with EngineLoop(
        config,
        client.get_requests,
        client.send_response,
        return_stats=stats.append,
        executor=torch_executor(config, loaded),
    ):
        client.wait()
    elapsed = time.perf_counter() - start
    failed = [r for r in client.results.values() if r.error]
    if failed:
        raise SystemExit(f"bm: {len(failed)} requests failed, e.g. {failed[0].error}")
    generated = sum(len(r.output_ids) for r in client.results.values())
    prompt_tokens = sum(len(p) for p, _ in workload)
    return PeerResult("bm", len(workload), prompt_tokens, generated, elapsed), [json.loads(s) for s in stats]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def copy_bandwidth(device: Any, small: bool = False) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted), best of five: the
    ceiling a decode step's weight and KV reads are measured against (gpu_check's roofline,
    decode_attention_peers' kernels)."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    n = (64 << 20) if small else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * n / best
