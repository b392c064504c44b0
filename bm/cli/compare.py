"""``bm compare`` and ``bm report``: batching schemes and policies side by side, CI gates, plots.

``bm compare`` takes the same dataset and arrival flags as ``bm bench`` (they set the same config keys),
so a benchmark config runs unchanged under compare. Everything the user wrote is checked before the model
loads: the variant names, every --assert expression (grammar and the variant/metric names it reads), the
baseline file and the tolerance, so a typo never costs a long run.
"""

from __future__ import annotations

import json
import time
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
from bm.cli.compare_gate import (
    TIME_LIMIT_S,
    Gate,
    check_gate_flags,
    gate_exit_code,
    load_with_arrivals,
    serve_pairs,
    start_worker,
    worker_ready,
)
from bm.cli.exit_codes import NOT_JUDGED
from bm.cli.help import silence_progress_bars
from bm.cli.interrupts import INTERRUPTED_EXIT, Interrupts
from bm.compare.baseline_file import read_baseline_document
from bm.config import BmConfig, ConfigError
from bm.runfiles.outdir import COMPARE_FILES, OutDirError, prepare_out_dir, remove_created
from bm.stderr import print_error

if TYPE_CHECKING:
    from bm.compare.expr import Assertion
    from bm.compare.runner import Variant

GATES, VARIANTS = "Gates", "Variants"


