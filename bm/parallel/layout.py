"""Which rank this process is, how the ranks split into tensor- and data-parallel groups, and starting
them: under ``torchrun`` (its environment says the rank) or launched by bm itself.

Ranks are laid out tensor-parallel innermost: rank ``r`` is shard ``r % tp`` of replica ``r // tp``, so
one replica's shards are neighbours (one machine, fastest links) and replicas may span machines.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


class ParallelError(ValueError):
    """A multi-rank setting that cannot work; the message names the setting and the fix."""


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int = 1
    data_parallel: int = 1
    rank: int = 0
    rank_timeout_s: float = 300.0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.data_parallel

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tensor_parallel

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel

    @property
    def tp_ranks(self) -> list[int]:
        """The global ranks of this rank's replica (its tensor-parallel group)."""
        first = self.dp_rank * self.tensor_parallel
        return list(range(first, first + self.tensor_parallel))

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def to_dict(self) -> dict[str, int]:
        return {
            "tensor_parallel": self.tensor_parallel,
            "data_parallel": self.data_parallel,
            "world_size": self.world_size,
        }


@dataclass
class _State:
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    children: list[subprocess.Popen] = field(default_factory=list)
    tp_group: Any = None
    replicas: list[dict[str, Any]] = field(default_factory=list)  # rank 0: per-replica figures
    fault: str | None = None  # rank 0: why the run ended early
    kv_heads_per_rank: list[int] = field(default_factory=list)  # rank 0's KV heads per layer (distinct)
    device_type: str = "cpu"  # where the model runs: "cuda" puts tensor collectives on NCCL
    barrier_group: Any = None  # gloo: monitored_barrier exists only there
    exit_on_fault: bool = False  # a failed rank ends this process, not only the run (exit_on_rank_fault)


_state = _State()


def current_layout() -> ParallelLayout:
    return _state.layout


def parallel_info() -> dict[str, Any]:
    """The rank layout (and, on rank 0 after a multi-rank run, every replica's figures) for
    summary.json / results.json; a single-process run records its 1 x 1 layout too."""
    info: dict[str, Any] = dict(_state.layout.to_dict())
    if _state.replicas:
        info["replicas"] = [dict(r) for r in _state.replicas]
    if _state.kv_heads_per_rank:
        info["kv_heads_per_rank"] = list(_state.kv_heads_per_rank)
    if _state.fault:
        info["fault"] = _state.fault
    return info


def run_fault() -> str | None:
    """Why the last multi-rank run ended early (a rank died or hung), or None."""
    return _state.fault


def validate(tensor_parallel: int, data_parallel: int | None, rank_timeout_s: float) -> None:
    if tensor_parallel < 1:
        raise ParallelError(f"--tensor-parallel is {tensor_parallel}; give 1 or more ranks per replica")
    if data_parallel is not None and data_parallel < 1:
        raise ParallelError(f"--data-parallel is {data_parallel}; give 1 or more replicas")
    if rank_timeout_s <= 0:
        raise ParallelError(f"--rank-timeout is {rank_timeout_s}; give a positive number of seconds")


def setup_parallel(
    tensor_parallel: int = 1,
    data_parallel: int | None = None,
    rank_timeout_s: float = 300.0,
    device: str = "cpu",
    rank_command: RankCommand | None = None,
) -> ParallelLayout:
    """Join (or start) the ranks of this run and return this process's place among them.

    Under ``torchrun`` the world comes from its environment and ``data_parallel`` defaults to
    ``WORLD_SIZE / tensor_parallel``. Otherwise bm starts the other ranks itself as child processes
    re-running this command line (or running ``rank_command``, for a process that has no bm command
    line to rerun: a Ray actor), and this process becomes rank 0. ``rank_timeout_s`` bounds every
    exchange between ranks: a rank that dies or hangs ends the run within it instead of hanging it.
    ``device`` (model.device): on CUDA each rank takes ``cuda:LOCAL_RANK`` and tensors travel by NCCL.
    """
    validate(tensor_parallel, data_parallel, rank_timeout_s)
    _state.device_type = _device_type(device)
    if "WORLD_SIZE" in os.environ:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        if world % tensor_parallel:
            raise ParallelError(
                f"--tensor-parallel {tensor_parallel} does not divide the {world} ranks torchrun started; "
                "start a multiple of it (--nproc-per-node x --nnodes)"
            )
        if data_parallel is not None and data_parallel * tensor_parallel != world:
            raise ParallelError(
                f"--data-parallel {data_parallel} x --tensor-parallel {tensor_parallel} is not the {world} "
                "ranks torchrun started; leave --data-parallel out (it defaults to the ranks left) or match it"
            )
        layout = ParallelLayout(tensor_parallel, world // tensor_parallel, rank, rank_timeout_s)
    else:
        layout = ParallelLayout(tensor_parallel, data_parallel or 1, 0, rank_timeout_s)
        if layout.is_distributed:
            _launch_children(layout, rank_command)
    _state.layout = layout
    if layout.is_distributed:
        if _state.device_type == "cuda":
            import torch

            torch.cuda.set_device(local_cuda_index())
        _init_process_group(layout)
    return layout


def _device_type(device: str) -> str:
    """``cuda`` for cuda, cuda:N, or auto where a GPU is present; otherwise ``cpu``."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def local_cuda_index() -> int:
    """This rank's GPU on its machine: ``LOCAL_RANK`` (set by torchrun and by bm's own launcher; 0 in a
    single-process run), so that every rank of a machine gets a GPU of its own."""
    index = int(os.environ.get("LOCAL_RANK", "0"))
    import torch

    count = torch.cuda.device_count()
    if count and index >= count:
        raise ParallelError(
            f"this rank's LOCAL_RANK is {index} but the machine has {count} GPUs; start at most {count} "
            "ranks per machine (--nproc-per-node, or --tensor-parallel x --data-parallel)"
        )
    return index


def process_group_backend(device_type: str) -> str:
    """gloo for bm's own exchanges (Python objects, on the CPU) everywhere; on CUDA the model's tensor
    collectives go over NCCL in the same group (torch picks the backend by the tensor's device)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def mesh_device_type() -> str:
    """The device type of this run's device mesh (tensor-parallel sharding): where the model is."""
    return _state.device_type


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHED_BY_BM = "BM_LAUNCHED_RANK"


@dataclass(frozen=True)
class RankCommand:
    """How to start ranks 1..N-1 where rerunning this process's command line would not start a rank (a
    Ray actor's command line is Ray's worker): the command, and variables to add to its environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def _launch_children(layout: ParallelLayout, command: RankCommand | None = None) -> None:
    """Ranks 1..N-1 re-run this very command line (``python -m bm ...``), or run ``command``, with
    torchrun's variables."""
    port = str(_free_port())
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_WORLD_SIZE": str(layout.world_size),
    }
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    argv = command.argv if command else [sys.executable, "-m", "bm", *sys.argv[1:]]
    extra = command.env if command else {}
    for rank in range(1, layout.world_size):
        env = {
            **os.environ,
            **extra,
            **common,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            LAUNCHED_BY_BM: "1",
        }
        # Rank 0 owns the terminal; the others' progress would only garble it (errors still show).
        _state.children.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
    atexit.register(_reap_children)


