"""The CPU peers of ``../shared/bench/`` run one after another on one workload, for one side-by-side table.

Each peer is a script with the same interface (``WORKLOAD.jsonl MODEL``, one JSON line with ``output_tok_s``)
run in its own virtual environment, built by ``../shared/bench/peers/setup.sh`` under ``$PEERS_DIR``
(``~/.cache/bm-peers``). A peer whose environment or model file is missing, or that fails, is reported as
skipped with the reason instead of stopping the other peers: a table with a hole beats no table. ``bm-bench``
runs ``bm bench`` with its default settings in a subprocess, so the figure a user gets stands beside them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "bench"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", str(Path.home() / ".cache" / "bm-peers")))
SETUP_HINT = "run `bash ../shared/bench/peers/setup.sh HF_MODEL_DIR` first"
# CPU flags that decide which kernels a CPU peer (or bm) can use, as /proc/cpuinfo names them.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8")  # fmt: skip


@dataclass(frozen=True)
class Peer:
    """One row of the table: which environment runs which script on which model file."""

    name: str
    venv: str | None  # a directory under PEERS_DIR; None runs with this interpreter (bm's environment)
    script: str  # relative to ../shared/bench/
    model: str  # "config" (config.json only), "hf" (a checkpoint), "gguf-f32", "gguf-q4_1", "ct2"
    args: tuple[str, ...] = ()


PEERS = (
    Peer("vllm-cpu", "vllm", "vllm_peer.py", "config"),
    Peer("vllm-cpu-eager", "vllm", "vllm_peer.py", "config", ("--eager",)),
    # vLLM in its default dtype for a bf16 checkpoint (most are), compiled: what its users run
    Peer("vllm-cpu-bf16", "vllm", "vllm_peer.py", "config", ("--dtype", "bfloat16")),
    Peer("llamacpp-f32", "llamacpp", "peers/llamacpp_peer.py", "gguf-f32", ("--parallel", "64", "--kv-type", "f32")),
    Peer("llamacpp-q4_1", "llamacpp", "peers/llamacpp_peer.py", "gguf-q4_1", ("--parallel", "64")),
    Peer("ct2-fp32", "ct2", "peers/ct2_peer.py", "ct2", ("--compute-type", "float32")),
    Peer("ct2-int8", "ct2", "peers/ct2_peer.py", "ct2", ("--compute-type", "int8")),
    Peer("transformers-cb", None, "peers/hfcb_peer.py", "hf"),
)  # fmt: skip
PEER_NAMES = ("bm-bench", *(p.name for p in PEERS))


class PeerSkipped(Exception):
    """Why a peer could not run here (missing environment, model file, or its run failed)."""


def cpu_info() -> dict[str, Any]:
    """The CPU's model name, core count and the flags in :data:`CPU_FLAGS` (Linux's /proc/cpuinfo)."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "cpus": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}


def is_smollm2_135m(config: Any) -> bool:
    """SmolLM2-135M's shape: setup.sh's GGUF and CTranslate2 files are for this model only."""
    shape = (config.hidden_size, config.num_hidden_layers, config.vocab_size)
    return shape == (576, 30, 49152)


def model_key(hf_config: Any, model_dir: str | None) -> str:
    """A stable name for the files made from one model: its path, or its config when the weights are random."""
    source = str(Path(model_dir).resolve()) if model_dir else hf_config.to_json_string(use_diff=False)
    return hashlib.sha1(source.encode()).hexdigest()[:12]


class PeerModels:
    """The model files each peer needs, found (setup.sh's) or made once under ``PEERS_DIR/models``."""

    def __init__(self, hf_config: Any, model_dir: str | None, work: Path) -> None:
        self.config, self.model_dir, self.work = hf_config, model_dir, work
        self.cache = PEERS_DIR / "models" / model_key(hf_config, model_dir)
        self.smollm2 = is_smollm2_135m(hf_config)

    def config_dir(self) -> Path:
        out = self.work / "config-only"
        if not out.is_dir():
            self.config.save_pretrained(out)
        return out

    def hf_dir(self) -> Path:
        if self.model_dir:
            return Path(self.model_dir)
        out = self.cache / "hf"
        if not (out / "model.safetensors").is_file():  # random weights (seed 0) and a 1:1 word tokenizer
            config_json = self.config_dir() / "config.json"
            _run([sys.executable, str(SHARED / "peers" / "make_random_model.py"), str(config_json), str(out)])
        return out

    def gguf(self, kind: str) -> Path:
        if self.smollm2:
            name = "F32" if kind == "gguf-f32" else "Q4_1"
            path = PEERS_DIR / "gguf" / f"SmolLM2-135M-Instruct.{name}.gguf"
            if not path.is_file():
                raise PeerSkipped(f"{path} not found; {SETUP_HINT}")
            return path
        if kind == "gguf-q4_1":
            raise PeerSkipped(
                "a Q4_1 GGUF exists for SmolLM2-135M only (llama.cpp's quantizer is not installed)"
            )
        out = self.cache / "model.F32.gguf"
        if not out.is_file():
            llama = PEERS_DIR / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
            if not llama.is_dir():
                raise PeerSkipped(f"llama.cpp's converter not found under {PEERS_DIR / 'src'}; {SETUP_HINT}")
            env = {**os.environ, "PYTHONPATH": f"{llama / 'gguf-py'}:{llama}", "PYTHONDONTWRITEBYTECODE": "1"}
            python = _venv_python("ct2")
            cmd = [python, str(llama / "convert_hf_to_gguf.py"), str(self.hf_dir()), "--outtype", "f32"]
            try:
                _run([*cmd, "--outfile", str(out)], env=env)
            except PeerSkipped as exc:
                raise PeerSkipped(f"llama.cpp's converter could not read {self.hf_dir()}: {exc}") from exc
        return out

    def ct2(self, compute_type: str) -> Path:
        if self.smollm2:
            path = PEERS_DIR / f"ct2-smollm2-{'float32' if compute_type == 'float32' else 'int8'}"
            if (path / "model.bin").is_file():
                return path
        return (
            self.hf_dir()
        )  # ct2_peer.py converts a checkpoint once (into --ct2-cache) and quantizes at load

    def path(self, peer: Peer) -> Path:
        if peer.model == "config":
            return self.config_dir()
        if peer.model == "hf":
            return self.hf_dir()
        if peer.model.startswith("gguf"):
            return self.gguf(peer.model)
        return self.ct2(peer.args[-1])


