"""A benchmark run under the simulator: the replay of :func:`bm.bench.run_bench`, on a virtual clock.

The driver is synchronous and nothing sleeps: when the engine is idle the clock jumps to the next
arrival; arrived requests are admitted; the core steps; the clock advances by the iteration's simulated
duration (the executor does that, so the core's own timestamps are simulated too). The same
:class:`~bm.bench.replayer.Replayer` timestamps the tokens, so records and metrics are computed by the
very code a real run uses, in simulated seconds; the wall time is reported beside them.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bm.config import BmConfig, ConfigError
from bm.engine.fast_forward import DecodeRun
from bm.sim.cost import CostModel
from bm.sim.executor import SimExecutor, VirtualClock
from bm.sim.hardware import CPU_LOCAL, Hardware, ensure_forward_fit, load_hardware
from bm.sim.model import ModelShape

_PROGRESS_EVERY = 2000  # iterations between progress callbacks


@dataclass
class SimModel:
    """Stands where a loaded model stands (its name, vocabulary, no tokenizer): what bench and compare
    need to load a workload and label results, without weights."""

    shape: ModelShape
    hardware: Hardware
    tensor_parallel: int
    dtype: str
    name: str
    tokenizer: Any = None
    eos_token_id: int | None = None
    device: str = "sim"

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    def cost_model(self) -> CostModel:
        return CostModel(self.shape, self.hardware, self.dtype, self.tensor_parallel)

    def runtime(self) -> dict[str, Any]:
        """The ``runtime`` block of results.json: what ran, for a simulated run."""
        return {
            "executor": "sim",
            "hardware": self.hardware.describe(),
            "tensor_parallel": self.tensor_parallel,
            "num_devices": self.tensor_parallel,
            "dtype": self.dtype,
        }


def load_sim_model(config: BmConfig) -> SimModel:
    """The model shape from ``model.config`` (or ``model.path``'s config.json) and the hardware row."""
    source = config.model.config or config.model.path
    if source is None:
        raise ConfigError("engine.executor: sim needs --model-config CFG.json (model.config)")
    shape = ModelShape.from_file(source)
    hardware = load_hardware(config.sim.hardware or "h100-sxm")
    # model.dtype left at auto (or float32, the old default) means "as the checkpoint ships": its torch_dtype
    dtype = config.model.dtype
    if dtype in ("auto", "float32"):
        dtype = shape.torch_dtype or "float32"
    if hardware.key == CPU_LOCAL:  # this machine: the forward's cost as bm's engine runs this model here
        model_config = dataclasses.replace(config.model, dtype=dtype, device="cpu")
        hardware = ensure_forward_fit(model_config, shape, dtype)
    hardware.peak_flops(dtype)  # fail now, naming the dtype, rather than mid-run
    return SimModel(shape, hardware, config.sim.tensor_parallel, dtype, name=shape.name or str(source))


def is_sim(model: Any) -> bool:
    return isinstance(model, SimModel)


def cost_metrics(
    hardware: Hardware, num_devices: int, duration_s: float, output_tokens: int, total_tokens: int
) -> dict[str, Any]:
    """Cost per million tokens: hourly price x devices x simulated duration, over the tokens made."""
    dollars = hardware.price_per_hour * num_devices * duration_s / 3600.0

    def per_million(tokens: int) -> float | None:
        return dollars / tokens * 1e6 if tokens else None

    return {
        "cost_usd": dollars,
        "cost_per_million_output_tokens": per_million(output_tokens),
        "cost_per_million_total_tokens": per_million(total_tokens),
    }


def run_sim(
    config: BmConfig,
    model: SimModel,
    workload: Any,
    arrivals: Sequence[float] | None = None,
    *,
    progress: Callable[[Any], None] | None = None,
    fast_forward: bool = True,
) -> Any:
    """Replay ``workload`` through the engine core under the simulator; returns a ``BenchResult``.

    ``fast_forward``: advance steady decode stretches in one call (:mod:`bm.engine.fast_forward`); the
    result is the same either way (a test pins it), only the wall time differs."""
    import pandas as pd

    from bm.bench.metrics import engine_metrics, request_record, run_metrics
    from bm.bench.replayer import Replayer
    from bm.bench.runner import BenchResult, build_requests, records_frame
    from bm.engine.core import EngineCore
    from bm.workloads import ArrivalPlan, arrival_times

    wall_start = time.perf_counter()
    bench = config.bench
    times = list(arrivals) if arrivals is not None else arrival_times(workload, bench)
    if len(times) != len(workload.requests):
        raise ValueError(f"{len(times)} arrival times for {len(workload.requests)} requests")
    built = build_requests(workload, None)  # EOS never ends a simulated request: lengths are the data's
    clock = VirtualClock()
    executor = SimExecutor(model.cost_model(), clock)
    core = EngineCore(config, executor, clock=clock)
    # Tokens are timestamped here, from what the executor sampled, rather than streamed back one
    # response per token: the same times a streaming client would record, without a response object per
    # token. Only final responses go through the replayer (with their tokens already counted).
    requests = [dataclasses.replace(r, streaming=False) for _, r in built]
    replayer = Replayer(
        requests, [times[i] for i, _ in built], max_concurrency=bench.max_concurrency, clock=clock
    )
    replayer.start()
    timelines = replayer.timelines
    arrival_of = [timelines[r.request_id].arrival_s for r in requests]
    stats: list[dict[str, Any]] = []
    iterations = 0
    skipped = 0  # iterations advanced by fast-forward
    next_progress = _PROGRESS_EVERY
    while not replayer.done:
        max_new = max(0, core.max_num_active_requests - core.num_active)
        for request in replayer.get_requests(max_new):
            refused = core.add_request(request)
            if refused is not None:
                replayer.send_response(refused)
        if core.num_active:
            out = core.step()
            now = clock.now
            for rid in executor.last_sampled:
                timelines[rid].token_s.append(now)
            replayer.num_output_tokens += len(executor.last_sampled)
            for response in out.responses:
                if response.output_ids:
                    response = dataclasses.replace(response, output_ids=[])
                replayer.send_response(response)
            if out.stats is not None:
                stats.append(stats_row(out.stats))
            iterations += 1
            if fast_forward:
                # a steady decode stretch at once, up to the next iteration an arrival would join
                max_new = max(0, core.max_num_active_requests - core.num_active)
                run = core.fast_forward(replayer.next_release_s(max_new))
                if run is not None:
                    for rid in run.request_ids:
                        timelines[rid].token_s.extend(run.end_times)
                    replayer.num_output_tokens += len(run.request_ids) * run.num_iterations
                    stats.extend(decode_rows(run))
                    iterations += run.num_iterations
                    skipped += run.num_iterations
            if progress is not None and iterations >= next_progress:
                next_progress = iterations + _PROGRESS_EVERY
                progress(_snapshot(replayer))
            if out.computed_tokens:
                continue
        # idle, or nothing could run: only an arrival can change that
        sent = replayer.num_sent
        if sent >= len(requests):
            replayer.fail_unfinished(
                "the simulated engine could not schedule this request and no arrival was left to change that"
            )
            break
        clock.advance_to(arrival_of[sent])
    if progress is not None:
        progress(_snapshot(replayer))

    timelines = {index: replayer.timelines[r.request_id] for index, r in built}
    records = records_frame(
        [request_record(i, req, timelines.get(i)) for i, req in enumerate(workload.requests)]
    )
    done = [t.done_s for t in timelines.values() if t.done_s is not None and t.send_s is not None]
    duration = max(done, default=0.0)
    slo = {"ttft": bench.slo_ttft_ms, "tpot": bench.slo_tpot_ms, "e2el": bench.slo_e2el_ms}
    metrics = run_metrics(records, duration, slo) | engine_metrics(pd.DataFrame.from_records(stats), records)
    metrics |= cost_metrics(
        model.hardware,
        model.tensor_parallel,
        duration,
        metrics["total_output_tokens"],
        metrics["total_input_tokens"] + metrics["total_output_tokens"],
    )
    metrics |= {
        "executor": "sim",
        "simulated_duration_s": duration,
        "kv_cache_capacity_tokens": executor.kv_capacity_tokens,
        "kv_cache_blocks": core.kv_cache_manager.get_max_resource_count(),
        "fast_forwarded_iterations": skipped,
        "wall_time_s": time.perf_counter() - wall_start,
    }

    return BenchResult(
        records=records,
        stats=stats,
        metrics=metrics,
        duration_s=duration,
        interrupted=False,
        config=config,
        model_name=model.name,
        workload=workload.describe(),
        arrivals=ArrivalPlan.from_config(bench).describe() | {"max_concurrency": bench.max_concurrency},
        runtime=model.runtime(),
    )


_WALL_CLOCK_STAT = "Timestamp"


def stats_row(stats: Any) -> dict[str, Any]:
    """One stats.jsonl row as a real run writes it, its wall-clock timestamp replaced by simulated
    seconds (a simulated run's stats are a function of its inputs alone)."""
    row = json.loads(stats.to_json())
    row[_WALL_CLOCK_STAT] = round(stats.elapsed_s, 6)
    return row


def decode_rows(run: DecodeRun) -> list[dict[str, Any]]:
    """The stats rows of a fast-forwarded decode run, exactly as :func:`stats_row` writes each of its
    iterations: the shared fields once, then what changes per iteration (a test compares them with the
    step-by-step rows field by field)."""
    base = stats_row(run.template)
    max_blocks = run.template.max_blocks
    origin = run.engine_start_s
    start = run.start_s
    rows = []
    for j, end in enumerate(run.end_times):
        used = run.used_blocks[j]
        elapsed = round(end - origin, 6)
        row = base.copy()
        row[_WALL_CLOCK_STAT] = elapsed
        row["Iteration Counter"] = run.first_iteration + j
        row["Free KV cache blocks"] = max_blocks - used
        row["Used KV cache blocks"] = used
        row["Used KV layer blocks"] = used * run.num_layers
        row["Elapsed Time (s)"] = elapsed
        row["Iteration Latency (ms)"] = round((end - start) * 1e3, 3)
        row["Reusable KV cache blocks"] = run.cached_blocks[j]
        rows.append(row)
        start = end
    return rows


def _snapshot(replayer: Any) -> Any:
    from bm.bench.runner import ReplayProgress

    return ReplayProgress(
        num_requests=replayer.num_requests,
        num_finished=replayer.num_finished,
        num_output_tokens=replayer.num_output_tokens,
        elapsed_s=replayer.now(),
    )
