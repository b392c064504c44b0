"""One benchmark run: warm up, replay the workload against the arrival clock, measure every request.

:func:`run_bench` is the whole library entry point and never touches the terminal or a file, so
``bm compare`` can call it once per variant (scheme, policy) on the identical workload and arrival
times in one process, with one loaded model. It owns one :class:`BatchManager` per run and points its
callbacks at the current phase's :class:`Replayer` (warm-up, then the measured replay), so warm-up
requests never leak into the results. Every request ends with exactly one record: completed, failed by
the engine, refused at load, or failed because the run was interrupted. Records and stats rows go to
the caller's journal as they come; the run keeps only their tallies (:mod:`bm.bench.tally`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bm.bench.journal import BenchJournal, RunFeed
from bm.bench.replayer import FIELD_ALIASES, Replayer, build_requests
from bm.bench.results import BenchResult, ReplayProgress, bench_result, records_frame, snapshot
from bm.bench.sizing import size_cache, workload_cache
from bm.config import BmConfig, resolve_engine
from bm.distributed.engine import engine_loop
from bm.engine import EngineLoop, Request, Response
from bm.scheduling import FinishReason
from bm.workloads import Workload, arrival_times

if TYPE_CHECKING:  # bm.runtime imports torch, which a simulated run never needs
    from bm.runtime import LoadedModel

__all__ = [
    "FIELD_ALIASES",
    "BenchResult",
    "ReplayProgress",
    "build_requests",
    "records_frame",
    "run_bench",
]

_POLL_S = 0.1

CANCELLED = FinishReason.CANCELLED.label


class _Router:
    """The batch manager's callbacks, forwarded to whichever replayer is current."""

    def __init__(self) -> None:
        self.replayer: Replayer | None = None
        self.stats: deque[str] | None = None  # the measured replay's stats lines not yet taken

    def get_requests(self, max_new: int) -> list[Request]:
        replayer = self.replayer
        return replayer.get_requests(max_new) if replayer is not None else []

    def send_response(self, response: Response) -> None:
        if self.replayer is not None:
            self.replayer.send_response(response)

    def return_stats(self, line: str) -> None:
        if self.stats is not None:
            self.stats.append(line)  # the batch manager's thread; taken on the caller's (deque: thread-safe)


def _taker(lines: deque[str]) -> Callable[[], list[dict[str, Any]]]:
    """The stats rows parsed from the lines that came since the last call, the lines let go."""

    def take() -> list[dict[str, Any]]:
        rows = []
        while lines:
            rows.append(json.loads(lines.popleft()))
        return rows

    return take


