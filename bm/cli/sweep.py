"""``bm sweep``: the highest load each configuration of a grid sustains within an SLO (docs/sweep.md).

It takes ``bm bench``'s dataset and arrival flags (the same config keys), so a benchmark config runs
unchanged. Everything the user wrote is checked before the model loads: every configuration of the
grid (built and validated like a run's config), the SLOs, the ``--assert`` expressions against the
configuration names, the baseline file, and ``-o`` (non-empty needs ``--resume`` or ``--overwrite``).
Exit codes: 0 done, 1 a gate failed, 2 bad input, 130 interrupted (``--resume`` continues).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from bm.cli.bench import (
    RUN,
    engine_config,
    load_model_and_workload,
    pin_cache,
    resolve_config,
    with_shared_options,
)
from bm.cli.interrupts import INTERRUPTED_EXIT, Interrupted, Interrupts
from bm.config import BmConfig, ConfigError, resolve_engine
from bm.runfiles.outdir import OutDirError, prepare_out_dir
from bm.stderr import print_error

if TYPE_CHECKING:
    from bm.compare.expr import Assertion
    from bm.sweep.runner import SweepPlan

SWEEP = "Sweep"
GATES = "Gates"
PLAN_FILE = "sweep-plan.json"
SWEEP_FILES = ("sweep.json", "sweep.csv", "sweep.md", "points.jsonl", PLAN_FILE, "plots")


@with_shared_options
def sweep(
    dataset: Path | None = typer.Argument(None, help="Dataset file or directory (as bm bench)."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config (model, engine, kv_cache, bench, sweep)."),
    schemes: str | None = typer.Option(None, "--schemes", help="Axis engine.batching_scheme, e.g. v1,inflight,inflight_fused.", rich_help_panel=SWEEP),
    policies: str | None = typer.Option(None, "--policies", help="Axis engine.scheduler_policy.", rich_help_panel=SWEEP),
    max_batch_sizes: str | None = typer.Option(None, "--max-batch-sizes", help="Axis engine.max_batch_size, e.g. 16,32,64.", rich_help_panel=SWEEP),
    max_num_tokens_values: str | None = typer.Option(None, "--token-budgets", help="Axis engine.max_num_tokens.", rich_help_panel=SWEEP),
    chunking: str | None = typer.Option(None, "--chunking", help="Axis engine.enable_chunked_context: on,off.", rich_help_panel=SWEEP),
    block_reuse: str | None = typer.Option(None, "--block-reuse", help="Axis kv_cache.enable_block_reuse: on,off.", rich_help_panel=SWEEP),
    tp_sizes: str | None = typer.Option(None, "--tp-sizes", help="Axis sim.tensor_parallel, e.g. 1,2,4.", rich_help_panel=SWEEP),
    grid: list[str] = typer.Option([], "--grid", help="Any axis: KEY=V1,V2, e.g. engine.max_num_tokens=2048,8192 (repeatable).", rich_help_panel=SWEEP),
    percentile: float | None = typer.Option(None, "--percentile", help="Percentile the SLOs apply to [99].", rich_help_panel=SWEEP),
    load: str | None = typer.Option(None, "--load", help="What load is: rate, concurrency or trace (speed-up) [rate].", rich_help_panel=SWEEP),
    precision: float | None = typer.Option(None, "--precision", help="Relative precision of the highest load [0.05].", rich_help_panel=SWEEP),
    start: float | None = typer.Option(None, "--start", help="First load tried [rate 4, concurrency 16, trace 1].", rich_help_panel=SWEEP),
    min_load: float | None = typer.Option(None, "--min-load", help="Lowest load tried before giving up [start / 32].", rich_help_panel=SWEEP),
    repeats: int | None = typer.Option(None, "--repeats", help="Real engine: runs per point; the median decides [1].", rich_help_panel=SWEEP),
    workers: int | None = typer.Option(None, "--workers", help="Simulated points in parallel processes [one per core].", rich_help_panel=SWEEP),
    early_stop: bool = typer.Option(True, "--early-stop/--no-early-stop", help="Sim: stop a point once its SLO is certainly missed.", rich_help_panel=SWEEP),
    out_dir: Path | None = typer.Option(None, "--out-dir", "-o", help="Output directory [bm-out/sweep-TIME].", rich_help_panel=RUN),
    resume: bool = typer.Option(False, "--resume", help="Continue the sweep in OUT_DIR; finished points never rerun.", rich_help_panel=RUN),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the sweep in OUT_DIR.", rich_help_panel=RUN),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Write PNG plots into OUT_DIR/plots.", rich_help_panel=RUN),
    json_output: bool = typer.Option(False, "--json", help="Print only sweep.json on stdout.", rich_help_panel=RUN),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No line per point.", rich_help_panel=RUN),
    asserts: list[str] = typer.Option([], "--assert", help='Gate, e.g. "inflight_fused.max_load >= 1.5 * v1.max_load" (repeatable).', rich_help_panel=GATES),
    baseline: Path | None = typer.Option(None, "--baseline", help="A saved sweep.json: no configuration's max load may fall.", rich_help_panel=GATES),
    tolerance: str = typer.Option("0%", "--tolerance", help="Allowed fall of a max load against --baseline.", rich_help_panel=GATES),
    **shared: Any,
) -> None:  # fmt: skip
    """Find, for every configuration of a grid, the highest load that meets every SLO (bracket, then
    bisect); write sweep.json, sweep.csv, sweep.md and plots; gate on --assert and --baseline."""
    from bm.compare.expr import AssertionEvalError, AssertionSyntaxError
    from bm.compare.regress import ToleranceError

    err = Console(stderr=True)
    flags = {**locals(), **shared}
    flags.pop("out_dir")
    flags.pop("json_output")
    try:
        setup = _plan(config, flags, shared)
        out = out_dir or Path("bm-out") / time.strftime("sweep-%Y%m%d-%H%M%S")
        prepare_out_dir(
            out, resume=resume, overwrite=overwrite, files=SWEEP_FILES, command="bm sweep", baseline=baseline
        )
        _check_identity(out, setup.identity, resume)
    except (ConfigError, OutDirError, AssertionSyntaxError, AssertionEvalError, ToleranceError) as exc:
        print_error(str(exc))
        raise typer.Exit(code=2) from None
    console = err if json_output else Console()
    # A sweep saves each point as it finishes, so a signal abandons the point in progress (--resume runs
    # it again) instead of waiting for it: Interrupts stays in its start-up behaviour throughout.
    with Interrupts():
        code = _run(setup, out, plot, json_output, quiet, console)
    if code:
        raise typer.Exit(code=code)


@dataclass
class _Setup:
    """Everything a sweep needs, validated before the model loads."""

    base: BmConfig
    plan: SweepPlan
    asserts: list[Assertion]
    previous: dict[str, Any] | None  # the --baseline document
    tolerance: float
    identity: dict[str, Any]  # what decides a point's result, for --resume


def _plan(config: Path | None, flags: dict[str, Any], shared: dict[str, Any]) -> _Setup:
    """The validated sweep: base config, every grid configuration, SLO, gates; fails before any load."""
    from bm.compare.expr import check_refs, parse_assertion
    from bm.compare.regress import parse_tolerance
    from bm.sweep.grid import AXIS_FLAGS, expand, plan_axes
    from bm.sweep.report import SUMMARY_KEYS, read_baseline
    from bm.sweep.runner import LOADS, SweepPlan, default_workers
    from bm.sweep.search import Slo

    base = resolve_config(config, shared["set_"], flags, [])
    opts = base.sweep
    axis_flags = {key: flags[name] for name, key in AXIS_FLAGS.items() if flags.get(name) is not None}
    for text in flags["grid"]:
        key, sep, values = text.partition("=")
        if not sep:
            raise ConfigError(f"--grid {text!r}: expected KEY=V1,V2, e.g. engine.max_batch_size=16,64")
        axis_flags[key.strip()] = values
    configs = expand(base, plan_axes(opts.grid, axis_flags))
    slo = Slo.parse(shared["slo"], flags["percentile"] or opts.percentile, opts.slo)
    kind = flags["load"] or opts.load
    if kind not in LOADS:
        raise ConfigError(f"--load {kind!r}: use one of {', '.join(LOADS)}")
    plan = SweepPlan(
        configs,
        slo,
        load=kind,
        precision=flags["precision"] or opts.precision,
        start=flags["start"] or (1.0 if kind == "trace" else None),
        min_load=flags["min_load"],
        repeats=flags["repeats"] or opts.repeats,
        workers=flags["workers"] or opts.workers or default_workers(),
        early_stop=flags["early_stop"],
    )
    if not 0 < plan.precision < 1:
        raise ConfigError(f"--precision {plan.precision}: must be in (0, 1), e.g. 0.05 for 5%")
    parsed = [parse_assertion(text) for text in flags["asserts"]]
    known = _known_metrics() | set(SUMMARY_KEYS)
    for assertion in parsed:
        check_refs(assertion, {c.name: known for c in configs})
    previous = read_baseline(flags["baseline"]) if flags["baseline"] is not None else None
    identity = {
        "base": _without(base.to_dict()),
        "configs": [c.name for c in configs],
        "slo": slo.limits,
        "percentile": slo.percentile,
        "load": kind,
        "precision": plan.precision,
        "start": plan.start,
        "repeats": plan.repeats,
        "early_stop": plan.early_stop,
    }
    return _Setup(base, plan, parsed, previous, parse_tolerance(flags["tolerance"]), identity)


def _known_metrics() -> set[str]:
    from bm.cli.compare import _known_metrics as known

    return known() | {"cost_per_million_output_tokens", "cost_usd", "simulated_duration_s"}


def _without(config: dict[str, Any]) -> dict[str, Any]:
    """The base config without what does not change a point's result (where results go, workers)."""
    config = {k: dict(v) for k, v in config.items()}
    for key in ("out_dir", "json_output"):
        config["bench"].pop(key, None)
    config["sweep"].pop("workers", None)
    return config