@with_shared_options
def compare(
    dataset: Path | None = typer.Argument(None, help="Dataset file or directory (as for bm bench)."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config (model, engine, kv_cache, bench)."),
    schemes: str = typer.Option("v1,inflight,inflight_fused", "--schemes", help="Comma-separated batching schemes.", rich_help_panel=VARIANTS),
    policies: str = typer.Option("guaranteed_no_evict", "--policies", help="Comma-separated scheduler policies.", rich_help_panel=VARIANTS),
    baselines: str = typer.Option("", "--baselines", help="Reference baselines: hf-generate, hf-cb.", rich_help_panel=VARIANTS),
    repeat: int | None = typer.Option(None, "--repeat", "-r", help="Interleaved rounds of every variant; figures are medians. [5 with --baseline, else 1]", show_default=False, rich_help_panel=VARIANTS),
    reference: str | None = typer.Option(None, "--reference", help="Variant the ratios are taken to [v1, else the first].", rich_help_panel=VARIANTS),
    hf_batch_size: int = typer.Option(16, "--hf-batch-size", help="hf-generate: requests per padded batch.", rich_help_panel=VARIANTS),
    out_dir: Path | None = typer.Option(None, "--out-dir", "-o", help="Output directory [bm-out/compare-TIME].", rich_help_panel=RUN),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the results already in OUT_DIR.", rich_help_panel=RUN),
    plot: bool = typer.Option(False, "--plot", help="Also write PNG plots into OUT_DIR/plots.", rich_help_panel=RUN),
    json_output: bool = typer.Option(False, "--json", help="Print only compare.json on stdout.", rich_help_panel=RUN),
    asserts: list[str] = typer.Option([], "--assert", help='Gate, e.g. "inflight_fused.output_throughput >= 2 * v1.output_throughput" (repeatable).', rich_help_panel=GATES),
    baseline: Path | None = typer.Option(None, "--baseline", help="A saved compare.json to check for regressions.", rich_help_panel=GATES),
    tolerance: str = typer.Option("10%", "--tolerance", help="Timing change against --baseline always allowed; more is allowed when the runs measured more noise (--noise-factor).", rich_help_panel=GATES),
    max_repeat: int | None = typer.Option(None, "--max-repeat", help="With --baseline: rounds in all when a timing looks regressed or too noisy to judge; the gate re-measures before it answers. [paired: none but --time-limit; saved timings: 6 x --repeat]", show_default=False, rich_help_panel=GATES),
    noise_factor: float = typer.Option(1.0, "--noise-factor", help="Saved timings: a timing regressed only when worse than the baseline by more than max(--tolerance, this x the larger measured spread: a median repeat's distance from the best); 0: by --tolerance alone.", rich_help_panel=GATES),
    baseline_cmd: str | None = typer.Option(None, "--baseline-cmd", help="With --baseline: the baseline's bm (e.g. ../base/.venv/bin/bm, or 'env PYTHONPATH=../base python -m bm'); its runs alternate with this run's and timings are judged on the pairs. Without it, on the saved timings.", rich_help_panel=GATES),
    time_limit: float = typer.Option(TIME_LIMIT_S, "--time-limit", help="With --baseline: seconds of measuring after which no run starts; timings not settled by then are not judged (exit 4).", rich_help_panel=GATES),
    allow_unjudged: bool = typer.Option(False, "--allow-unjudged", help="With --baseline: timings the gate could not judge (too noisy, or no quiet repeat) do not fail it (exit 0, not 4).", rich_help_panel=GATES),
    pair_worker: bool = typer.Option(False, "--pair-worker", hidden=True, help="Serve a paired gate's baseline side on stdin/stdout (started by --baseline-cmd)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines or progress bars.", rich_help_panel=RUN),
    **shared: Any,
) -> None:  # fmt: skip
    """Run every scheme x policy (and baseline) on the identical workload in one process, print one
    table, write compare.json and compare.md, and gate on --assert and --baseline (exit 1 on failure, 4
    when the baseline gate could not judge a timing)."""
    from bm.compare.expr import AssertionEvalError, AssertionSyntaxError, check_refs, parse_assertion
    from bm.compare.regress import BASELINE_REPEATS, ToleranceError, parse_noise_factor, parse_tolerance

    err = Console(stderr=True)
    if quiet or json_output or pair_worker:
        silence_progress_bars()
    flags = {**locals(), **shared}
    flags.pop("out_dir")  # compare's own directory, not bench.out_dir
    flags.pop("overwrite")
    flags.pop("json_output")
    try:
        cfg = resolve_config(config, shared["set_"], flags, shared["slo"])
        # files first: these checks need no torch, so a bad baseline or -o is reported at once
        tol = parse_tolerance(tolerance)
        noise = parse_noise_factor(noise_factor)
        previous = _read_baseline(baseline) if baseline is not None else None
        from bm.compare.variants import check_baselines_eos, plan_variants

        variants = plan_variants(schemes, policies, baselines)
        check_baselines_eos(variants, cfg.bench.ignore_eos)
        if pair_worker:  # the baseline's side of someone else's gate: no files, no gate of its own
            with Interrupts() as interrupts:
                code = serve_pairs(cfg, variants, hf_batch_size, _prepare, interrupts)
            if code:
                raise typer.Exit(code=code)
            return
        simulated = cfg.engine.executor == "sim"
        # what the baseline must share with this run: refused now, before the model loads
        identity = check_gate_flags(cfg, previous, baseline, variants, baseline_cmd, time_limit)
        if repeat is None:  # a baseline is judged against measured noise, which takes repeats
            repeat = BASELINE_REPEATS if baseline is not None and not simulated else 1
        if repeat < 1:
            raise ConfigError(f"--repeat {repeat}: must be at least 1")
        # the simulator's figures are the same every round: more rounds would only repeat them; a paired
        # gate's default is no cap but --time-limit (bm.cli.compare_gate.Gate.rounds_cap)
        most = repeat if simulated and max_repeat is None else max_repeat
        if most is not None and most < repeat:
            raise ConfigError(f"--max-repeat {most}: must be at least --repeat ({repeat})")
        if hf_batch_size < 1:
            raise ConfigError(f"--hf-batch-size {hf_batch_size}: must be at least 1")
        names = [v.name for v in variants]
        if reference is not None and reference not in names:
            raise ConfigError(f"--reference {reference!r}: not one of the variants ({', '.join(names)})")
        parsed = [parse_assertion(text) for text in asserts]
        known = _known_metrics()
        placeholder = {v.name: known for v in variants}
        for assertion in parsed:
            check_refs(assertion, placeholder)
        # last, so that no other usage error leaves a directory behind; the baseline is already read
        out = out_dir or Path("bm-out") / time.strftime("compare-%Y%m%d-%H%M%S")
        created = prepare_out_dir(
            out, resume=False, overwrite=overwrite, files=COMPARE_FILES, baseline=baseline
        )
    except (ConfigError, OutDirError, AssertionSyntaxError, AssertionEvalError, ToleranceError) as exc:
        print_error(str(exc))
        raise typer.Exit(code=2) from None
    console = err if json_output else Console()
    gate = None
    if previous is not None:
        gate = Gate(previous, str(baseline), tol, noise, repeat, most, time_limit, simulated)
    with Interrupts() as interrupts:
        try:
            code = _run(cfg, variants, parsed, gate, baseline_cmd, identity, repeat, reference, hf_batch_size, out, plot, json_output, quiet, allow_unjudged, console, interrupts)  # fmt: skip
        finally:
            if gate is not None:
                gate.close()
    if code == 2:  # a usage error found while loading: nothing was written
        remove_created(out, created)
    if code:
        raise typer.Exit(code=code)


def _known_metrics() -> set[str]:
    """The metric names a bm variant reports, so --assert typos fail before the run, not after it.

    Asked of the metric functions themselves (on an empty run), so the list cannot fall behind them."""
    import pandas as pd

    from bm.bench.metrics import RECORD_COLUMNS, engine_metrics, run_metrics

    records = pd.DataFrame(columns=list(RECORD_COLUMNS))
    from bm.bench.tally import StatsTally
    from bm.compare.load import BACKGROUND_SHARE
    from bm.compare.regress import kv_block_counters

    return (
        set(run_metrics(records, 0.0, {"ttft": 1.0}))
        | set(engine_metrics(pd.DataFrame(), records))
        | set(kv_block_counters(StatsTally()))
        | {BACKGROUND_SHARE}  # the share of the CPU other processes took during the run
    )


def _read_baseline(path: Path) -> dict[str, Any]:
    document = read_baseline_document(path, "compare", "variants")
    # checked now, not after the run: a malformed baseline must not cost the results
    for name, variant in document["variants"].items():
        if not isinstance(variant, dict) or not isinstance(variant.get("metrics", {}), dict):
            raise ConfigError(
                f"--baseline {path}: variants.{name}: expected an object with a 'metrics' mapping, "
                f"got {json.dumps(variant)[:40]}; regenerate it with bm compare -o DIR"
            )
    return document


def _prepare(cfg: BmConfig, console: Console) -> tuple[BmConfig, Any, Any] | None:
    """The model and workload loaded, and the config every variant runs with: the same engine budgets
    and the same KV cache for all (sized once, here). None when either cannot load (said: exit 2)."""
    from bm.runtime import KVCacheSizeError
    from bm.workloads import DatasetError

    loaded_pair = load_model_and_workload(cfg, console)
    if loaded_pair is None:
        return None
    loaded, workload = loaded_pair
    try:
        cfg = pin_cache(engine_config(cfg, loaded, workload, console), loaded)
    except (DatasetError, ConfigError, KVCacheSizeError) as exc:
        print_error(str(exc))
        return None
    return cfg, loaded, workload


def _run(
    cfg: BmConfig,
    variants: list[Variant],
    parsed: list[Assertion],
    gate: Gate | None,
    baseline_cmd: str | None,
    identity: dict[str, Any],
    repeat: int,
    reference: str | None,
    hf_batch_size: int,
    out: Path,
    plot: bool,
    json_output: bool,
    quiet: bool,
    allow_unjudged: bool,
    console: Console,
    interrupts: Interrupts,
) -> int:
    from bm.cli.journal import FileJournal
    from bm.compare.expr import AssertionEvalError, evaluate_assertion
    from bm.compare.render import write_compare
    from bm.compare.runner import run_compare
    from bm.report.data import variant_dir
    from bm.runtime import KVCacheSizeError

    spawn_error = start_worker(gate, baseline_cmd, console)  # it loads while this process loads
    prepared = load_with_arrivals(_prepare, cfg, console)
    if prepared is None:
        return 2
    cfg, loaded, workload, arrivals = prepared
    pairing_error = worker_ready(gate, variants, console, interrupts.stop)
    paired = gate is not None and gate.worker is not None
    console.print(f"{len(variants)} variants x {repeat} repeat(s), interleaved" + (", each paired with the baseline's" if paired else ""), highlight=False)  # fmt: skip
    started: dict[str, float] = {}

    def on_start(v: Variant, r: int, _m: dict[str, Any]) -> None:
        started[v.name] = time.perf_counter()

    def on_done(v: Variant, r: int, m: dict[str, Any]) -> None:
        if not quiet:
            took = time.perf_counter() - started[v.name]
            console.print(
                f"  [{r + 1}/{max(repeat, r + 1)}] {v.name:<32} {m.get('output_throughput') or 0:8.1f} out tok/s  ({took:.1f} s)",
                highlight=False,
            )

    def run_theirs(v: Variant) -> dict[str, Any]:
        assert gate is not None and gate.worker is not None
        return gate.worker.run(v, interrupts.stop)

    interrupts.running()  # from here the first signal ends the run in progress; finished rounds are kept
    if gate is not None:
        gate.start_clock()
    try:
        result = run_compare(cfg, loaded, workload, arrivals, variants, repeat=repeat, reference=reference,
                             hf_batch_size=hf_batch_size, on_start=on_start, on_done=on_done,
                             journal=lambda v: FileJournal(variant_dir(out, v.name)),
                             more_rounds=None if gate is None else lambda r: gate.more_rounds(r, console),
                             stop=interrupts.stop, paired=run_theirs if paired else None,
                             deadline=None if gate is None else gate.deadline)  # fmt: skip
    except (KVCacheSizeError, ConfigError) as exc:
        print_error(str(exc))
        return 2
    result.identity = identity
    result.pairing_error = result.pairing_error or pairing_error or spawn_error
    if result.interrupted:
        return _interrupted(console, result, out, interrupts.signal_name)
    if result.repeat == 0:  # the time limit came before one round finished: nothing to judge
        write_compare(out, result)
        print_error(
            f"--time-limit {gate.time_limit if gate else 0:g}: no round finished in time; nothing was "
            f"judged (exit {NOT_JUDGED}); raise --time-limit"
        )
        return NOT_JUDGED
    metrics = result.metrics()
    failed_eval = []
    for assertion in parsed:
        try:
            result.assertions.append(evaluate_assertion(assertion, metrics))
        except AssertionEvalError as exc:
            failed_eval.append(str(exc))
    if gate is not None:
        gate.apply(result)
    document = write_compare(out, result)
    if plot:
        from bm.report.data import load_plot_data
        from bm.report.plots import write_plots

        write_plots(load_plot_data(out), out / "plots")
    if json_output:
        print(json.dumps(document, indent=2))
    else:
        from bm.cli.tables import print_table

        for table in compare_tables(result, console.width):
            print_table(console, table)
        console.print(f"wrote {out / 'compare.json'} and {out / 'compare.md'}" + (f", plots in {out / 'plots'}" if plot else ""),
                      soft_wrap=True)  # fmt: skip
    return gate_exit_code(console, result, failed_eval, allow_unjudged)  # already stderr under --json


def _interrupted(console: Console, result: Any, out: Path, signal_name: str | None) -> int:
    """A signal ended the comparison: the rounds every variant finished are written (compare.json says
    ``interrupted``), no gate is judged on them, and the exit code is 130, never a pass."""
    from bm.compare.render import write_compare

    if result.repeat == 0:
        print_error(
            f"{signal_name}: interrupted before every variant finished a round; nothing to compare "
            f"(each run's records so far are in {out / 'variants'})"
        )
        return INTERRUPTED_EXIT
    write_compare(out, result)
    from bm.cli.tables import print_table

    for table in compare_tables(result, console.width):
        print_table(console, table)
    print_error(
        f"{signal_name}: interrupted after {result.repeat} round(s); {out / 'compare.json'} holds them, "
        "and no gate was judged"
    )
    return INTERRUPTED_EXIT


def compare_tables(result: Any, width: int = 200) -> list[Table]:
    """Variants as rows, each name in full; the figures are split over as many tables as it takes to
    fit ``width``, so nothing is truncated on an 80-column terminal or in a CI log."""
    from bm.compare.render import table_rows

    header, rows = table_rows(result)
    name_width = max(len(header[0]), *(len(r[0]) for r in rows))
    budget = max(width - name_width - 4, 1)  # the name column, its padding and the borders
    groups: list[list[int]] = [[]]
    used = 0
    for i in range(1, len(header)):
        # a long header may wrap at its spaces; a cell may not
        words = max(len(word) for word in header[i].split())
        needed = max(min(len(header[i]), 16), words, *(len(r[i]) for r in rows)) + 3
        if groups[-1] and used + needed > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += needed
    tables = []
    for n, group in enumerate(groups):
        title = "bm compare (latencies in ms; medians over repeats)" if n == 0 else None
        table = Table(title=title, title_justify="left")
        table.add_column(header[0], no_wrap=name_width <= width // 2, overflow="fold")
        for i in group:
            table.add_column(header[i], justify="right", overflow="fold")
        for row in rows:
            table.add_row(row[0], *(row[i] for i in group))
        tables.append(table)
    return tables


def report(
    out_dir: Path = typer.Argument(..., help="A bm bench or bm compare output directory."),
    plots_dir: Path | None = typer.Option(None, "--plots-dir", help="Where the PNGs go [OUT_DIR/plots]."),
) -> None:
    """Draw the plots of a saved bench or compare run: latency CDFs, throughput bars, batch composition,
    KV utilization and paused requests."""
    from bm.report.data import load_plot_data
    from bm.report.plots import write_plots

    console = Console()
    try:
        data = load_plot_data(out_dir)
    except (FileNotFoundError, json.JSONDecodeError, ValueError) as exc:
        print_error(str(exc))
        raise typer.Exit(code=2) from None
    paths = write_plots(data, plots_dir or out_dir / "plots")
    for path in paths:
        console.print(str(path), highlight=False)