def _venv_python(venv: str) -> str:
    python = PEERS_DIR / venv / "bin" / "python"
    if not python.is_file():
        raise PeerSkipped(f"{python} not found; {SETUP_HINT}")
    return str(python)


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> str:
    """Run one step; a failure becomes :class:`PeerSkipped` with the end of its error output."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise PeerSkipped(f"timed out after {timeout:.0f} s: {' '.join(cmd[:3])}") from exc
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise PeerSkipped(f"exit {done.returncode}: {tail[-600:]}")
    return done.stdout


def peer_command(
    peer: Peer, models: PeerModels, workload: Path, threads: int, pythons: dict[str, str] | None = None
) -> tuple[list[str], dict]:
    """The command line and environment of one peer on ``workload`` with ``threads`` threads; ``pythons``
    names another interpreter for an environment (e.g. ``{"vllm": ".../bin/python"}``)."""
    chosen = (pythons or {}).get(peer.venv or "")
    python = chosen or (_venv_python(peer.venv) if peer.venv else sys.executable)
    cmd = [python, str(SHARED / peer.script), str(workload), str(models.path(peer)), *peer.args]
    env = dict(os.environ)
    if peer.venv == "vllm":
        env.update({"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    else:
        cmd += ["--threads", str(threads)]
    if peer.venv == "ct2":
        cmd += ["--ct2-cache", str(PEERS_DIR / "ct2-models")]
    return cmd, env


def parse_peer_output(stdout: str, prompt_tokens: int) -> dict[str, Any]:
    """The last JSON line a peer printed, in one shape: requests, tokens, wall seconds, output tok/s."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise PeerSkipped("the peer printed no JSON result line")
    row = json.loads(lines[-1])
    wall = float(row.get("wall_s", row.get("elapsed_s", 0.0)))
    return {
        "requests": int(row.get("requests", row.get("num_requests", 0))),
        "prompt_tokens": int(row.get("prompt_tokens", prompt_tokens)),
        "output_tokens": int(row["output_tokens"]),
        "wall_s": round(wall, 3),
        "output_tok_s": round(row["output_tokens"] / wall, 2) if wall > 0 else 0.0,
        "peer_report": row,
    }


def bm_bench_command(workload: Path, model_dir: str | None, model_config: str | None, out: Path) -> list[str]:
    """``bm bench`` as a user types it: the workload, the model, every request to its length, no tuning."""
    model = ["--model", model_dir] if model_dir else ["--model-config", str(model_config)]
    return [sys.executable, "-m", "bm", "bench", str(workload), *model, "--ignore-eos", "--json", "-q",
            "-o", str(out), "--overwrite"]  # fmt: skip


def run_bm_bench(workload: Path, model_dir: str | None, model_config: str | None, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stdout = _run(bm_bench_command(workload, model_dir, model_config, Path(tmp) / "out"), timeout=timeout)
    start = stdout.find("{")
    if start < 0:
        raise PeerSkipped("bm bench printed no JSON")
    m = json.loads(stdout[start:])
    return {
        "requests": m["completed"],
        "prompt_tokens": m["total_input_tokens"],
        "output_tokens": m["total_output_tokens"],
        "wall_s": round(m["duration"], 3),
        "output_tok_s": round(m["output_throughput"], 2),
        "kv_cache": {k: m.get(k) for k in ("max_kv_cache_utilization", "num_iterations")},
    }


def run_peers(
    names: list[str],
    workload: Path,
    hf_config: Any,
    model_dir: str | None,
    model_config: str | None,
    threads: int,
    timeout: float = 3600,
    pythons: dict[str, str] | None = None,
    log: Any = print,
) -> dict[str, dict]:
    """Run each named peer in turn; each entry is its result, or ``{"skipped": reason}``."""
    prompt_tokens = sum(
        len(json.loads(x)["input_ids"]) for x in workload.read_text().splitlines() if x.strip()
    )
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as work:
        models = PeerModels(hf_config, model_dir, Path(work))
        for name in names:
            try:
                if name == "bm-bench":
                    results[name] = run_bm_bench(workload, model_dir, model_config, timeout)
                else:
                    peer = next(p for p in PEERS if p.name == name)
                    cmd, env = peer_command(peer, models, workload, threads, pythons)
                    results[name] = parse_peer_output(_run(cmd, env=env, timeout=timeout), prompt_tokens)
                    results[name]["command"] = " ".join(cmd[1:])
                log(
                    f"{name}: {results[name]['output_tok_s']:.1f} output tok/s in {results[name]['wall_s']:.2f} s"
                )
            except PeerSkipped as exc:
                results[name] = {"skipped": str(exc)}
                log(f"{name}: skipped ({exc})")
    return results