def exit_on_rank_fault() -> None:
    """From now on a rank that fails ends this whole process (status 1), not just the run.

    For a rank 0 whose caller retries work by restarting its process (a Ray actor: Ray restarts it and
    retries its blocks): the run's own answer to a fault, an error response for every unfinished
    request, would be final records there. A rank bm started that exits (it died, or failed to start)
    is seen at once by a thread watching them; a rank that fails in a collective, by the engine
    (:meth:`bm.distributed.engine.DistributedEngineLoop._fail_everything` calls :func:`exit_for_fault`)."""
    _state.exit_on_fault = True
    threading.Thread(target=_watch_children, daemon=True, name="bm-rank-watch").start()


def exit_for_fault(message: str) -> None:
    """End this process at once, saying why; :func:`exit_on_rank_fault` processes only."""
    print(
        f"bm rank 0 (pid {os.getpid()}): exiting, so that the work it held is retried: {message}",
        file=sys.stderr,
        flush=True,
    )
    for child in _state.children:  # ranks whose peer is gone have nothing left to serve
        with contextlib.suppress(OSError):
            child.kill()
    os._exit(1)


def _watch_children(poll_s: float = 0.2) -> None:
    while _state.exit_on_fault:
        for rank, child in enumerate(list(_state.children), start=1):
            code = child.poll()
            if code is not None and _state.exit_on_fault:
                exit_for_fault(f"rank {rank} (pid {child.pid}) exited with status {code}")
        time.sleep(poll_s)


def launched_ranks() -> list[int]:
    """The process ids of the ranks this process started (rank 1 first); empty for any other rank."""
    return [child.pid for child in _state.children]


def _reap_children(grace_s: float = 10.0) -> None:
    """Wait briefly for the ranks bm started, then end any still running (a hung or orphaned rank).

    A process that exits on a rank fault (a Ray replica) is never told to stop its run: its ranks wait
    for its next round, so they are ended at once, and no longer watched (their end is not a fault)."""
    if _state.exit_on_fault:
        _state.exit_on_fault, grace_s = False, 0.0
    deadline = time.monotonic() + grace_s
    for child in _state.children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# How long ranks wait for each other to start and load the model (imports and a large checkpoint can take
# minutes); --rank-timeout then bounds every exchange of the run itself.
STARTUP_TIMEOUT_S = 900.0


def _init_process_group(layout: ParallelLayout) -> None:
    """Rendezvous with the startup timeout, then a group (gloo; gloo and NCCL on CUDA) whose collectives time out after
    ``rank_timeout_s``: a rank slow to import torch is not a fault, a rank silent mid-run is."""
    import torch.distributed as dist

    startup = timedelta(seconds=max(STARTUP_TIMEOUT_S, layout.rank_timeout_s))
    timeout = timedelta(seconds=layout.rank_timeout_s)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store: Any
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent already serves one
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(
            f"/worker/attempt_{attempt}", dist.TCPStore(host, port, layout.world_size, False, startup)
        )
    else:
        store = dist.TCPStore(host, port, layout.world_size, layout.rank == 0, startup)
    dist.init_process_group(
        process_group_backend(_state.device_type),
        store=store,
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    # monitored_barrier is gloo-only: under the mixed CUDA backend it gets a gloo group of its own
    _state.barrier_group = None if _state.device_type == "cpu" else dist.new_group(backend="gloo")
    tp = layout.tensor_parallel
    for first in range(0, layout.world_size, tp):  # every rank must create every group
        group = dist.new_group(list(range(first, first + tp)), timeout=timeout)
        if first == layout.dp_rank * tp:
            _state.tp_group = group


def wait_for_all_ranks() -> None:
    """Every rank has loaded its model: from here on each exchange gets only ``--rank-timeout``."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.monitored_barrier(
            group=_state.barrier_group,
            timeout=timedelta(seconds=max(STARTUP_TIMEOUT_S, _state.layout.rank_timeout_s)),
        )


def tp_group() -> Any:
    return _state.tp_group


def finish_parallel() -> None:
    """Leave the process group (rank 0 also waits for the ranks it started)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # a dead peer: nothing left to leave cleanly
            dist.destroy_process_group()
    if _state.children:
        _reap_children(0.0 if _state.fault else 10.0)
