"""The ``bm`` command line. Each command validates its inputs up front and reports problems in one line
naming the setting and the fix (exit code 2), never with a traceback."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from bm.cli.exit_codes import FAILED, NO_SUCCESS, USAGE, run_exit_code
from bm.cli.help import CompactHelp, silence_progress_bars
from bm.cli.interrupts import Interrupts
from bm.cli.run_inputs import (
    EMBEDDED_NOTE,
    build_config,
    check_resume,
    check_tool_call_parser,
    prepare_run_out_dir,
    read_requests,
    read_template,
    run_seed_of,
)
from bm.config import ConfigError, config_reference
from bm.runfiles.source import open_prompts
from bm.stderr import print_error

# No hub access at run time: models come from local paths or configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

app = typer.Typer(
    name="bm",
    help="Offline LLM batch generation and benchmarking on an in-flight batching Batch Manager.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    """``--version``: bm's version and the torch and transformers it runs on (what a bug report needs)."""
    if not value:
        return
    import platform

    import torch
    import transformers

    import bm

    typer.echo(
        f"bm {bm.__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()})"
    )
    raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print bm's version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """Offline LLM batch generation and benchmarking on an in-flight batching Batch Manager."""


CONFIG_HELP = "YAML config with sections model, engine, kv_cache (see the keys below)."
DP_HELP = "Run N engine replicas as processes (torch.distributed, gloo); requests go to the least loaded."
TP_HELP = (
    "Shard the model over N ranks per replica, --ray's too (transformers tp_plan='auto'; needs --model)."
)
RANK_TIMEOUT_HELP = "Seconds a rank may stay silent before the run ends with an error (dead or hung rank)."
RAY_HELP = "Replicas on Ray (docs/parallel.md)."
REPLICAS_HELP = "--ray: replicas [GPUs, or CPUs / threads]."
REPLICA_THREADS_HELP = "--ray: threads per CPU replica rank [4]."
BLOCK_LINES_HELP = "--ray: lines per block [64]."
RAY_TRIES_HELP = "--ray: tries of a block [3]."
# The config sections bm run reads; bench, sim and sweep keys are bm bench's and bm sweep's business.
RUN_SECTIONS = ("model", "engine", "kv_cache", "peft_cache")
BENCH_EPILOG = (
    "Config keys (SECTION.KEY for --set): see bm run --help for model, engine and kv_cache; the flags "
    "above set the bench section's keys (--input-len sets bench.input_len); docs/config.md lists all."
)
SET_HELP = "Override one config key, e.g. --set engine.max_batch_size=64 (repeatable)."


def _fail(console: Console, message: str) -> typer.Exit:
    """The error on standard error (bm.cli.errors, shared by every command), exit code 2."""
    from bm.cli.errors import fail

    return fail(message, USAGE)


