"""The driver's Ray connection: made where the caller has none, and ended only once Ray Data has let go.

Ray Data runs a dataset on threads of the driver's: the scheduling loop (``StreamingExecutor-<dataset>``,
with a ``ray-data-metadata-prefetch`` helper) and, behind the row iterator, a worker that fetches the
blocks (``iter_threaded``). Closing the iterator, as an interrupted run does, only asks them to stop:
Ray Data waits 2 s for the loop and not at all for the fetcher, whose ``ray.get`` may be waiting on a
block still being made. A thread that touches the core worker once ``ray.shutdown()`` has
run makes Ray end the whole process with status 1 ("The core worker has already been shutdown"): an
interrupted ``bm run --ray`` then exited 1 instead of 130, its records written but its exit code wrong
(seen on CI's 2 busy cores). So the connection is ended only after those threads have.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bm.reaper import watch

# The names Ray Data gives the threads of one dataset's run (ray 2.60: execution/streaming_executor.py,
# execution/metadata_fetcher.py, block_batching/util.py). Not its usage poller nor its block
# ``Prefetcher``, which stay parked for the life of the process (seen after an interrupted run): waiting
# for them would only ever end at the deadline, and parked they touch nothing.
RAY_DATA_THREADS = ("StreamingExecutor-", "ray-data-metadata-prefetch", "iter_threaded")
# The raylet's worker_niceness, read from the environment of the cluster's processes (ray_constants.py)
WORKER_NICENESS = "RAY_worker_niceness"


def connect(address: str | None) -> bool:
    """Connect to Ray at ``address`` (``None``: ``RAY_ADDRESS`` or a local cluster) unless this process
    already is; whether it connected here (and so should :func:`disconnect`)."""
    import ray

    if ray.is_initialized():
        return False  # the caller's own connection, left as it is
    kept = _signal_handlers()
    # A cluster started here runs in processes started from this driver; if the driver is SIGKILLed, two
    # of Ray's node agents outlive it for ever. bm.reaper ends them (watching starts before they do).
    watch()
    if address is None and "RAY_ADDRESS" not in os.environ:
        # Ray starts its workers at nice 15, below everything else on the machine; the replicas are
        # those workers, so beside two busy loops on two cores they got a few percent of a core each and
        # a 30-second run took 20 minutes (bm run without --ray: about twice its quiet time). A cluster
        # started for this run runs its workers at the driver's priority instead, unless the user set
        # RAY_worker_niceness; a cluster of the user's keeps its own settings.
        os.environ.setdefault(WORKER_NICENESS, "0")
    with _ray_leaves_sigterm_alone():
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    # the process's own policy (bm.cli.interrupts) stays in charge, whatever ray.init set
    for sig, handler in kept.items():
        signal.signal(sig, handler)
    return True


@contextmanager
def _ray_leaves_sigterm_alone() -> Iterator[None]:
    """``ray.init`` first installs a SIGTERM handler of its own (``sys.exit(15)``), then starts the
    cluster, seconds on a loaded machine: a SIGTERM then ended ``bm run --ray`` with status 15, no
    records assembled and no resume command (1 of the first 2 SIGTERMs of a busy soak, 10.6 s in).
    Within this block Ray's installer (``ray._private.utils.set_sigterm_handler``, which ``init`` looks
    up when it runs) does nothing, so bm's handler stays in place and the signal stops the run as any
    other; where a Ray version has no such function, nothing changes."""
    try:
        from ray._private import utils as ray_utils
    except ImportError:
        ray_utils = None
    installer = getattr(ray_utils, "set_sigterm_handler", None)
    if installer is None:
        yield
        return
    ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = installer


def _signal_handlers() -> dict[int, Any]:
    """SIGINT's and SIGTERM's Python handlers, when this thread may set them again (the main one)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        sig: handler
        for sig in (signal.SIGINT, signal.SIGTERM)
        if (handler := signal.getsignal(sig)) is not None
    }


def wait_for_ray_data_threads(timeout_s: float = 30.0) -> list[str]:
    """Wait, up to ``timeout_s`` in all, for Ray Data's dataset threads to end; the names of any still
    running at the deadline (disconnecting then is no worse than not waiting)."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and thread.name.startswith(RAY_DATA_THREADS):
            thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(RAY_DATA_THREADS)]


def disconnect() -> None:
    """End a connection made by :func:`connect`, once no Ray Data thread can touch it any more, and give
    SIGINT and SIGTERM back to the handlers Python lists for them.

    ``ray.shutdown()`` puts SIGTERM's action in the process back to the default while Python's table
    still names bm's handler: a SIGTERM after it (the run assembling ``outputs.jsonl``, writing
    ``summary.json``) killed the process with -15 instead of the interrupt policy's orderly stop (one
    of the first three trials of a busy soak). Setting each handler again installs it in the kernel."""
    import ray

    wait_for_ray_data_threads()
    handlers = _signal_handlers()
    ray.shutdown()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
