"""gpu_check's sections that run what users run: the CLI, in subprocesses with hard timeouts.

Issue 38's user never got a result from ``bm bench`` on an H100 although the kernels were fast, so these
sections time the commands themselves, with default flags:

- ``cli_run``: ``bm bench`` on the first 1,024 Azure conversation rows (``--max-input-len 2048
  --max-output-len 512 --ignore-eos``) on the 1B shape: whether it finished, output tok/s, mean requests
  per iteration, start-up, and the simulator's prediction of the same command (``--executor sim``) on the
  calibrated ``cuda-local`` row and on the ``h100-sxm`` datasheet row;
- ``bench_harness_workload``: gpu_check's own 256-request workload as a synthetic ``bm bench`` dataset,
  beside the harness's steady figure, with the same two predictions;
- ``load_8b``: building the 8B config's random-weight model on the device, timed;
- ``compare``: a two-variant ``bm compare`` in one process, with each variant's KV cache blocks.

``--small`` (CPU, the test suite) runs the same code on tiny shapes and counts, without calibration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRACE_PLACES = (REPO.parent / "shared" / "traces", REPO / "bm-out" / "traces")
TRACE_NAME = "azure_llm_2023_conv.csv"


def find_trace(given: Path | None) -> Path | None:
    """The Azure conversation trace: given, beside the checkout in ../shared, or carried into bm-out/."""
    if given is not None:
        return given if given.is_file() else None
    return next((p / TRACE_NAME for p in TRACE_PLACES if (p / TRACE_NAME).is_file()), None)


def small_trace(folder: Path, rows: int = 32) -> Path:
    """A trace in the Azure file's format, for the CPU run when ../shared is absent (a code path check)."""
    path = folder / "azure-like.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [
        f"2023-11-16 18:15:{i:02d}.0000000,{20 + (i * 37) % 200},{4 + (i * 11) % 40}" for i in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def bm_bench(
    args: list[str], out: Path, timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``bm bench ARGS -q -o OUT`` in a subprocess, killed at ``timeout_s``: its figures, or what a killed
    run left (the stats lines written so far)."""
    cmd = [sys.executable, "-m", "bm", "bench", *args, "-q", "-o", str(out), "--overwrite"]
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env or _env()
        )
    except subprocess.TimeoutExpired:
        lines = _count_lines(out / "stats.jsonl")
        return {
            "finished": False,
            "timeout_s": timeout_s,
            "stats_lines_written": lines,
            "command": _show(args),
        }
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not (out / "results.json").is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        return {"finished": False, "exit_code": proc.returncode, "error": tail, "command": _show(args)}
    doc = json.loads((out / "results.json").read_text())
    return {
        "finished": True,
        "command": _show(args),
        "wall_s": wall,
        "output_tok_s": doc["output_throughput"],
        "mean_requests_per_iteration": doc.get("mean_requests_per_iteration"),
        "num_iterations": doc.get("num_iterations"),
        "duration_s": doc["duration"],
        "startup_s": (doc.get("startup") or {}).get("total_s"),
        "startup": doc.get("startup"),
        "warnings": doc.get("warnings"),
        "engine": {
            k: doc["config"]["engine"][k]
            for k in ("max_batch_size", "max_num_tokens", "enable_chunked_context")
        },
        "kv_cache_max_tokens": doc["config"]["kv_cache"]["max_tokens"],
    }


def predictions(args: list[str], real: dict[str, Any], rows: list[str], folder: Path) -> dict[str, Any]:
    """The simulator's output tok/s for the same command on each hardware row, and its ratio to the real
    run's (the goal: within 15% on cuda-local)."""
    out: dict[str, Any] = {}
    for row in rows:
        sim = bm_bench([*args, "--executor", "sim", "--hardware", row], folder / f"sim-{row}", 600)
        entry = {"output_tok_s": sim.get("output_tok_s"), "finished": sim["finished"]}
        if not sim["finished"]:
            entry["error"] = sim.get("error")
        elif real.get("finished"):
            entry["predicted_over_real"] = sim["output_tok_s"] / real["output_tok_s"]
        out[row] = entry
    return out


def check_cli_run(
    shape_file: Path, trace: Path | None, small: bool, folder: Path, sim_rows: list[str]
) -> dict[str, Any]:
    if trace is None:
        trace = small_trace(folder)
    n, prompt, output = ("24", "64", "8") if small else ("1024", "2048", "512")
    args = [str(trace), "--dataset-kind", "azure", "--model-config", str(shape_file), "-n", n,
            "--max-input-len", prompt, "--max-output-len", output, "--ignore-eos"]  # fmt: skip
    result = bm_bench(args + _device_flags(small), folder / "cli-run", 120 if small else 300)
    result["trace"] = str(trace)
    result["sim"] = predictions(args, result, sim_rows, folder)
    return result


def check_bench_workload(
    shape_file: Path, args: Any, harness_tok_s: float | None, folder: Path, sim_rows: list[str]
) -> dict[str, Any]:
    """gpu_check's workload (prompts uniform in [prompt_len/2, prompt_len], fixed outputs) as bm bench's
    synthetic dataset, default flags otherwise."""
    half = args.prompt_len // 2
    middle = (half + args.prompt_len) // 2
    ratio = (args.prompt_len - middle) / middle
    bench_args = ["--dataset-kind", "synthetic", "--model-config", str(shape_file), "-n", str(args.requests),
                  "--input-len", str(middle), "--range-ratio", f"{ratio:.4f}", "--output-len",
                  str(args.output_len), "--ignore-eos"]  # fmt: skip
    result = bm_bench(bench_args + _device_flags(args.small), folder / "bench-workload", 300)
    result["harness_output_tok_s"] = harness_tok_s
    if result.get("finished") and harness_tok_s:
        result["bench_over_harness"] = result["output_tok_s"] / harness_tok_s
    result["sim"] = predictions(bench_args, result, sim_rows, folder)
    return result


def check_load(config_file: Path, device: str) -> dict[str, Any]:
    """Build ``config_file``'s random-weight model on ``device`` in a fresh process (as a user's first
    command would), timed by load_model itself."""
    code = (
        "import json, time, torch; from bm.config import ModelConfig; from bm.runtime import load_model; "
        f"t = time.perf_counter(); m = load_model(ModelConfig(config={str(config_file)!r}, device={device!r})); "
        "n = sum(p.numel() for p in m.model.parameters()); "
        "print(json.dumps({'load_s': m.load_seconds, 'process_s': time.perf_counter() - t, 'parameters': n, "
        "'dtype': str(m.dtype), 'device': str(m.device)}))"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=_env()
        )
    except subprocess.TimeoutExpired:
        return {"finished": False, "timeout_s": 300, "config": str(config_file)}
    if proc.returncode != 0:
        return {"finished": False, "error": proc.stderr.strip().splitlines()[-3:], "config": str(config_file)}
    return {"finished": True, "config": str(config_file), **json.loads(proc.stdout.strip().splitlines()[-1])}


def check_compare(shape_file: Path, small: bool, folder: Path) -> dict[str, Any]:
    """Two variants of one ``bm compare`` in one process: each variant's KV cache blocks (equal)."""
    out = folder / "compare"
    n = "16" if small else "256"
    cmd = [sys.executable, "-m", "bm", "compare", "--dataset-kind", "synthetic", "--model-config",
           str(shape_file), "-n", n, "--input-len", "48" if small else "384", "--output-len", "8" if small else "64",
           "--ignore-eos", "--schemes", "inflight,inflight_fused", "-q", "-o", str(out), "--overwrite",
           *_device_flags(small)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
    except subprocess.TimeoutExpired:
        return {"finished": False, "timeout_s": 300}
    if proc.returncode != 0:
        return {
            "finished": False,
            "exit_code": proc.returncode,
            "error": proc.stderr.strip().splitlines()[-5:],
        }
    blocks = {}
    for name in ("inflight", "inflight_fused"):
        stats = (out / "variants" / name / "stats.jsonl").read_text().splitlines()
        blocks[name] = sorted({json.loads(line)["Max KV cache blocks"] for line in stats})
    doc = json.loads((out / "compare.json").read_text())
    tok_s = {k: v["metrics"]["output_throughput"] for k, v in doc["variants"].items()}
    return {"finished": True, "kv_cache_blocks": blocks, "equal_caches": len({str(b) for b in blocks.values()}) == 1,
            "output_tok_s": tok_s}  # fmt: skip


def user_path_goals(report: dict[str, Any]) -> dict[str, bool]:
    """Issue 38's device goals, read off the sections above that ran (a section left out by
    ``--sections``, or a prediction not made, names no goal)."""
    out: dict[str, bool] = {}
    if "cli_run" in report:
        out["cli_run_finishes"] = bool(report["cli_run"].get("finished"))
    bench = report.get("bench_harness_workload")
    if bench is not None and bench.get("harness_output_tok_s"):  # the harness's figure ran beside it
        out["bench_at_least_90pct_of_harness"] = (bench.get("bench_over_harness") or 0) >= 0.9
    if "load_8b" in report:
        load = report["load_8b"]
        out["8b_loads_under_30s"] = bool(load.get("finished")) and (load.get("load_s") or 1e9) < 30
    for name, key in (("cli_run", "cli_run"), ("bench_workload", "bench_harness_workload")):
        sim = (report.get(key) or {}).get("sim") or {}
        if "cuda-local" in sim:
            ratio = sim["cuda-local"].get("predicted_over_real")
            out[f"cuda_local_within_15pct_on_{name}"] = ratio is not None and abs(ratio - 1) <= 0.15
    if "compare" in report:
        out["compare_variants_get_equal_caches"] = bool(report["compare"].get("equal_caches"))
    return out


def first_run_within_10pct(figures: dict[str, Any]) -> bool | None:
    """The harness's first timed run against its second, both on one executor after its start-up (None
    when either is missing)."""
    first, steady = figures.get("bm_first_run"), figures.get("bm")
    if not first or not steady:
        return None
    return first["output_tok_s"] >= 0.9 * steady["output_tok_s"]


def shape_file(shape: dict[str, Any], folder: Path) -> Path:
    path = folder / f"llama-{shape['hidden_size']}x{shape['num_hidden_layers']}.json"
    path.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096, **shape}))
    return path


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="gpu-check-"))


def _device_flags(small: bool) -> list[str]:
    return ["-s", "model.device=cpu"] if small else []


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("BM_ATTENTION", None)  # the default path, as a user runs it
    return env


def _count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _show(args: list[str]) -> str:
    return "bm bench " + " ".join(args)