@app.command(
    epilog="Config keys (SECTION.KEY for --set, or a -c YAML file):\n" + config_reference(RUN_SECTIONS),
    cls=CompactHelp,
    short_help="Answer every line of a prompts or OpenAI batch file; one record per line.",
)
def run(
    prompts: Path = typer.Argument(
        ...,
        help="JSONL file: one request per line ({'prompt'|'input_ids'|'messages', ...}), or an OpenAI "
        "Batch API input file.",
    ),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    out_dir: Path | None = typer.Option(
        None,
        "--out-dir",
        "-o",
        help="Where outputs.jsonl, stats.jsonl and summary.json go [bm-out/run-TIME].",
    ),
    set_: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    model: str | None = typer.Option(
        None,
        "--model",
        help="A preset (smollm2-135m, tiny-random), a checkpoint dir or a cached hub id.",
    ),
    model_config: str | None = typer.Option(
        None, "--model-config", help="Model config JSON, random weights (sets model.config)."
    ),
    served_model_name: list[str] = typer.Option(
        [],
        "--served-model-name",
        metavar="NAME",
        help="A name body.model may give the base model (repeatable).",
        show_default=False,
    ),
    lora_modules: list[str] = typer.Option(
        [],
        "--lora-modules",
        metavar="NAME=DIR",
        help="An adapter body.model may name (repeatable).",
        show_default=False,
    ),
    generation_config: str | None = typer.Option(
        None,
        "--generation-config",
        metavar="auto|vllm|DIR",
        help="OpenAI lines' sampling defaults [auto].",
        show_default=False,
    ),
    max_tokens: int = typer.Option(
        64, "--max-tokens", min=1, help="Output length for bm lines that give none."
    ),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the model's end token."),
    chat_template: Path | None = typer.Option(
        None, "--chat-template", help="Jinja chat template for 'messages' lines (overrides the checkpoint's)."
    ),
    tool_call_parser: str | None = typer.Option(
        None,
        "--tool-call-parser",
        help="How to read tool calls from replies to lines with tools and tool_choice auto: hermes or "
        "llama3_json [detected from the chat template].",
    ),
    resume: bool = typer.Option(False, "--resume", help="Keep OUT_DIR's finished records; run the rest."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the results already in OUT_DIR."),
    seed: int | None = typer.Option(
        None, "--seed", min=0, help="Run seed for lines without one [random; --resume reuses it]."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    show: bool = typer.Option(False, "--show", help="Print every answer (id and text) after the run."),
    data_parallel: int | None = typer.Option(None, "--data-parallel", help=DP_HELP),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", "--tp", help=TP_HELP),
    rank_timeout: float = typer.Option(300.0, "--rank-timeout", help=RANK_TIMEOUT_HELP),
    ray: bool = typer.Option(False, "--ray", help=RAY_HELP),
    replicas: int | None = typer.Option(None, "--replicas", help=REPLICAS_HELP),
    replica_threads: int | None = typer.Option(None, "--replica-threads", help=REPLICA_THREADS_HELP),
    block_lines: int = typer.Option(64, "--block-lines", help=BLOCK_LINES_HELP, show_default=False),
    ray_tries: int = typer.Option(3, "--ray-tries", help=RAY_TRIES_HELP, show_default=False),
) -> None:
    """Generate for every line of PROMPTS; one output record per line, written as requests finish."""
    with Interrupts() as interrupts:  # from the start: a Ctrl-C while torch loads shows no traceback
        _run(**locals())


def _run(
    prompts: Path,
    config: Path | None,
    out_dir: Path | None,
    set_: list[str],
    model: str | None,
    model_config: str | None,
    served_model_name: list[str],
    lora_modules: list[str],
    generation_config: str | None,
    max_tokens: int,
    ignore_eos: bool,
    chat_template: Path | None,
    tool_call_parser: str | None,
    resume: bool,
    overwrite: bool,
    seed: int | None,
    quiet: bool,
    show: bool,
    data_parallel: int | None,
    tensor_parallel: int,
    rank_timeout: float,
    ray: bool,
    replicas: int | None,
    replica_threads: int | None,
    block_lines: int,
    ray_tries: int,
    interrupts: Any,
) -> None:
    from bm.distributed.cli import end_ranks, start_ranks

    given = dict(locals())  # the options as parsed, for the printed resume command
    console = Console(stderr=False)
    if quiet:
        silence_progress_bars()
    # Everything the user wrote is checked here, before torch and transformers load (seconds).
    try:
        cfg = build_config(
            config, set_, model, model_config, served_model_name, lora_modules, generation_config
        )
        # a pipe or gzip is copied once; a file with no line that can run on this model stops here
        source = open_prompts(prompts, has_tokenizer=not cfg.model.has_no_tokenizer)
        # Ranks other than 0 serve the run from here and exit: they touch no output file.
        if ray:  # before any rank starts
            from bm.ray.api import check_ray_run

            check_ray_run(
                cfg, data_parallel, tensor_parallel, rank_timeout, source,
                replicas, replica_threads, block_lines, ray_tries,
            )  # fmt: skip
        # under --ray a replica starts its own ranks (bm.ray.replica); the driver is one process
        multi_rank = not ray and start_ranks(console, cfg, tensor_parallel, data_parallel, rank_timeout)
        template = read_template(chat_template)
        check_tool_call_parser(tool_call_parser)
        out = out_dir or Path("bm-out") / time.strftime("run-%Y%m%d-%H%M%S")
        prepare_run_out_dir(out, resume, overwrite, source, max_tokens)
        run_seed = run_seed_of(out, seed, resume)
        if resume:  # before the model loads: a refused resume costs nothing
            check_resume(out, source, cfg, max_tokens, ignore_eos, template, run_seed, tool_call_parser, ray)
        parsed, batch_lines = read_requests(source.path, cfg)
    except (ConfigError, ValueError) as exc:
        raise _fail(console, str(exc)) from None
    if batch_lines is not None and cfg.model.is_embedded:
        print_error(EMBEDDED_NOTE, prefix="note:")

    from rich.markup import escape

    from bm.cli.run import RunOptions, run_prompts
    from bm.parallel.layout import ParallelError
    from bm.runfiles.run_summary import resume_command, summary_table
    from bm.runtime import KVCacheSizeError, ModelLoadError, UnsupportedAttentionError

    try:
        options = RunOptions(
            default_max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            show_progress=not quiet,
            prompts=source.path,
            prompts_name=source.name,
            resume=resume,
            chat_template=template,
            tool_call_parser=tool_call_parser,
            batch_lines=batch_lines,
            num_lines=None if quiet else _count_lines(source.path),
            run_seed=run_seed,
        )
        if ray:
            from bm.cli.ray_run import run_with_ray

            ray_flags = (replicas, replica_threads, block_lines, ray_tries, tensor_parallel, rank_timeout)
            summary = run_with_ray(options, cfg, out, console, interrupts, *ray_flags)
        else:
            summary = run_prompts(parsed, cfg, out, options, console, interrupts)
    except (ModelLoadError, KVCacheSizeError, UnsupportedAttentionError, ConfigError, ParallelError) as exc:
        raise _fail(console, str(exc)) from None  # ParallelError: --ray's replicas exceed the cluster's GPUs
    except OSError as exc:  # a full disk: the records written are whole, and --resume runs the rest
        from bm.cli.errors import disk_full_message, fail
        from bm.files import is_disk_full

        if not is_disk_full(exc):
            raise
        raise fail(disk_full_message(exc, resume_command(source.name, out, run, given)), FAILED) from None
    if show:
        _show_answers(console, out / "outputs.jsonl")
    from bm.cli.tables import print_table

    print_table(console, summary_table(summary))
    console.print(f"outputs: {out / 'outputs.jsonl'}  stats: {out / 'stats.jsonl'}", soft_wrap=True)
    records = "batch_output.jsonl" if batch_lines is not None else "outputs.jsonl"  # what the user reads
    if batch_lines is not None:
        console.print(f"OpenAI batch output: {out / 'batch_output.jsonl'}", soft_wrap=True)
    if summary.num_failed:
        console.print(f"[yellow]{summary.num_failed} request(s) failed; see their error in {records}[/]")
    end_ranks(console, multi_rank)
    if summary.interrupted:
        console.print(
            f"[yellow]interrupted: {summary.num_cancelled} request(s) cancelled; run them with[/] "
            + escape(resume_command(source.name, out, run, given)),
            soft_wrap=True,
        )
    # kept records of a --resume count as successes for the exit code (not for this run's tok/s)
    code = run_exit_code(
        summary.num_requests + summary.num_resumed, summary.num_ok + summary.num_resumed, summary.interrupted
    )
    if code == NO_SUCCESS:
        print_error(f"no request succeeded (exit code {code}); see the errors in {records}")
    if code:
        raise typer.Exit(code=code)


def _show_answers(console: Console, outputs: Path) -> None:
    from rich.markup import escape

    from bm.workloads.jsonl import iter_lines

    records = [r for _, r in iter_lines(outputs) if isinstance(r, dict)]
    # Each answer under its own header line, so multi-line answers never run into the next one.
    for record in sorted(records, key=lambda r: r.get("index", 0)):
        answer = record.get("text") if record.get("error") is None else f"[error] {record['error']}"
        console.print(f"[bold cyan]── {escape(str(record.get('id')))} ──[/]", soft_wrap=True)
        console.print(escape(str(answer).rstrip("\n")) or "(empty)", soft_wrap=True, highlight=False)


def _count_lines(path: Path) -> int:
    """The non-blank lines of a prompts file, for the progress bar's total: the run itself streams the
    file, and one pass over its bytes costs about a second per gigabyte."""
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _register_bench() -> None:
    """``bm bench`` lives in its own module; its heavy imports wait until it runs."""
    from bm.cli.bench import bench

    app.command(
        "bench",
        epilog=BENCH_EPILOG,
        cls=CompactHelp,
        short_help="Replay timed arrivals; report throughput and latency (vllm bench serve's names).",
    )(bench)


_register_bench()


def _register_compare() -> None:
    """``bm compare`` and ``bm report`` share bench's flags; their heavy imports wait until they run."""
    from bm.cli.compare import compare, report

    app.command(
        "compare",
        epilog=BENCH_EPILOG,
        cls=CompactHelp,
        short_help="Schemes, policies and HF baselines side by side on one workload, with CI gates.",
    )(compare)
    app.command("report", cls=CompactHelp, short_help="Draw the plots of a saved bench or compare run.")(
        report
    )


_register_compare()


def _register_sweep() -> None:
    """``bm sweep`` (bm/cli/sweep.py): capacity planning over a grid of configurations."""
    from bm.cli.sweep import sweep

    app.command(
        "sweep",
        cls=CompactHelp,
        short_help="The highest load each configuration of a grid sustains within SLOs.",
    )(sweep)


_register_sweep()


sim_app = typer.Typer(help="The simulator's hardware rows (bm bench --executor sim).", no_args_is_help=True)
app.add_typer(sim_app, name="sim")


@sim_app.command("calibrate")
def sim_calibrate(
    device: str | None = typer.Option(
        None,
        "--device",
        help="cpu, cuda or cuda:N (default: cuda when present, else cpu): cpu writes cpu-local, cuda cuda-local.",
    ),
) -> None:
    """Measure a device as bm's runtime sees it (GEMM throughput, copy bandwidth, per-op and per-step
    overheads) and cache it as its local hardware row: cpu-local or cuda-local (~/.cache/bm/ROW.yaml).
    Each model's forward is measured on bm's engine there at its first simulated run."""
    import yaml

    from bm.sim.hardware import calibrate, local_row_name, local_row_path

    try:
        row = calibrate(device)
        name = local_row_name(row["device"])
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(yaml.safe_dump(row, sort_keys=False).rstrip())
    typer.echo(f"written: {local_row_path(name)} ({name})")


if __name__ == "__main__":  # `python -m bm` also installs the signal handlers before these imports
    app()