def run_bench(
    config: BmConfig,
    model: LoadedModel,
    workload: Workload,
    arrivals: Sequence[float] | None = None,
    *,
    progress: Callable[[ReplayProgress], None] | None = None,
    journal: BenchJournal | None = None,
    stop: threading.Event | None = None,
) -> BenchResult:
    """Replay ``workload`` through a fresh batch manager and measure it.

    ``arrivals`` holds one time (seconds after the replay starts) per row of ``workload.requests``;
    by default they come from ``config.bench`` (:func:`bm.workloads.arrival_times`). Pass the same list
    to several runs to compare them on identical arrivals. ``progress`` is called from the calling
    thread about ten times a second, and so is ``journal`` (see :mod:`bm.bench.journal`) with the
    measured replay's new stats rows and finished requests' records, the only place they go: the run
    keeps their tallies (``result.requests``, ``result.iterations``), so its memory does not grow with
    its length. ``stop`` (set by the command's first signal, bm.cli.interrupts), or Ctrl-C where
    nothing else handles it, ends the run early with every record given: what had not finished is
    cancelled.
    """
    config = sized_for(config, model, workload)
    if config.engine.executor == "sim":  # the simulator: same replay on a virtual clock (bm.bench.simulated)
        from bm.bench.simulated import run_sim

        return run_sim(config, model, workload, arrivals, progress=progress, journal=journal, interrupt=stop)
    bench = config.bench
    times = list(arrivals) if arrivals is not None else arrival_times(workload, bench)
    if len(times) != len(workload.requests):
        raise ValueError(f"{len(times)} arrival times for {len(workload.requests)} requests")
    built = build_requests(workload, None if bench.ignore_eos else model.eos_token_id, run_seed=bench.seed)
    replayer = Replayer(
        [r for _, r in built], [times[i] for i, _ in built], max_concurrency=bench.max_concurrency
    )
    router = _Router()
    stats_lines: deque[str] = deque()  # appended on the batch manager's thread, parsed on this one
    feed = RunFeed(workload, built, replayer, _taker(stats_lines), journal)
    interrupted = False
    built_at = time.perf_counter()
    manager = engine_loop(
        config, router.get_requests, router.send_response, return_stats=router.return_stats, model=model
    )
    core = manager.core  # its config is resolved for the model's device: what the results record
    startup = {"engine_build_s": time.perf_counter() - built_at, "warmup": core.warmup}
    try:
        if bench.warmup and built:
            warm = Replayer([r for _, r in built[: bench.warmup]], [0.0] * min(bench.warmup, len(built)))
            router.replayer = warm
            warm.start()
            interrupted = _drain(manager, warm, None, None, stop)
        if interrupted:
            replayer.fail_unfinished(
                "the run was interrupted during warm-up; this request was never sent", CANCELLED
            )
        else:
            router.replayer, router.stats = replayer, stats_lines
            replayer.start()
        interrupted |= _drain(manager, replayer, progress, feed, stop)
    finally:
        manager.shutdown(cancel=True)

    feed.finish()  # what came after the last poll: the stream ends equal to the results
    result = bench_result(
        core.config,
        model.name,
        workload,
        replayer,
        feed,
        runtime=_runtime_info(model.device, model.dtype, getattr(model, "quantization", None)),
        interrupted=interrupted,
    )
    result.startup, result.warnings = startup, list(core.warnings)
    return result


def sized_for(config: BmConfig, model: Any, workload: Workload) -> BmConfig:
    """``config`` with its budgets resolved for the model's device and, unless ``kv_cache.max_tokens`` is
    set, its KV cache sized for ``workload`` (:mod:`bm.bench.sizing`): what ``bm bench`` runs, so a
    library caller of :func:`run_bench` gets the same run as the command."""
    resolved = resolve_engine(config, model.device_type)
    return size_cache(resolved, workload_cache(workload, [resolved]))


def _drain(
    manager: EngineLoop,
    replayer: Replayer,
    progress: Callable[[ReplayProgress], None] | None,
    feed: RunFeed | None,
    stop: threading.Event | None = None,
) -> bool:
    """Wait until every request of ``replayer`` has its final record, reporting progress and feeding
    the journal every poll; returns whether ``stop`` or Ctrl-C cut it short."""
    interrupted = False
    while not replayer.done:
        if stop is not None and stop.is_set() and not interrupted:
            interrupted = True
            replayer.fail_unfinished("the run was interrupted before this request finished", CANCELLED)
            manager.cancel_all()
        try:
            if not replayer.wait(_POLL_S) and not manager.is_alive():
                replayer.fail_unfinished(f"the batch manager stopped ({manager.error or 'no error given'})")
            if feed is not None:
                feed.pump()
            if progress is not None:
                progress(snapshot(replayer))
        except KeyboardInterrupt:
            interrupted = True
            replayer.fail_unfinished("the run was interrupted before this request finished", CANCELLED)
            manager.cancel_all()
    if progress is not None:
        progress(snapshot(replayer))
    return interrupted


def _runtime_info(device: Any, dtype: Any, weights: str | None) -> dict[str, Any]:
    from bm.runtime.native import runtime_info

    return runtime_info(device, dtype, weights)
