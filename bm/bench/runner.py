"""One benchmark run: warm up, replay the workload against the arrival clock, collect every request.

:func:`run_bench` is the whole library entry point and never touches the terminal or a file, so
``bm compare`` can call it once per variant (scheme, policy) on the identical workload and arrival
times in one process, with one loaded model. It owns one :class:`BatchManager` per run and points its
callbacks at the current phase's :class:`Replayer` (warm-up, then the measured replay), so warm-up
requests never leak into the results. Every request ends with exactly one record: completed, failed by
the engine, refused at load, or failed because the run was interrupted.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from bm.bench.metrics import RECORD_COLUMNS, engine_metrics, request_record, run_metrics
from bm.bench.replayer import Replayer
from bm.config import BmConfig
from bm.distributed.engine import engine_loop
from bm.engine import EngineLoop, Request, Response
from bm.workloads import ArrivalPlan, Workload, arrival_times

if TYPE_CHECKING:  # bm.runtime imports torch, which a simulated run never needs
    from bm.runtime import LoadedModel

# vLLM's names for request fields, accepted in bm JSONL rows as in `bm run`.
FIELD_ALIASES = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "seed": "random_seed"}
_POLL_S = 0.1


@dataclass(frozen=True)
class ReplayProgress:
    """A snapshot for a progress display: counts since the measured replay started."""

    num_requests: int
    num_finished: int
    num_output_tokens: int
    elapsed_s: float


@dataclass
class BenchResult:
    """Everything one run measured, plus what it ran (for the results document)."""

    records: pd.DataFrame  # one row per request of the workload, in workload order
    stats: list[dict[str, Any]]  # per-iteration stats of the measured replay
    metrics: dict[str, Any]  # run_metrics + engine_metrics, vllm bench serve's key names
    duration_s: float
    interrupted: bool = False
    config: BmConfig = field(default_factory=BmConfig)
    model_name: str = ""
    workload: dict[str, Any] = field(default_factory=dict)  # Workload.describe()
    arrivals: dict[str, Any] = field(default_factory=dict)  # ArrivalPlan.describe()
    runtime: dict[str, Any] = field(default_factory=dict)  # bm.runtime.native.runtime_info()


class _Router:
    """The batch manager's callbacks, forwarded to whichever replayer is current."""

    def __init__(self) -> None:
        self.replayer: Replayer | None = None
        self.stats: list[str] | None = None

    def get_requests(self, max_new: int) -> list[Request]:
        replayer = self.replayer
        return replayer.get_requests(max_new) if replayer is not None else []

    def send_response(self, response: Response) -> None:
        if self.replayer is not None:
            self.replayer.send_response(response)

    def return_stats(self, line: str) -> None:
        if self.stats is not None:
            self.stats.append(line)


def build_requests(workload: Workload, end_id: int | None) -> list[tuple[int, Request]]:
    """(index, request) for every runnable row; a row whose fields cannot make a request gets its error.

    Every request streams: the client timestamps each token, which is what TTFT and ITL need."""
    built = []
    for index, req in enumerate(workload.requests):
        if not req.ok or req.input_ids is None:
            continue
        fields = {FIELD_ALIASES.get(k, k): v for k, v in req.fields.items() if k != "streaming"}
        if end_id is not None:
            fields.setdefault("end_id", end_id)
        try:
            request = Request(index, list(req.input_ids), req.output_len, streaming=True, **fields)
        except TypeError as exc:
            req.error = f"{req.source}: {exc}"
            continue
        built.append((index, request))
    return built


