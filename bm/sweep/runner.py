"""Running a sweep: every configuration's load search, its points run (in parallel processes under the
simulator), each finished point saved at once so an interrupted sweep resumes without rerunning any.

A point is one ``bm bench`` run of one configuration at one load, through the same runner
(:func:`bm.bench.run_bench`, which hands simulated runs to the simulator's driver), so its metrics are
``bm bench``'s. Load means request rate (Poisson with the config's burstiness), concurrency (every
request at t=0, at most N in flight) or trace speed-up (the dataset's timestamps, gaps divided by N).

Under the simulator a point is deterministic, so one run decides it. On the real engine a point runs
``repeats`` times; each SLO metric is the median over the repeats, and the point is feasible when those
medians meet every limit and no run lost a request (documented in docs/sweep.md).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bm.config import BmConfig, ConfigError
from bm.files import append_whole, trim_torn_tail
from bm.sweep.grid import GridConfig
from bm.sweep.search import EarlyStop, LoadSearch, Slo

LOADS = ("rate", "concurrency", "trace")
POINTS_FILE = "points.jsonl"


@dataclass
class Point:
    """One configuration at one load: the SLO figures, the verdict and every ``bm bench`` metric."""

    config: str
    load: float
    feasible: bool
    slo_values: dict[str, float | None]
    metrics: dict[str, Any]
    repeats: int = 1

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class SweepPlan:
    configs: list[GridConfig]
    slo: Slo
    load: str = "rate"
    precision: float = 0.05
    start: float | None = None
    min_load: float | None = None
    repeats: int = 1
    workers: int = 1
    early_stop: bool = True


@dataclass
class ConfigOutcome:
    name: str
    settings: dict[str, Any]
    max_load: float | None  # None: no load tried was feasible
    points: list[Point] = field(default_factory=list)

    def best(self) -> Point | None:
        feasible = [p for p in self.points if p.feasible]
        return max(feasible, key=lambda p: p.load) if feasible else None


def load_config_for(config: BmConfig, kind: str, load: float) -> BmConfig:
    """The config of one point: ``config`` with its arrival process set to ``load``."""
    bench = config.bench
    if kind == "rate":
        bench = dataclasses.replace(bench, request_rate=load, trace_timestamps=False, max_concurrency=None)
    elif kind == "concurrency":
        bench = dataclasses.replace(
            bench, request_rate=None, trace_timestamps=False, max_concurrency=int(load)
        )
    elif kind == "trace":
        bench = dataclasses.replace(bench, trace_timestamps=True, time_scale=1.0 / load, max_concurrency=None)
    else:
        raise ConfigError(f"--load {kind!r}: use one of {', '.join(LOADS)}")
    return dataclasses.replace(config, bench=bench)


# -- one point -------------------------------------------------------------------------------------------

# What every point of this process shares (the model and the workload, loaded once); a forked worker
# inherits it, so a task carries only a config and a load.
_SHARED: dict[str, Any] = {}


def run_point(grid: GridConfig, kind: str, load: float, slo: Slo, repeats: int, early_stop: bool) -> Point:
    """Run one point (``repeats`` times on the real engine) and judge it against ``slo``."""
    from bm.bench import run_bench

    model, workload = _SHARED["model"], _SHARED["workload"]
    config = load_config_for(grid.config, kind, load)
    sim = config.engine.executor == "sim"
    if sim:
        from bm.bench.simulated import load_sim_model, run_sim

        model = _sim_model(config, load_sim_model)
        stop = EarlyStop(slo, len(workload.requests)) if early_stop else None
        result = run_sim(config, model, workload, stop=stop)
        values = slo.values(result.requests)
        failed = int(result.metrics.get("failed") or 0)
        metrics = _plain(result.metrics) | {"num_devices": model.tensor_parallel}  # per-device figures
        if stop is not None and metrics.get("stopped_early"):
            metrics |= _not_run(result.not_run, failed, stop)
        return Point(grid.name, load, slo.feasible(values, failed), values, metrics)
    runs = [run_bench(config, model, workload) for _ in range(repeats)]
    per_run = [slo.values(r.requests) for r in runs]
    values = {name: _median([v[name] for v in per_run]) for name in slo.limits}
    failed = max(int(r.metrics.get("failed") or 0) for r in runs)
    metrics = _plain(runs[len(runs) // 2].metrics)
    return Point(grid.name, load, slo.feasible(values, failed), values, metrics, repeats)


def _not_run(not_run: int, failed: int, stop: EarlyStop) -> dict[str, Any]:
    """A point stopped early: the ``not_run`` requests it never finished are not run, not failed
    (``failed`` keeps the requests that really failed), and ``stopped_on`` names why it stopped: the SLO
    metrics certain to be missed, or ``failed``. The point stays infeasible: it stopped because it
    missed."""
    return {"failed": failed - not_run, "not_run": not_run, "stopped_on": ",".join(stop.reasons())}


def _sim_model(config: BmConfig, load: Callable[[BmConfig], Any]) -> Any:
    """The simulated model for this config's hardware and tensor parallelism (cached per process)."""
    key = (config.sim.hardware, config.sim.tensor_parallel, config.model.dtype)
    cache = _SHARED.setdefault("sim_models", {})
    if key not in cache:
        cache[key] = load(config)
    return cache[key]


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    from bm.bench.results import json_safe

    return json_safe({k: v for k, v in metrics.items() if not isinstance(v, (list, dict))})


