"""Shared pieces of the benchmark scripts: reading a workload and timing bm on it offline."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bm.baselines import PeerResult
from bm.config import BmConfig
from bm.engine import EngineLoop, OfflineClient, Request
from bm.runtime import LoadedModel

Workload = list[tuple[list[int], int]]


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
        config, client.get_requests, client.send_response, return_stats=stats.append, model=loaded
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
