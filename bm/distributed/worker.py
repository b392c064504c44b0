"""Tensor-parallel ranks for a process that has no bm command line to rerun: ``python -m
bm.distributed.worker`` is ranks 1..N-1, and :func:`start_replica_ranks` makes the calling process rank 0.

bm's launcher starts the other ranks of ``bm run --tensor-parallel`` by rerunning its command line. A
``bm run --ray`` replica is a Ray actor, whose command line is Ray's worker, so it starts them with this
module's command instead (through the same launcher, :func:`bm.parallel.layout.setup_parallel`): the
config travels as JSON in :data:`SPEC_ENV`, the layout in torchrun's variables, and each rank then
serves rounds exactly as a rank of ``bm run`` does (:func:`bm.distributed.cli.start`).

Both sides die together, so that Ray's restart of the actor is the one answer to a fault: rank 0 exits
when a rank fails (:func:`bm.parallel.layout.exit_on_rank_fault`) instead of answering its requests
with errors, and a rank exits as soon as its parent is gone instead of waiting ``--rank-timeout`` in a
collective while holding its memory (and its GPU, which the restarted actor wants back).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import bm
from bm.config import BmConfig, config_from_dict
from bm.parallel.layout import ParallelLayout, RankCommand, exit_on_rank_fault, setup_parallel

SPEC_ENV = "BM_RANK_SPEC"  # JSON: {"config": BmConfig.to_dict(), "tensor_parallel", "rank_timeout_s", ...}
PARENT_ENV = "BM_RANK_PARENT"  # rank 0's pid: the rank exits when its parent is no longer that process
PARENT_POLL_S = 0.5


def start_replica_ranks(
    config: BmConfig, tensor_parallel: int, rank_timeout_s: float, threads: int | None = None
) -> ParallelLayout:
    """Make this process rank 0 of a tensor-parallel group of its own (a free local port), with ranks
    1..N-1 started as ``python -m bm.distributed.worker``; a rank that fails from now on ends this
    process. Load the model and build the engine after this, as any rank 0 does (``bm.LLM`` then loads
    its shard and its sessions drive every rank). ``threads``: torch threads of each rank on the CPU."""
    spec = {
        "config": config.to_dict(),
        "tensor_parallel": tensor_parallel,
        "rank_timeout_s": rank_timeout_s,
        "threads": threads,
    }
    # The ranks import the bm this process runs: an actor finds it on a sys.path that Ray set up (the
    # driver's directory), which a child process would not inherit, and might import another bm.
    source = str(Path(bm.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    command = RankCommand(
        [sys.executable, "-m", "bm.distributed.worker"],
        {SPEC_ENV: json.dumps(spec), PARENT_ENV: str(os.getpid()), "PYTHONPATH": path},
    )
    exit_on_rank_fault()  # first: a rank that dies while starting must not leave rank 0 in the rendezvous
    return setup_parallel(tensor_parallel, 1, rank_timeout_s, config.model.device, rank_command=command)


def _watch_parent(parent: int) -> None:
    """Exit this rank when rank 0 is gone (its pid is no longer our parent: it died, or was killed with
    its actor). Polled rather than PR_SET_PDEATHSIG, which fires when the *thread* that started the
    child ends, and an actor may start its ranks from a thread that ends long before the actor."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    print(f"bm rank (pid {os.getpid()}): rank 0 (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def main() -> None:
    """A rank other than 0, from :data:`SPEC_ENV` and torchrun's variables; never returns."""
    parent = int(os.environ[PARENT_ENV])
    if os.getppid() != parent:  # rank 0 died before this rank even started
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="bm-parent-watch").start()
    spec: dict[str, Any] = json.loads(os.environ[SPEC_ENV])
    if spec.get("threads"):
        import torch

        torch.set_num_threads(int(spec["threads"]))
    from bm.distributed.cli import start

    start(config_from_dict(spec["config"]), int(spec["tensor_parallel"]), 1, float(spec["rank_timeout_s"]))
    os._exit(1)  # start() exits a rank other than 0 itself; being rank 0 here is a launcher bug


if __name__ == "__main__":
    main()
