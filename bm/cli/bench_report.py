"""``bm bench`` on the terminal: the progress bar while it runs and the result tables after.

The tables read only the results document, so what is shown is exactly what ``results.json`` holds.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from bm.bench import ReplayProgress
from bm.cli.progress import PlainProgress, eta_s, format_duration

LATENCY_ROWS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"), ("queue_time", "Queue"))
LATENCY_MEANINGS = {
    "ttft": "time to first token",
    "tpot": "time per output token after the first",
    "itl": "every gap between tokens",
    "e2el": "end-to-end latency",
    "queue_time": "arrival to first scheduled iteration",
}
LATENCY_CAPTION = ", ".join(f"{label}: {LATENCY_MEANINGS[key]}" for key, label in LATENCY_ROWS)


def bench_progress(console: Console, enabled: bool) -> Progress:
    """The replay's bar: requests done, elapsed time, time left, output tok/s and req/s (fits 80
    columns; the bar gives way first)."""
    return Progress(
        TextColumn("[progress.description]{task.description}", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=None),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
        TextColumn(
            "ETA {task.fields[eta]}  {task.fields[tps]} output tok/s  {task.fields[rps]} req/s",
            table_column=Column(no_wrap=True),
        ),
        console=console,
        disable=not enabled,
        transient=False,
    )


def replay_eta(snapshot: ReplayProgress) -> float | None:
    """Seconds left at the rate so far: from output tokens when the run's total is known (every
    request runs to its length), else from requests."""
    if snapshot.num_expected_output_tokens is not None:
        return eta_s(snapshot.num_output_tokens, snapshot.num_expected_output_tokens, snapshot.elapsed_s)
    return eta_s(snapshot.num_finished, snapshot.num_requests, snapshot.elapsed_s)


def tick(progress: Progress, task: Any, snapshot: ReplayProgress, plain: PlainProgress | None = None) -> None:
    """Live figures since the replay started: finished requests, time left, output tokens per second;
    on the bar, and every few seconds as a plain line where no bar is drawn."""
    elapsed = max(snapshot.elapsed_s, 1e-9)
    eta = replay_eta(snapshot)
    progress.update(
        task,
        completed=snapshot.num_finished,
        tps=f"{snapshot.num_output_tokens / elapsed:,.0f}",
        rps=f"{snapshot.num_finished / elapsed:,.2f}",
        eta=format_duration(eta),
    )
    if plain is not None:
        plain.update(
            snapshot.num_finished, snapshot.num_requests, snapshot.num_output_tokens, snapshot.elapsed_s, eta
        )


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def summary_table(results: dict[str, Any]) -> Table:
    interrupted = bool(results.get("interrupted"))
    title = (
        "bm bench [yellow](interrupted: figures cover the requests that finished)[/]"
        if interrupted
        else "bm bench"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    arrivals = results["arrivals"]
    rows = [
        ("Model", results["model"]),
        ("Dataset", f"{results['dataset']['kind']}: {results['dataset']['path']}"),
        ("Arrivals", ", ".join(f"{k}={v}" for k, v in arrivals.items() if v is not None)),
        ("Successful requests", results["completed"]),
        ("Failed requests", results["failed"]),
        *([("Cancelled requests (not sent or cut off)", results.get("cancelled"))] if interrupted else []),
        ("Benchmark duration (s)", results["duration"]),
        ("Total input tokens", results["total_input_tokens"]),
        ("Total generated tokens", results["total_output_tokens"]),
        ("Request throughput (req/s)", results["request_throughput"]),
        ("Request goodput (req/s)", results["request_goodput"]),
        ("Output token throughput (tok/s)", results["output_throughput"]),
        ("Total token throughput (tok/s)", results["total_token_throughput"]),
    ]
    if results["slo_ms"]:
        rows.insert(10, ("Goodput SLOs (ms)", ", ".join(f"{k}<={v:g}" for k, v in results["slo_ms"].items())))
    for name, value in rows:
        table.add_row(name, _fmt(value))
    return table


def latency_table(results: dict[str, Any]) -> Table:
    """Mean, median, std and the percentiles ``--metric-percentiles`` asks (p90, p95, p99 by default; p50
    is the median) of the latencies ``--percentile-metrics`` names (all five by default)."""
    bench = results.get("config", {}).get("bench", {})
    percentiles = bench.get("metric_percentiles") or (90, 95, 99)
    shown = bench.get("percentile_metrics") or [key for key, _ in LATENCY_ROWS]
    columns = ("mean", "median", "std", *(f"p{p:g}" for p in percentiles if p != 50))
    rows = [(key, label) for key, label in LATENCY_ROWS if key in shown]
    caption = ", ".join(f"{label}: {LATENCY_MEANINGS[key]}" for key, label in rows)
    table = Table(title="Latency (ms)", title_justify="left", caption=caption, caption_justify="left")
    table.add_column("metric")
    for column in columns:
        table.add_column(column, justify="right")
    for key, label in rows:
        table.add_row(label, *(_fmt(results.get(f"{c}_{key}_ms")) for c in columns))
    return table


REASON_NAMES = {"stop": "the end token or a stop word", "length": "the length cap"}


def shortfall_line(results: dict[str, Any]) -> str | None:
    """``output fell 94 tokens short of the 384 asked: 6 of 8 completed requests ended early (the end
    token: 6); --respect-eos was given`` when a run produced fewer tokens than its rows asked, else None.
    Throughput over lengths the model chose is not the benchmark the dataset describes, so it is said."""
    short = results.get("output_tokens_short")
    if not short:
        return None
    reasons = ", ".join(
        f"{REASON_NAMES.get(reason, reason)}: {count:,}"
        for reason, count in (results.get("short_finish_reasons") or {}).items()
    )
    why = (
        "--respect-eos stops a request at the model's end token; drop it to run every request to its length"
        if not results["config"]["bench"]["ignore_eos"]
        else "their rows' own end_id, stop words or a length cap ended them"
    )
    return (
        f"output fell {short:,} tokens short of the {results['requested_output_tokens']:,} asked: "
        f"{results['num_requests_short']:,} of {results['completed']:,} completed requests ended before "
        f"their length ({reasons}); {why}"
    )


def _budgets(engine: dict[str, Any]) -> str:
    """``128 requests, 2,048 tokens, chunked``: what the engine's defaults resolved to on this device."""
    chunked = "chunked" if engine.get("enable_chunked_context") else "whole contexts"
    return f"{_fmt(engine.get('max_batch_size'))} requests, {_fmt(engine.get('max_num_tokens'))} tokens, {chunked}"