def run_bench(
    config: BmConfig,
    model: LoadedModel,
    workload: Workload,
    arrivals: Sequence[float] | None = None,
    *,
    progress: Callable[[ReplayProgress], None] | None = None,
) -> BenchResult:
    """Replay ``workload`` through a fresh batch manager and measure it.

    ``arrivals`` holds one time (seconds after the replay starts) per row of ``workload.requests``;
    by default they come from ``config.bench`` (:func:`bm.workloads.arrival_times`). Pass the same list
    to several runs to compare them on identical arrivals. ``progress`` is called from the calling
    thread about ten times a second. Ctrl-C ends the run early with every record kept.
    """
    if config.engine.executor == "sim":  # the simulator: same replay on a virtual clock (bm.sim.run)
        from bm.sim.run import run_sim

        return run_sim(config, model, workload, arrivals, progress=progress)
    bench = config.bench
    times = list(arrivals) if arrivals is not None else arrival_times(workload, bench)
    if len(times) != len(workload.requests):
        raise ValueError(f"{len(times)} arrival times for {len(workload.requests)} requests")
    built = build_requests(workload, None if bench.ignore_eos else model.eos_token_id)
    replayer = Replayer(
        [r for _, r in built], [times[i] for i, _ in built], max_concurrency=bench.max_concurrency
    )
    router = _Router()
    stats_lines: list[str] = []
    interrupted = False
    manager = engine_loop(
        config, router.get_requests, router.send_response, return_stats=router.return_stats, model=model
    )
    try:
        if bench.warmup and built:
            warm = Replayer([r for _, r in built[: bench.warmup]], [0.0] * min(bench.warmup, len(built)))
            router.replayer = warm
            warm.start()
            interrupted = _drain(manager, warm, None)
        if interrupted:
            replayer.fail_unfinished("the run was interrupted during warm-up; this request was never sent")
        else:
            router.replayer, router.stats = replayer, stats_lines
            replayer.start()
        interrupted |= _drain(manager, replayer, progress)
    finally:
        manager.shutdown(cancel=True)

    timelines = {index: replayer.timelines[r.request_id] for index, r in built}
    records = records_frame(
        [request_record(i, req, timelines.get(i)) for i, req in enumerate(workload.requests)]
    )
    stats = [json.loads(line) for line in list(stats_lines)]
    done = [t.done_s for t in timelines.values() if t.done_s is not None and t.send_s is not None]
    duration = max(done, default=0.0)
    slo = {"ttft": bench.slo_ttft_ms, "tpot": bench.slo_tpot_ms, "e2el": bench.slo_e2el_ms}
    metrics = run_metrics(records, duration, slo) | engine_metrics(pd.DataFrame.from_records(stats), records)
    return BenchResult(
        records=records,
        stats=stats,
        metrics=metrics,
        duration_s=duration,
        interrupted=interrupted,
        config=config,
        model_name=model.name,
        workload=workload.describe(),
        arrivals=ArrivalPlan.from_config(bench).describe() | {"max_concurrency": bench.max_concurrency},
        runtime=_runtime_info(model.device, model.dtype),
    )


def records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Per-request records as a frame with every column present, even for an empty run."""
    return pd.DataFrame.from_records(records, columns=list(RECORD_COLUMNS))


def _drain(
    manager: EngineLoop, replayer: Replayer, progress: Callable[[ReplayProgress], None] | None
) -> bool:
    """Wait until every request of ``replayer`` has its final record; returns whether Ctrl-C cut it short."""
    interrupted = False
    while not replayer.done:
        try:
            try:
                replayer.finished.get(timeout=_POLL_S)
            except queue.Empty:
                if not manager.is_alive():
                    replayer.fail_unfinished(
                        f"the batch manager stopped ({manager.error or 'no error given'})"
                    )
            if progress is not None:
                progress(_snapshot(replayer))
        except KeyboardInterrupt:
            interrupted = True
            replayer.fail_unfinished("the run was interrupted before this request finished")
            manager.cancel_all()
    if progress is not None:
        progress(_snapshot(replayer))
    return interrupted


def _snapshot(replayer: Replayer) -> ReplayProgress:
    return ReplayProgress(
        num_requests=replayer.num_requests,
        num_finished=replayer.num_finished,
        num_output_tokens=replayer.num_output_tokens,
        elapsed_s=replayer.now(),
    )


def _runtime_info(device: Any, dtype: Any) -> dict[str, Any]:
    from bm.runtime.native import runtime_info

    return runtime_info(device, dtype)