def _check_identity(out: Path, identity: dict[str, Any], resume: bool) -> None:
    """Write the plan's identity; on --resume, refuse a different plan, naming what changed."""
    path = out / PLAN_FILE
    if resume and path.exists():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise OutDirError(
                f"--resume: {path} is unreadable; use --overwrite or another directory"
            ) from None
        current = json.loads(json.dumps(identity))
        changed = [k for k in current if saved.get(k) != current[k]]
        if changed:
            raise OutDirError(
                f"--resume: {str(out)!r} holds a sweep with a different {', '.join(changed)}; resume with the "
                "same flags and config, or use --overwrite"
            )
        return
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(identity | {"digest": digest}, indent=2) + "\n", encoding="utf-8")


def _with_cache(point: Any, model: Any, max_tokens: int | None) -> Any:
    """A grid point resolved for the model's device, with the sweep's cache unless its axis sets one."""
    config = resolve_engine(point.config, model.device_type)
    if config.kv_cache.max_tokens is None:
        config = replace(config, kv_cache=replace(config.kv_cache, max_tokens=max_tokens))
    return replace(point, config=config)


def point_verdict(point: Any) -> str:
    """A point's live verdict: ``ok`` or ``miss`` with its SLO figures, or, for a simulated point stopped
    early, what it was sure to miss and how many requests it never ran. No figures then: they would
    cover only the requests that finished, which may all have met the SLO (the late ones never finished),
    and "miss ttft=1742ms" beside a 2000 ms limit reads as a bug."""
    figures = " ".join(f"{k}={v:.0f}ms" for k, v in point.slo_values.items() if v is not None)
    if point.feasible:
        return f"[green]ok[/] {figures}"
    if point.metrics.get("stopped_early") and "not_run" in point.metrics:
        missed = (point.metrics.get("stopped_on") or "the SLO").replace(",", ", ")
        return f"[red]stopped early[/]: {missed} sure to miss ({point.metrics['not_run']} not run)"
    return f"[red]miss[/] {figures}"


