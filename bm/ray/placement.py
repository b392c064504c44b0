"""Where ``bm run --ray``'s replicas go: how many, what each reserves of the cluster, and the actor pool
Ray Data runs them as. Kept apart from the driver, which moves blocks and records.
"""

from __future__ import annotations

from typing import Any

from bm.parallel.layout import ParallelError

DEFAULT_CPU_THREADS = 4  # torch threads of a CPU replica when neither the count nor the threads are given


def replica_layout(
    resources: dict[str, float],
    replicas: int | None,
    threads: int | None,
    device: str,
    tensor_parallel: int = 1,
) -> tuple[int, float, float, int | None]:
    """``(replicas, num_cpus, num_gpus, torch threads)`` per replica from the cluster's resources: a GPU
    per rank where the cluster has GPUs (and the model is not pinned to the CPU), else CPU replicas of
    ``threads`` threads per rank (:data:`DEFAULT_CPU_THREADS`, or the CPUs split over ``replicas`` x
    ``tensor_parallel`` ranks). A replica never reserves more than its share of the CPUs, so every
    replica of the pool can start; a tensor-parallel replica takes whole GPUs (one per rank), so the
    replicas must fit the cluster's GPUs (a :class:`ParallelError` naming ``--replicas`` otherwise)."""
    cpus = max(int(resources.get("CPU", 1)), 1)
    gpus = int(resources.get("GPU", 0))
    tp = tensor_parallel
    if gpus >= 1 and device != "cpu":
        if tp == 1:
            count = replicas or gpus
            return count, min(1.0, cpus / count), 1.0 if count <= gpus else gpus / count, threads
        count = replicas or gpus // tp
        if not count or count * tp > gpus:
            raise ParallelError(
                f"--replicas {count} x --tensor-parallel {tp} needs {max(count, 1) * tp} GPUs, and the Ray "
                f"cluster has {gpus}: give --replicas {gpus // tp} or fewer"
                if gpus >= tp
                else f"--tensor-parallel {tp}: a replica takes {tp} GPUs of one node, and the Ray cluster has "
                f"{gpus}; give --tensor-parallel {gpus} or fewer (or add GPUs to the cluster)"
            )
        return count, min(float(tp), cpus / count), float(tp), threads
    if threads is None:
        threads = (
            max(1, cpus // (replicas * tp)) if replicas else min(DEFAULT_CPU_THREADS, max(1, cpus // tp))
        )
    count = replicas or max(1, cpus // (threads * tp))
    return count, min(float(threads * tp), cpus / count), 0.0, threads


def pool_strategy(replicas: int, alone: bool) -> Any:
    """A fixed pool of ``replicas`` actors. Each runs up to two blocks at once into one engine session
    (where this Ray supports concurrent calls on an actor), so its batch stays full across blocks; when
    lines are tried ``alone``, an actor holds one block at a time, so a line that kills its process
    never costs another line a try."""
    from ray.data import ActorPoolStrategy

    from bm.ray.replica import BLOCKS_PER_REPLICA

    if alone:
        return ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1)
    try:
        return ActorPoolStrategy(
            size=replicas, max_concurrent_calls_per_actor=BLOCKS_PER_REPLICA, enable_true_multi_threading=True
        )
    except TypeError:  # an older Ray: one block at a time per replica
        return ActorPoolStrategy(size=replicas)