def engine_table(results: dict[str, Any]) -> Table:
    table = Table(title="Batch manager", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    engine = results["config"]["engine"]
    rows = [
        ("Scheme / policy", f"{engine['batching_scheme']} / {engine['scheduler_policy']}"),
        ("Budgets (an iteration)", _budgets(engine)),
        ("Iterations", results["num_iterations"]),
        ("Mean requests per iteration", results["mean_requests_per_iteration"]),
        ("Mean tokens per iteration", results["mean_tokens_per_iteration"]),
        ("Mean iteration latency (ms)", results["mean_iteration_latency_ms"]),
        ("Computed tokens (padding included)", results["total_computed_tokens"]),
        ("Empty generation slots", results["total_empty_generation_slots"]),
        ("KV cache utilization, mean", _percent(results["mean_kv_cache_utilization"])),
        ("KV cache utilization, max", _percent(results["max_kv_cache_utilization"])),
        ("Paused requests", results["num_paused_requests"]),
        ("Total pauses", results["total_pauses"]),
    ]
    if results.get("total_draft_tokens"):
        rows += [
            (
                "Draft tokens (accepted)",
                f"{results['total_draft_tokens']} ({results['total_accepted_draft_tokens']})",
            ),
            ("Draft acceptance rate", _percent(results["draft_acceptance_rate"])),
            ("Mean acceptance length", results["mean_acceptance_length"]),
        ]
    for name, value in rows:
        table.add_row(name, _fmt(value))
    return table


def _percent(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def print_results(console: Console, results: dict[str, Any]) -> None:
    from bm.cli.tables import print_table

    for table in (summary_table(results), latency_table(results), engine_table(results)):
        print_table(console, table)
    if results.get("executor") == "sim":
        print_table(console, sim_table(results))


def sim_table(results: dict[str, Any]) -> Table:
    """A simulated run: the device it priced, its cost, and the wall time the simulation itself took."""
    table = Table(title="Simulator (times above are simulated)", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    runtime = results["runtime"]
    hw = runtime["hardware"]
    rows = [
        (
            "Hardware",
            f"{hw['key']} x {runtime['num_devices']} (tensor parallel {runtime['tensor_parallel']})",
        ),
        ("Price per device-hour (USD)", hw["price_per_hour"]),
        ("KV cache capacity (tokens)", results.get("kv_cache_capacity_tokens")),
        ("Cost (USD)", results.get("cost_usd")),
        ("Cost per million output tokens (USD)", results.get("cost_per_million_output_tokens")),
        ("Cost per million total tokens (USD)", results.get("cost_per_million_total_tokens")),
        ("Wall time of the simulation (s)", results.get("wall_time_s")),
    ]
    for name, value in rows:
        table.add_row(name, _fmt(value, 4) if isinstance(value, float) and value < 1 else _fmt(value))
    return table
