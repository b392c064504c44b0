"""``bm bench``: replay a dataset of timed arrivals through the batch manager, measure, report.

Every flag sets one key of the config's ``bench`` section; the options bench shares with ``bm compare``
and ``bm sweep``, and how flags become a config, are in :mod:`bm.cli.bench_options`. Loading the model
and the dataset, and sizing the engine for them, are here, and those commands use them too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape

from bm.cli.bench_options import MODEL, RUN, resolve_config, with_shared_options  # compare, sweep: too
from bm.cli.exit_codes import NO_SUCCESS, USAGE, run_exit_code
from bm.cli.interrupts import Interrupts
from bm.config import BmConfig, ConfigError, ModelConfig, resolve_engine
from bm.stderr import print_error

if TYPE_CHECKING:
    from bm.runtime import LoadedModel
    from bm.workloads import Workload


@with_shared_options
def bench(
    dataset: Path | None = typer.Argument(None, help="Dataset file or directory (kind detected unless given); - reads standard input, .gz is decompressed."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config (model, engine, kv_cache, bench)."),
    scheme: str | None = typer.Option(None, "--scheme", help="engine.batching_scheme.", rich_help_panel=MODEL),
    policy: str | None = typer.Option(None, "--policy", help="engine.scheduler_policy.", rich_help_panel=MODEL),
    out_dir: Path | None = typer.Option(None, "--out-dir", "-o", help="Results directory (default bm-out/bench-TIME).", rich_help_panel=RUN),
    json_output: bool | None = typer.Option(None, "--json/--no-json", help="Print only the results JSON.", rich_help_panel=RUN),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar.", rich_help_panel=RUN),
    plot: bool = typer.Option(False, "--plot", help="Also write PNG plots into OUT_DIR/plots.", rich_help_panel=RUN),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the results already in OUT_DIR.", rich_help_panel=RUN),
    data_parallel: int | None = typer.Option(None, "--data-parallel", help="Run N engine replicas as processes (torch.distributed); requests go to the least loaded.", rich_help_panel=MODEL),
    rank_timeout: float = typer.Option(300.0, "--rank-timeout", help="Seconds a rank may stay silent before the run ends with an error.", rich_help_panel=MODEL),
    **shared: Any,
) -> None:  # fmt: skip
    """Replay DATASET's requests at their arrival times through the batch manager; report throughput,
    latency (vllm bench serve's metric names) and the batch manager's figures."""
    from bm.distributed.cli import end_ranks, start_ranks
    from bm.runfiles.outdir import BENCH_FILES, OutDirError, prepare_out_dir

    flags = {**locals(), **shared}
    try:
        cfg = resolve_config(config, shared["set_"], flags, shared["slo"])
    except ConfigError as exc:
        raise _fail(Console(stderr=True), str(exc)) from None
    console = Console(stderr=cfg.bench.json_output)
    if quiet or cfg.bench.json_output:
        from bm.cli.help import silence_progress_bars

        silence_progress_bars()
    # --tensor-parallel (shared with compare) splits the simulated model under engine.executor=sim; under
    # the torch executor bm bench splits the real one over that many ranks. Ranks other than 0 serve the
    # run from here and exit: they touch no output file.
    tensor_parallel = 1 if cfg.engine.executor == "sim" else (shared["tensor_parallel"] or 1)
    multi_rank = start_ranks(console, cfg, tensor_parallel, data_parallel, rank_timeout)
    try:
        out = Path(cfg.bench.out_dir or Path("bm-out") / time.strftime("bench-%Y%m%d-%H%M%S"))
        prepare_out_dir(out, resume=False, overwrite=overwrite, files=BENCH_FILES)
        cfg.bench.out_dir = str(out)
    except (ConfigError, OutDirError) as exc:
        raise _fail(Console(stderr=True), str(exc)) from None
    with Interrupts() as interrupts:
        code = run_command(cfg, console, not (quiet or cfg.bench.json_output), plot, interrupts)
    end_ranks(console, multi_rank)
    if code:
        raise typer.Exit(code=code)


def _fail(console: Console, message: str) -> typer.Exit:
    """The error on standard error (bm.stderr), exit code 2; ``console`` is kept for callers."""
    print_error(message)
    return typer.Exit(code=USAGE)


def run_command(
    cfg: BmConfig,
    console: Console,
    show_progress: bool,
    plot: bool = False,
    interrupts: Interrupts | None = None,
) -> int:
    """Load, replay, write ``results.json`` / ``requests.jsonl`` / ``stats.jsonl``, report. Returns the exit code.

    ``interrupts``: the command's signal policy (bm.cli.interrupts). A signal while the model loads ends
    the command there (nothing was measured); once the replay starts, the first signal cancels what has
    not finished and the results of what did are written as usual, marked interrupted.

    ``stats.jsonl`` and ``requests.jsonl`` are written as the run goes (:class:`bm.cli.journal.FileJournal`),
    so a killed run leaves what it did and the run keeps none of it in memory; at the end
    ``requests.jsonl`` is put in workload order (``stats.jsonl`` is complete as streamed). Plots are
    drawn from the written files (the path ``bm report`` takes), so a plot never shows anything the
    saved results do not hold."""
    bench = cfg.bench
    loaded_pair = load_model_and_workload(cfg, console)
    if loaded_pair is None:
        return USAGE
    from bm.bench import run_bench, write_results
    from bm.bench.results import startup_line
    from bm.cli.bench_report import bench_progress, print_results, shortfall_line, tick
    from bm.cli.journal import FileJournal
    from bm.cli.progress import PlainProgress

    if cfg.engine.executor == "sim":  # no torch under the simulator: its import alone costs seconds

        class KVCacheSizeError(Exception):
            """Never raised by the simulator (it sizes its cache from the hardware row)."""

    else:
        from bm.runtime import KVCacheSizeError

    loaded, workload = loaded_pair
    cfg = engine_config(cfg, loaded, workload, console)
    out = Path(bench.out_dir) if bench.out_dir else Path("bm-out") / time.strftime("bench-%Y%m%d-%H%M%S")
    # On a terminal rich draws the bar; elsewhere (a CI log, a pipe) it would show nothing until the
    # end, so a plain line is printed every few seconds instead.
    progress = bench_progress(console, show_progress and console.is_terminal)
    plain = PlainProgress(console, "bm bench") if show_progress and not console.is_terminal else None
    total = sum(r.ok for r in workload.requests)
    task = progress.add_task("replaying", total=total, tps="0", rps="0", eta="?")
    interrupts = interrupts if interrupts is not None else Interrupts(bound_s=None)
    interrupts.running()  # a signal from here on cancels the replay, and the results are still written
    try:
        with progress, FileJournal(out, workload.requests) as journal:
            result = run_bench(
                cfg,
                loaded,
                workload,
                progress=lambda p: tick(progress, task, p, plain),
                journal=journal,
                stop=interrupts.stop,
            )
    except KVCacheSizeError as exc:
        print_error(str(exc))
        return USAGE
    if plain is not None:
        plain.finish()
    result.startup["load_model_s"] = getattr(loaded, "load_seconds", None)
    results = write_results(out, result)
    if bench.json_output:
        print(json.dumps(results, indent=2))
    else:
        console.print(startup_line(results["startup"]), highlight=False)
        print_results(console, results)
        console.print(
            f"results: {out / 'results.json'}  requests: {out / 'requests.jsonl'}  stats: {out / 'stats.jsonl'}",
            soft_wrap=True,
        )
    if plot:
        from bm.report.data import load_plot_data
        from bm.report.plots import write_plots

        paths = write_plots(load_plot_data(out), out / "plots")
        console.print(f"plots: {len(paths)} PNGs in {out / 'plots'}", soft_wrap=True)
    short = shortfall_line(results)
    if short is not None:
        console.print(f"[yellow]{escape(short)}[/]", highlight=False)
    if results["failed"]:
        console.print(f"[yellow]{results['failed']} request(s) failed; see their error in requests.jsonl[/]")
    if result.interrupted:  # the table alone looked like a finished run
        console.print(
            f"[yellow]interrupted: {results.get('cancelled', 0)} request(s) cancelled (not sent, or cut off); "
            f"the figures cover the {results['completed']} that finished[/]",
            highlight=False,
        )
    code = run_exit_code(results["num_requests"], results["completed"], result.interrupted)
    if code == NO_SUCCESS:
        print_error(f"no request succeeded (exit code {code}); see the errors in requests.jsonl")
    return code


def _read_dataset(bench: Any, model: ModelConfig | None = None) -> Workload:
    """Every row of the dataset: an OpenAI batch file through the batch reader ``bm run`` uses (it lives
    with the CLI, which owns that format), any other kind through :func:`bm.workloads.read_workload`.

    A pipe (``-``, ``/dev/stdin``) or a gzip file is read through the one copy :func:`open_dataset` makes
    (as ``bm run`` reads its prompts), so every kind that reads one file takes it; messages name the
    input as the user gave it, never the copy. ``model``: the config's model section, which routes an
    OpenAI batch line's ``body.model`` and gives its sampling defaults as in ``bm run``."""
    from dataclasses import replace

    from bm.runfiles.source import PromptsFileError, open_dataset
    from bm.workloads import DatasetError, detect_kind, read_workload

    if bench.dataset is None or bench.dataset_kind == "synthetic":
        return read_workload(bench)
    try:
        source = open_dataset(bench.dataset)
    except PromptsFileError as exc:
        raise DatasetError(str(exc)) from None
    path, kind = source.path, bench.dataset_kind
    try:
        if kind == "auto" and path.is_file():
            kind = detect_kind(path, bench.prompt_column)
        if source.copied and kind == "hf":
            raise DatasetError(
                f"dataset {source.name!r} is read as a Hugging Face table (--dataset-kind hf), and "
                "Hugging Face datasets reads a named file or directory, not a pipe or a gzip file; save "
                "it uncompressed (e.g. zcat data.jsonl.gz > data.jsonl) and give that path"
            )
        if kind == "openai-batch" and path.is_file():
            from bm.runfiles.openai_batch import IgnoredFieldNotices, load_batch_workload
            from bm.runfiles.served_models import ANY_MODEL, ServedModels

            served = ServedModels.of(model) if model is not None else ANY_MODEL
            workload = load_batch_workload(path, bench.output_len, served, IgnoredFieldNotices())
        else:
            workload = read_workload(replace(bench, dataset=str(path), dataset_kind=kind))
    except DatasetError as exc:
        if not source.copied:
            raise
        raise DatasetError(str(exc).replace(str(path), source.name)) from None
    except UnicodeDecodeError as exc:  # the kind detection reads a CSV header as text
        raise DatasetError(f"{source.name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if source.copied:
        workload.source = source.name
    return workload


def load_model_and_workload(cfg: BmConfig, console: Console) -> tuple[LoadedModel, Workload] | None:
    """Load the model, then the dataset with its tokenizer, and say what was read (skipped and failing
    rows included); on a bad model or dataset print the error and return None (exit code 2)."""
    from bm.runfiles.chat import ChatTemplateError
    from bm.workloads import DatasetError, load_workload

    try:
        rows = _read_dataset(
            cfg.bench, cfg.model
        )  # the dataset first: a bad file is reported before the model loads
        _check_some_row_runs(rows)
    except (DatasetError, ConfigError) as exc:
        print_error(str(exc))
        return None
    sim = cfg.engine.executor == "sim"
    if sim:  # no weights, no torch: the model's shape and a hardware row (bm.bench.simulated)
        load_errors: tuple[type[Exception], ...] = ()
    else:
        from bm.model_fit import load_fitting_model
        from bm.runtime import ModelLoadError, UnsupportedAttentionError

        load_errors = (ModelLoadError, UnsupportedAttentionError)
    try:
        template = _chat_template(cfg.bench.chat_template)  # checked before the model loads
        console.print(
            f"loading model ({cfg.model.preset or cfg.model.path or cfg.model.config or 'embedded tiny-llama'}) ..."
        )
        if sim:
            from bm.bench.simulated import load_sim_model

            loaded = load_sim_model(cfg)
        else:
            loaded = load_fitting_model(cfg.model)  # a tokenizer that does not fit is refused here
        tokenizer = loaded.tokenizer
        render_chat = None
        if tokenizer is not None:  # chat rows render as bm run renders them (its codec)
            from bm.runfiles.prompts import codec_for

            render_chat = codec_for(loaded, template).render_chat
        workload = load_workload(
            cfg.bench,
            vocab_size=loaded.vocab_size,
            encode=tokenizer.encode if tokenizer is not None else None,
            encode_word=tokenizer.encode_word if tokenizer is not None else None,
            workload=rows,
            render_chat=render_chat,
        )
        _check_some_row_runs(workload)  # e.g. chats for a model with no chat template
    except (*load_errors, DatasetError, ConfigError, ChatTemplateError) as exc:
        print_error(str(exc))
        return None
    _report_dataset(console, workload)
    return loaded, workload


def _check_some_row_runs(workload: Workload) -> None:
    """A dataset none of whose rows can run is refused (exit 2) rather than replayed as empty tables."""
    from bm.workloads import DatasetError

    bad = [r for r in workload.requests if not r.ok]
    if bad and len(bad) == len(workload.requests):
        raise DatasetError(
            f"{workload.source}: none of its {len(bad)} rows can run; the first: {bad[0].error}"
        )


def _chat_template(path: str | None) -> str | None:
    """The text of ``--chat-template`` (bench.chat_template), read and checked as bm run checks its own."""
    if path is None:
        return None
    from bm.runfiles.chat import read_chat_template

    return read_chat_template(Path(path))


def engine_config(
    cfg: BmConfig, model: Any, workload: Workload, console: Console, others: Sequence[BmConfig] = ()
) -> BmConfig:
    """``cfg`` as the run will use it: the budgets resolved for the model's device (what results.json
    records), and the KV cache sized for the dataset unless ``kv_cache.max_tokens`` is set, the same
    cache for ``cfg`` and every config of ``others`` (a sweep's other points), said on one line."""
    from bm.bench.sizing import size_cache, workload_cache

    cfg = resolve_engine(cfg, model.device_type)
    others = [resolve_engine(c, model.device_type) for c in others]
    needed = workload_cache(workload, [cfg, *others])  # as run_bench would size it (bm.bench.runner)
    if needed is not None and cfg.kv_cache.max_tokens is None:
        console.print(needed.describe(), highlight=False, soft_wrap=True)
    return size_cache(cfg, needed)


def pin_cache(cfg: BmConfig, model: Any) -> BmConfig:
    """``cfg`` with the cache's size fixed now, for runs that build several engines in one process (the
    variants of ``bm compare``, the points of ``bm sweep``): each then gets this cache, whatever memory
    the previous engine's cache left reserved. The simulator's is fixed by its hardware row already."""
    from dataclasses import replace

    if not hasattr(model, "kv_bytes_per_token"):
        return cfg
    from bm.runtime import num_kv_blocks

    kv = cfg.kv_cache
    return replace(cfg, kv_cache=replace(kv, max_tokens=num_kv_blocks(model, kv) * kv.tokens_per_block))


def _report_dataset(console: Console, workload: Any) -> None:
    info = workload.describe()
    console.print(f"dataset: {info['kind']} {info['path']}: {info['num_requests']} requests", highlight=False)
    if info["num_skipped"]:
        console.print(f"[yellow]skipped {info['num_skipped']} rows: {info['skipped_reason']}[/]")
    bad = [r for r in workload.requests if not r.ok]
    if bad:
        console.print(
            f"[yellow]{len(bad)} row(s) cannot run and count as failed; first: {bad[0].error}[/]",
            highlight=False,
        )
