"""A benchmark run under the simulator: the replay of :func:`bm.bench.run_bench`, on a virtual clock.

The driver is synchronous and nothing sleeps: when the engine is idle the clock jumps to the next
arrival; arrived requests are admitted; the core steps; the clock advances by the iteration's simulated
duration (the executor does that, so the core's own timestamps are simulated too). The same
:class:`~bm.bench.replayer.Replayer` timestamps the tokens, so records and metrics are computed by the
very code a real run uses, in simulated seconds; the wall time is reported beside them.

It lives in :mod:`bm.bench`, above :mod:`bm.sim`: it is the bench runner's replay with the simulator's
executor and cost model underneath, so the simulator itself never imports the benchmark.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bm.bench.journal import BenchJournal, RunFeed
from bm.bench.replayer import Replayer, Timeline, build_requests
from bm.bench.results import BenchResult, ReplayProgress, bench_result, snapshot
from bm.config import BmConfig, ConfigError, resolve_dtype_name
from bm.config.engine import BatchingScheme
from bm.engine.driving.driver import Driver
from bm.engine.outputs.stats import IterationStats
from bm.engine.requests.request import Response
from bm.engine.step.core import EngineCore, StepOutput
from bm.engine.step.fast_forward import DecodeRun
from bm.engine.step.overlap import resolve_overlap
from bm.scheduling import FinishReason
from bm.sim.cost import CostModel
from bm.sim.executor import SimExecutor, VirtualClock
from bm.sim.hardware import LOCAL_ROWS, Hardware, ensure_forward_fit, load_hardware
from bm.sim.model import FULL_WIDTH, ModelShape, WeightFormat, weight_format
from bm.workloads import Workload, arrival_times

_PROGRESS_EVERY = 2000  # iterations between progress callbacks
_STOP_EVERY = 50  # driver rounds between questions to a stop callback (and looks at the wall clock)
_JOURNAL_S = 0.1  # wall seconds between journal feeds, as a real run polls
_MAX_ROWS = 8192  # stats rows waiting for the feed before it takes them, whatever the wall clock says


class StopRule(Protocol):
    """Ends a simulated replay early (``bm sweep``'s :class:`~bm.sweep.search.EarlyStop`)."""

    def observe(self, timeline: Timeline) -> None:
        """A finished request's timeline, once each, before the rule is next asked."""

    def __call__(self, replayer: Replayer) -> bool:
        """Whether to end the replay now."""


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
    decode_graphs: bool = True  # model.cuda_graphs is not off (a cuda-local row prices graph replays)
    overlap: bool = False  # the engine would overlap the host's work with the device's on this row
    kv_cache_dtype: str = "auto"  # kv_cache.dtype: what one token's keys and values take
    weights: WeightFormat = FULL_WIDTH  # model.quantization: how the decoder's linears are held

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def device_type(self) -> str:
        """The device the hardware row stands for, whose engine defaults the run resolves (bm.config)."""
        return self.hardware.device_type

    def cost_model(self) -> CostModel:
        return CostModel(
            self.shape,
            self.hardware,
            self.dtype,
            self.tensor_parallel,
            self.decode_graphs,
            self.overlap,
            self.kv_cache_dtype,
            self.weights,
        )

    def runtime(self) -> dict[str, Any]:
        """The ``runtime`` block of results.json: what ran, for a simulated run."""
        return {
            "executor": "sim",
            "hardware": self.hardware.describe(),
            "tensor_parallel": self.tensor_parallel,
            "num_devices": self.tensor_parallel,
            "dtype": self.dtype,
            "weights": self.weights.name,
        }


def load_sim_model(config: BmConfig) -> SimModel:
    """The model shape from ``model.config`` (or ``model.path``'s config.json), how its linears are held
    (``model.quantization`` against that config.json's ``quantization_config``), and the hardware row."""
    source = config.model.config or config.model.path
    if source is None:
        raise ConfigError("engine.executor: sim needs --model-config CFG.json (model.config)")
    from bm.hub_cache import local_dir

    shape = ModelShape.from_file(local_dir(source))  # a hub id: its cached snapshot's config.json
    hardware = load_hardware(config.sim.hardware or "h100-sxm")
    # the dtype the real engine would load in on the row's device (auto: bfloat16 on a GPU, float32 on CPU)
    dtype = resolve_dtype_name(config.model.dtype, hardware.device_type)
    hardware.peak_flops(dtype)  # fail now, naming the dtype, rather than mid-run (or after a fit)
    weights = weight_format(config.model.quantization, local_dir(source))
    if hardware.key in LOCAL_ROWS:  # this machine: the forward's cost as bm's engine runs this model here
        if config.sim.tensor_parallel > 1:
            raise ConfigError(
                f"--hardware {hardware.key} measures one device, bm's forward on it: tensor parallelism "
                "needs a datasheet row (e.g. --hardware h100-sxm)"
            )
        hardware = ensure_forward_fit(config.model, shape, dtype, hardware.key, weights)
    return SimModel(
        shape,
        hardware,
        config.sim.tensor_parallel,
        dtype,
        name=shape.name or str(source),
        decode_graphs=config.model.cuda_graphs != "off",
        overlap=sim_overlaps(config, hardware.device_type),
        kv_cache_dtype=config.kv_cache.dtype,
        weights=weights,
    )


def sim_overlaps(config: BmConfig, device_type: str) -> bool:
    """Whether the real engine would overlap on the row's device: ``engine.overlap_scheduler`` resolved
    as the core resolves it for an executor that runs ahead of the host on a GPU (the torch executor on
    CUDA), so ``auto`` prices a GPU row overlapped and a CPU row in order, as the engine runs them."""
    from types import SimpleNamespace

    engine = config.engine
    overlaps, _ = resolve_overlap(
        engine.overlap_scheduler,
        SimpleNamespace(overlaps_host=device_type == "cuda"),
        v1=BatchingScheme(engine.batching_scheme) == BatchingScheme.V1,
        ngram=bool(engine.speculative),
    )
    return overlaps


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
    workload: Workload,
    arrivals: Sequence[float] | None = None,
    *,
    progress: Callable[[ReplayProgress], None] | None = None,
    fast_forward: bool = True,
    stop: StopRule | None = None,
    journal: BenchJournal | None = None,
    interrupt: threading.Event | None = None,
) -> BenchResult:
    """Replay ``workload`` through the engine core under the simulator; returns a ``BenchResult``.

    ``fast_forward``: advance steady decode stretches in one call (:mod:`bm.engine.step.fast_forward`); the
    result is the same either way (a test pins it), only the wall time differs. ``stop``: shown every
    finished request and asked every few iterations; True ends the replay there, every unfinished
    request failed as stopped early (``bm sweep`` stops a point once its SLO is certainly missed).
    ``journal``: given the stats rows and finished requests' records about ten times a wall second, as
    :func:`bm.bench.run_bench` does; the run keeps only their tallies. ``interrupt`` (the command's
    first signal): the replay ends at the next check, what had not finished cancelled, and the result
    says ``interrupted``, as a real run's does."""
    wall_start = time.perf_counter()
    bench = config.bench
    times = list(arrivals) if arrivals is not None else arrival_times(workload, bench)
    if len(times) != len(workload.requests):
        raise ValueError(f"{len(times)} arrival times for {len(workload.requests)} requests")
    built = build_requests(workload, None)  # EOS never ends a simulated request: lengths are the data's
    # Tokens are timestamped here, from what the executor sampled, rather than streamed back one
    # response per token: the same times a streaming client would record, without a response object per
    # token. Only final responses go through the replayer (with their tokens already counted).
    requests = [dataclasses.replace(r, streaming=False) for _, r in built]
    clock = VirtualClock()
    replayer = Replayer(
        requests, [times[i] for i, _ in built], max_concurrency=bench.max_concurrency, clock=clock
    )
    built_at = time.perf_counter()
    replay = _VirtualReplay(config, model, replayer, clock)
    startup = {"engine_build_s": time.perf_counter() - built_at, "warmup": None}
    watch = stop.observe if stop is not None else None
    replay.feed = RunFeed(workload, built, replayer, replay.take_stats, journal, watch)
    replay.interrupt = interrupt
    replay.run(fast_forward, progress, stop)
    replay.feed.watch = None  # the rule is asked no more: what a stop itself ended is not its to see
    replay.feed.finish()
    result = bench_result(
        replay.core.config,
        model.name,
        workload,
        replayer,
        replay.feed,
        runtime=model.runtime(),
        interrupted=replay.interrupted,
    )
    result.not_run = replay.not_run
    result.startup, result.warnings = startup, list(replay.core.warnings)
    metrics = result.metrics
    metrics |= cost_metrics(
        model.hardware,
        model.tensor_parallel,
        result.duration_s,
        metrics["total_output_tokens"],
        metrics["total_input_tokens"] + metrics["total_output_tokens"],
    )
    metrics |= {
        "executor": "sim",
        "simulated_duration_s": result.duration_s,
        "kv_cache_capacity_tokens": replay.executor.kv_capacity_tokens,
        "kv_cache_blocks": replay.core.kv_cache_manager.get_max_resource_count(),
        "fast_forwarded_iterations": replay.skipped,
        "stopped_early": replay.stopped_early,
        "wall_time_s": time.perf_counter() - wall_start,
    }
    return result