def _run(
    setup: dict[str, Any], out: Path, plot: bool, json_output: bool, quiet: bool, console: Console
) -> int:
    from bm.compare.expr import AssertionEvalError, evaluate_assertion
    from bm.sweep.report import gate_metrics, regressions, table, write_outputs
    from bm.sweep.runner import PointStore, run_sweep

    plan = setup.plan
    loaded = load_model_and_workload(setup.base, console)
    if loaded is None:
        return 2
    model, workload = loaded
    try:  # every point gets the same KV cache, sized once for the dataset and the largest point
        base = engine_config(setup.base, model, workload, console, [c.config for c in plan.configs])
        size = pin_cache(base, model).kv_cache.max_tokens
    except ValueError as exc:  # ConfigError, or the runtime's KVCacheSizeError (no torch import here)
        print_error(str(exc))
        return 2
    plan.configs = [_with_cache(c, model, size) for c in plan.configs]
    store = PointStore(out)
    sim = all(c.config.engine.executor == "sim" for c in plan.configs)
    workers = (
        f"{plan.workers} worker(s)"
        if sim
        else f"real engine, one point at a time, {plan.repeats} run(s) each"
    )
    console.print(f"{len(plan.configs)} configurations; {plan.slo.describe()}; {workers}", highlight=False)
    started = time.perf_counter()

    width = max(len(c.name) for c in plan.configs)

    def on_point(point: Any, reused: bool) -> None:
        if not quiet:
            console.print(
                f"  {point.config:<{width}} {plan.load} {point.load:<7g} {point_verdict(point)}"
                + (" (saved)" if reused else ""),
                highlight=False,
            )

    try:
        outcomes = run_sweep(plan, model, workload, store, on_point)
    except (Interrupted, KeyboardInterrupt):
        console.print(
            f"[yellow]interrupted: {len(store.points)} points saved; rerun with --resume -o {out}[/]"
        )
        return INTERRUPTED_EXIT
    wall = time.perf_counter() - started
    document = write_outputs(out, plan, outcomes, {"wall_time_s": wall, "model": model.name})
    if plot:
        from bm.sweep.plots import write_plots

        write_plots(out / "plots", plan, outcomes)
    if json_output:
        print(json.dumps(document, indent=2))
    else:
        header, rows = table(plan, outcomes)
        grid_table = Table(*header, title=f"highest {plan.load} within {plan.slo.describe()}")
        for row in rows:
            grid_table.add_row(*row)
        from bm.cli.tables import print_table

        print_table(console, grid_table)  # never cuts a configuration's name: it is what --assert reads
        console.print(
            f"wrote {out}/sweep.json, sweep.csv, sweep.md"
            + (", plots/" if plot else "")
            + f" in {wall:.0f} s"
        )
    bad = False
    metrics = gate_metrics(plan, outcomes)
    for assertion in setup.asserts:
        try:
            outcome = evaluate_assertion(assertion, metrics)
        except AssertionEvalError as exc:
            console.print(f"[red]FAILED: {exc}[/]", highlight=False)
            bad = True
            continue
        console.print(("[green]" if outcome.passed else "[red]") + outcome.message + "[/]", highlight=False)
        bad |= not outcome.passed
    if setup.previous is not None:
        for message in regressions(setup.previous, outcomes, setup.tolerance):
            console.print(f"[red]regression: {message}[/]", highlight=False)
            bad = True
    return 1 if bad else 0
