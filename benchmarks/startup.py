#!/usr/bin/env python3
"""Start-up of a bm run, phase by phase, in a fresh interpreter: what a user waits for before the first token.

    python benchmarks/startup.py [--model smollm2-135m] [--runs 3]

Each run starts a new Python process that imports bm's runtime (torch and transformers with it), reads
the config, loads the model (with prepacked weights where ``model.prepack`` says so), gets the decode
kernel (from the per-machine cache; ``kernel_build_s`` is a separate fresh build into a temporary
directory, what the first run on a machine pays once), starts the engine (KV cache allocation) and
generates one token for a three-token prompt. Prints JSON: each run's phases and the best of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from bm.runtime import load_model
from bm.config import load_config
t1 = time.perf_counter()
cfg = load_config(None, {"model.preset": sys.argv[1], "kv_cache.max_tokens": 16384})
loaded = load_model(cfg.model)
t2 = time.perf_counter()
from bm.runtime.native import paged_decode_kernel
paged_decode_kernel()
t3 = time.perf_counter()
from bm.batch_manager import OfflineClient, torch_executor
from bm.engine import EngineLoop, Request
client = OfflineClient([Request(0, [1, 2, 3], 1)])
with EngineLoop(cfg, client.get_requests, client.send_response, executor=torch_executor(cfg, loaded)):
    t4 = time.perf_counter()
    client.wait()
t5 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "model_load_s": t2 - t1, "kernel_load_s": t3 - t2,
                  "engine_start_s": t4 - t3, "first_token_s": t5 - t4, "total_s": t5 - t0}))
"""

BUILD = r"""
import json, os, shutil, tempfile, time
from pathlib import Path
from bm.cpu_isa import kernel_isa
from bm.runtime.native import build, loader
cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
source, isa = loader.SOURCES / "paged_decode.c", kernel_isa("paged_decode")
with tempfile.TemporaryDirectory() as tmp:
    t = time.perf_counter()
    ok = build._build(source, cc, build.loaded_openmp_runtime(), Path(tmp), isa) is not None
    print(json.dumps({"kernel_build_s": time.perf_counter() - t, "built": ok}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="a model.preset name")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    runs = []
    for _ in range(args.runs):
        done = subprocess.run([sys.executable, "-c", CHILD, args.model], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr[-2000:])
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    build = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, check=True)
    best = {k: round(min(r[k] for r in runs), 3) for k in runs[0]}
    report = {
        "model": args.model,
        "best": best,
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in json.loads(build.stdout).items()},
        "runs": [{k: round(v, 3) for k, v in r.items()} for r in runs],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
