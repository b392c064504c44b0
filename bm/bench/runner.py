"""One benchmark run: warm up, replay the workload against the arrival clock, collect every request.

The runner owns one :class:`BatchManager` for the whole run and points its callbacks at the current
phase's :class:`Replayer` (warm-up, then the measured replay), so the KV cache is allocated once and
warm-up requests never leak into the results. Records and stats are handed to the caller from the
calling thread (``on_record``, ``on_stats``), never from the batch manager's, so file I/O never stalls
an iteration. Every request ends with exactly one record: completed, failed by the engine, refused at
load, or failed because the run was interrupted.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bm.bench.metrics import request_record
from bm.bench.replayer import Replayer, Timeline
from bm.config import BmConfig
from bm.engine import BatchManager, InferenceRequest
from bm.runtime import LoadedModel
from bm.workloads import ArrivalPlan, Workload

# vLLM's names for request fields, accepted in bm JSONL rows as in `bm run`.
FIELD_ALIASES = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "seed": "random_seed"}
_POLL_S = 0.1


@dataclass
class BenchRun:
    records: list[dict[str, Any]] = field(default_factory=list)
    stats_lines: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    interrupted: bool = False
    arrivals: ArrivalPlan = field(default_factory=lambda: ArrivalPlan("offline"))


class _Router:
    """The batch manager's callbacks, forwarded to whichever replayer is current."""

    def __init__(self) -> None:
        self.replayer: Replayer | None = None
        self.stats: list[str] | None = None

    def get_requests(self, max_new: int) -> list[InferenceRequest]:
        replayer = self.replayer
        return replayer.get_requests(max_new) if replayer is not None else []

    def send_response(self, rid: int, tensors: dict[str, torch.Tensor], final: bool, error: str) -> None:
        if self.replayer is not None:
            self.replayer.send_response(rid, tensors, final, error)

    def return_stats(self, line: str) -> None:
        if self.stats is not None:
            self.stats.append(line)  # list.append is atomic; the caller's thread writes the file


def build_requests(workload: Workload, end_id: int | None) -> list[tuple[int, InferenceRequest]]:
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
            built.append(
                (
                    index,
                    InferenceRequest.from_values(
                        index, req.input_ids, req.output_len, streaming=True, **fields
                    ),
                )
            )
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            req.error = f"{req.source}: {exc}"
    return built


def run_benchmark(
    config: BmConfig,
    loaded: LoadedModel,
    workload: Workload,
    *,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    on_stats: Callable[[str], None] | None = None,
    on_tick: Callable[[Replayer], None] | None = None,
) -> BenchRun:
    """Replay ``workload`` as ``config.bench`` says; Ctrl-C ends the run early with every record kept."""
    bench = config.bench
    emit = on_record or (lambda record: None)
    run = BenchRun(arrivals=ArrivalPlan.from_config(bench))
    built = build_requests(workload, None if bench.ignore_eos else loaded.eos_token_id)
    for index, req in enumerate(workload.requests):
        if not req.ok:
            run.records.append(request_record(index, req, None))
            emit(run.records[-1])
    timestamps = [workload.requests[i].timestamp for i, _ in built]
    arrivals = run.arrivals.times(len(built), timestamps, seed=bench.seed)
    replayer = Replayer([r for _, r in built], arrivals, max_concurrency=bench.max_concurrency)
    by_id = {r.request_id: index for index, r in built}

    router = _Router()
    manager = BatchManager(
        config, router.get_requests, router.send_response, return_stats=router.return_stats, model=loaded
    )

    def on_final(timeline: Timeline) -> None:
        index = by_id[timeline.request_id]
        run.records.append(request_record(index, workload.requests[index], timeline))
        emit(run.records[-1])

    try:
        if bench.warmup and built:
            warm = Replayer([r for _, r in built[: bench.warmup]], [0.0] * min(bench.warmup, len(built)))
            router.replayer = warm
            warm.start()
            run.interrupted = _drain(manager, warm, lambda t: None, None, [], None)
        if run.interrupted:
            replayer.fail_unfinished("the run was interrupted during warm-up; this request was never sent")
        else:
            router.replayer, router.stats = replayer, run.stats_lines
            replayer.start()
        run.interrupted |= _drain(manager, replayer, on_final, on_tick, run.stats_lines, on_stats)
    finally:
        manager.shutdown(cancel=True)
    done = [t.done_s for t in replayer.timelines.values() if t.done_s is not None and t.send_s is not None]
    run.duration_s = max(done, default=0.0)
    return run


def _drain(
    manager: BatchManager,
    replayer: Replayer,
    on_final: Callable[[Timeline], None],
    on_tick: Callable[[Replayer], None] | None,
    stats: list[str],
    on_stats: Callable[[str], None] | None,
) -> bool:
    """Consume finished timelines until every request has one; returns whether Ctrl-C cut it short."""
    interrupted, written = False, 0
    while not (replayer.done and replayer.finished.empty()):
        try:
            try:
                on_final(replayer.finished.get(timeout=_POLL_S))
            except queue.Empty:
                if not manager.is_alive():
                    replayer.fail_unfinished(
                        f"the batch manager stopped ({manager.error or 'no error given'})"
                    )
            if on_stats is not None:
                count = len(stats)
                for line in stats[written:count]:
                    on_stats(line)
                written = count
            if on_tick is not None:
                on_tick(replayer)
        except KeyboardInterrupt:
            interrupted = True
            replayer.fail_unfinished("the run was interrupted before this request finished")
            manager.cancel_all()
    if on_stats is not None:
        for line in stats[written:]:
            on_stats(line)
    return interrupted