def _task(args: tuple[GridConfig, str, float, Slo, int, bool]) -> Point:
    return run_point(*args)


# -- the store: finished points, one JSON line each ------------------------------------------------------


class PointStore:
    """``points.jsonl`` in the output directory: appended as each point finishes, read on resume."""

    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / POINTS_FILE
        self.points: dict[tuple[str, float], Point] = {}
        self._end = trim_torn_tail(self.path)  # a sweep killed mid-write left part of a line: it reruns
        if self.path.exists():
            for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    point = Point(**json.loads(line))
                except (ValueError, TypeError) as exc:
                    raise ConfigError(f"{self.path}: line {number} is not a sweep point ({exc}); "
                                      "remove the line or the file to rerun that point") from None  # fmt: skip
                self.points[(point.config, point.load)] = point

    def get(self, config: str, load: float) -> Point | None:
        return self.points.get((config, load))

    def add(self, point: Point) -> None:
        self.points[(point.config, point.load)] = point
        with self.path.open("ab", buffering=0) as f:  # a whole line, or none (a full disk)
            self._end = append_whole(f, (json.dumps(point.to_json()) + "\n").encode(), self._end, self.path)


# -- the sweep -------------------------------------------------------------------------------------------


def run_sweep(
    plan: SweepPlan,
    model: Any,
    workload: Any,
    store: PointStore,
    on_point: Callable[[Point, bool], None] | None = None,
) -> list[ConfigOutcome]:
    """Search every configuration's highest feasible load; ``on_point(point, reused)`` after each point.

    Simulated points run in ``plan.workers`` forked processes, each configuration's next point submitted
    as soon as its last one is judged; real points run one at a time in this process (they would share
    the CPU and measure each other)."""
    _SHARED.update(model=model, workload=workload)
    searches = {g.name: _search(plan, g.config) for g in plan.configs}
    grids = {g.name: g for g in plan.configs}
    outcomes = {g.name: ConfigOutcome(g.name, g.settings, None) for g in plan.configs}

    def judge(name: str, point: Point, reused: bool) -> None:
        if not reused:
            store.add(point)
        searches[name].record(point.load, point.feasible)
        outcomes[name].points.append(point)
        if on_point is not None:
            on_point(point, reused)

    def next_load(name: str) -> float | None:
        """The search's next load, after replaying the finished points it asks for (resume)."""
        load = searches[name].next_load()
        while load is not None and (cached := store.get(name, load)) is not None:
            judge(name, cached, reused=True)
            load = searches[name].next_load()
        return load

    def task(name: str, load: float) -> tuple[GridConfig, str, float, Slo, int, bool]:
        return grids[name], plan.load, load, plan.slo, plan.repeats, plan.early_stop

    sim = all(g.config.engine.executor == "sim" for g in plan.configs)
    if sim and plan.workers > 1:
        from bm.bench.simulated import load_sim_model

        # Every configuration's simulated model loaded here, before the workers fork: a local row's
        # forward fit is then measured once, in this process, not by every worker at once on a shared
        # device (nor on CUDA in a forked child, which cannot initialise it again).
        for g in plan.configs:
            _sim_model(g.config, load_sim_model)
    if not sim or plan.workers <= 1:
        for name in grids:
            while (load := next_load(name)) is not None:
                judge(name, run_point(*task(name, load)), reused=False)
    else:
        _run_parallel(list(grids), next_load, task, judge, plan.workers)
    for name, outcome in outcomes.items():
        outcome.max_load = searches[name].feasible_at
        outcome.points.sort(key=lambda p: p.load)
    return list(outcomes.values())


def _run_parallel(
    names: list[str],
    next_load: Callable[[str], float | None],
    task: Callable[[str, float], tuple[Any, ...]],
    judge: Callable[[str, Point, bool], None],
    workers: int,
) -> None:
    """Each configuration's next point is submitted as soon as its last one is judged; forked workers
    inherit the loaded model and workload instead of loading them again."""
    pending: dict[Future, str] = {}
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_signals
    )
    try:
        ready = names
        while ready or pending:
            for name in ready:
                load = next_load(name)
                if load is not None:
                    pending[pool.submit(_task, task(name, load))] = name
            ready = []
            if pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for future in done:
                    name = pending.pop(future)
                    judge(name, future.result(), False)
                    ready.append(name)
    except BaseException:  # an interrupt: the points in progress are dropped (--resume runs them again)
        workers_left = list(getattr(pool, "_processes", {}).values())  # the executor keeps no public list
        pool.shutdown(wait=False, cancel_futures=True)
        for process in workers_left:
            process.kill()
        raise
    pool.shutdown(wait=True)


def _worker_signals() -> None:
    """A forked worker ignores SIGINT and SIGTERM: Ctrl-C on a terminal reaches the whole process group,
    and a worker that raised on it broke the pool; the parent decides, and kills the workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _search(plan: SweepPlan, config: BmConfig) -> LoadSearch:
    """A configuration's search; it gives up below ``min_load`` (default: the start / 32, five
    halvings), where a configuration that still misses the SLO misses it at any load worth serving."""
    integer = plan.load == "concurrency"
    start = plan.start or (16.0 if integer else 4.0)
    floor = plan.min_load or (1.0 if integer else start / 32)
    return LoadSearch(start, plan.precision, integer=integer, min_load=floor)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