# The error of the requests a replay stopped early never finished (bm sweep counts them as not run).
STOPPED_EARLY = "stopped early: the point already missed its SLO"
_INTERRUPTED = "the run was interrupted before this request finished"


class _VirtualReplay:
    """The driver on a virtual clock: when the engine is idle the clock jumps to the next arrival, and
    after each step a steady decode stretch may be advanced at once, up to the next arrival."""

    def __init__(self, config: BmConfig, model: SimModel, replayer: Replayer, clock: VirtualClock) -> None:
        self.replayer = replayer
        self.clock = clock
        self.executor = SimExecutor(model.cost_model(), clock)
        self.core = EngineCore(config, self.executor, clock=clock)
        self.driver = Driver(
            self.core,
            self._deliver,
            source=replayer.get_requests,
            stats=lambda stats: self.stats.append(stats_row(stats)),
            on_step=self._timestamp,
        )
        self.stats: list[dict[str, Any]] = []  # rows since the feed last took them
        self.iterations = 0
        self.skipped = 0  # iterations advanced by fast-forward
        self.stopped_early = False
        self.interrupt: threading.Event | None = None  # the command's first signal (bm.cli.interrupts)
        self.interrupted = False
        self.not_run = 0  # requests the stop rule ended
        self.feed: RunFeed | None = None

    def take_stats(self) -> list[dict[str, Any]]:
        rows, self.stats = self.stats, []
        return rows

    def _timestamp(self, out: StepOutput) -> None:
        """Each token the step applied, at the simulated time it became known (with overlap, the step
        after the one that computed it: the host reads it then)."""
        now, timelines = self.clock.now, self.replayer.timelines
        for rid in out.produced_ids:
            timelines[rid].token_s.append(now)
        self.replayer.num_output_tokens += len(out.produced_ids)

    def _deliver(self, response: Response) -> None:
        if response.output_ids:  # already timestamped from the executor's samples
            response = dataclasses.replace(response, output_ids=[])
        self.replayer.send_response(response)

    def run(
        self,
        fast_forward: bool,
        progress: Callable[[ReplayProgress], None] | None,
        stop: StopRule | None = None,
    ) -> None:
        replayer, driver = self.replayer, self.driver
        replayer.start()
        arrival_of = [t.arrival_s for t in replayer.timelines.values()]  # in request order
        next_progress = _PROGRESS_EVERY
        next_feed = time.perf_counter() + _JOURNAL_S
        rounds = 0
        while not replayer.done:
            rounds += 1
            if rounds % _STOP_EVERY == 0:
                if self.interrupt is not None and self.interrupt.is_set():
                    replayer.fail_unfinished(_INTERRUPTED, FinishReason.CANCELLED.label)
                    self.interrupted = True
                    break
                if stop is not None:  # shown every finished request first, at the same rounds every run
                    self._pump()
                    if stop(replayer):
                        self.not_run = replayer.fail_unfinished(STOPPED_EARLY)
                        self.stopped_early = True
                        break
                elif time.perf_counter() >= next_feed:
                    self._pump()
                    next_feed = time.perf_counter() + _JOURNAL_S
            if len(self.stats) >= _MAX_ROWS:
                self._pump()
            out = driver.round()
            if out.stats is not None:  # a step ran
                self.iterations += 1
                if fast_forward:
                    self._fast_forward()
                if progress is not None and self.iterations >= next_progress:
                    next_progress = self.iterations + _PROGRESS_EVERY
                    progress(snapshot(replayer))
                if out.computed_tokens:
                    continue
            elif self.core.in_flight:  # overlap: the first step only launched
                continue
            # idle, or nothing could run: only an arrival can change that
            sent = replayer.num_sent
            if sent >= len(arrival_of):
                replayer.fail_unfinished(
                    "the simulated engine could not schedule this request and no arrival was left to "
                    "change that"
                )
                break
            self.clock.advance_to(arrival_of[sent])
        if progress is not None:
            progress(snapshot(replayer))

    def _pump(self) -> None:
        if self.feed is not None:
            self.feed.pump()

    def _fast_forward(self) -> None:
        """A steady decode stretch at once, up to the next iteration an arrival would join."""
        run = self.driver.fast_forward(self.replayer.next_release_s(self.driver.free_slots))
        if run is None:
            return
        timelines = self.replayer.timelines
        for rid in run.request_ids:
            timelines[rid].token_s.extend(run.end_times)
        self.replayer.num_output_tokens += len(run.request_ids) * run.num_iterations
        self.stats.extend(decode_rows(run))
        self.iterations += run.num_iterations
        self.skipped += run.num_iterations


_WALL_CLOCK_STAT = "Timestamp"


def stats_row(stats: IterationStats) -> dict[str, Any]:
    """One stats.jsonl row as a real run writes it, its wall-clock timestamp replaced by simulated
    seconds (a simulated run's stats are a function of its inputs alone)."""
    row = stats.to_dict()
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
