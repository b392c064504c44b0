"""The ``bm`` command line. Each command validates its inputs up front and reports problems in one line
naming the setting and the fix (exit code 2), never with a traceback."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer
from rich.console import Console

from bm.config import ConfigError, config_reference, load_config, parse_override

# No hub access at run time: models come from local paths or configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

app = typer.Typer(
    name="bm",
    help="Offline LLM batch generation and benchmarking on an in-flight batching Batch Manager.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print bm's version and exit.", is_eager=True),
) -> None:
    """Offline LLM batch generation and benchmarking on an in-flight batching Batch Manager."""
    if version:
        import bm

        typer.echo(bm.__version__)
        raise typer.Exit()


CONFIG_HELP = "YAML config with sections model, engine, kv_cache (see the keys below)."
DP_HELP = "Run N engine replicas as processes (torch.distributed, gloo); requests go to the least loaded."
TP_HELP = "Shard the model over N ranks per replica (transformers tp_plan='auto'; needs --model)."
RANK_TIMEOUT_HELP = "Seconds a rank may stay silent before the run ends with an error (dead or hung rank)."
SET_HELP = "Override one config key, e.g. --set engine.max_batch_size=64 (repeatable)."


def _fail(console: Console, message: str) -> typer.Exit:
    console.print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def build_config(config: Path | None, overrides: list[str], model: str | None, model_config: str | None):
    pairs = dict(parse_override(o) for o in overrides)
    if model:
        pairs["model.path"] = model
    if model_config:
        pairs["model.config"] = model_config
    return load_config(config, pairs)


@app.command(epilog="Config keys:\n\n" + config_reference().replace("\n", "\n\n"))
def run(
    prompts: Path = typer.Argument(
        ..., help="JSONL file: one request per line ({'prompt'|'input_ids', ...})."
    ),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    out_dir: Path | None = typer.Option(
        None,
        "--out-dir",
        "-o",
        help="Where outputs.jsonl, stats.jsonl and summary.json go [bm-out/run-TIME].",
    ),
    set_: list[str] = typer.Option([], "--set", "-s", help=SET_HELP),
    model: str | None = typer.Option(None, "--model", help="Local checkpoint directory (sets model.path)."),
    model_config: str | None = typer.Option(
        None, "--model-config", help="Model config JSON, random weights (sets model.config)."
    ),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Output length for lines that give none."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the model's end token."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    data_parallel: int | None = typer.Option(None, "--data-parallel", help=DP_HELP),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", help=TP_HELP),
    rank_timeout: float = typer.Option(300.0, "--rank-timeout", help=RANK_TIMEOUT_HELP),
) -> None:
    """Generate for every line of PROMPTS; one output record per line, written as requests finish."""
    from bm.cli.run import run_prompts, summary_table
    from bm.runtime import KVCacheSizeError, ModelLoadError, UnsupportedAttentionError

    console = Console(stderr=False)
    if not prompts.is_file():
        raise _fail(console, f"prompts file {str(prompts)!r} does not exist")
    try:
        cfg = build_config(config, set_, model, model_config)
    except ConfigError as exc:
        raise _fail(console, str(exc)) from None
    out = out_dir or Path("bm-out") / time.strftime("run-%Y%m%d-%H%M%S")
    from bm.distributed.cli import end_ranks, start_ranks

    multi_rank = start_ranks(console, cfg, tensor_parallel, data_parallel, rank_timeout)
    try:
        summary = run_prompts(
            prompts,
            cfg,
            out,
            default_output_len=max_tokens,
            ignore_eos=ignore_eos,
            console=console,
            show_progress=not quiet,
        )
    except (ModelLoadError, KVCacheSizeError, UnsupportedAttentionError, ConfigError) as exc:
        raise _fail(console, str(exc)) from None
    console.print(summary_table(summary))
    console.print(f"outputs: {out / 'outputs.jsonl'}  stats: {out / 'stats.jsonl'}", soft_wrap=True)
    if summary.num_failed:
        console.print(f"[yellow]{summary.num_failed} request(s) failed; see their error in outputs.jsonl[/]")
    end_ranks(console, multi_rank)
    if summary.interrupted:
        raise typer.Exit(code=130)


def _register_bench() -> None:
    """``bm bench`` lives in its own module; its heavy imports wait until it runs."""
    from bm.cli.bench import bench

    app.command("bench", epilog="Config keys:\n\n" + config_reference().replace("\n", "\n\n"))(bench)


_register_bench()


def _register_compare() -> None:
    """``bm compare`` and ``bm report`` share bench's flags; their heavy imports wait until they run."""
    from bm.cli.compare import compare, report

    app.command("compare")(compare)
    app.command("report")(report)


_register_compare()


sim_app = typer.Typer(help="The simulator's hardware rows (bm bench --executor sim).", no_args_is_help=True)
app.add_typer(sim_app, name="sim")


@sim_app.command("calibrate")
def sim_calibrate() -> None:
    """Measure this machine (GEMM throughput, memory bandwidth, per-op and per-step overheads) and cache
    it as the cpu-local hardware row (~/.cache/bm/cpu-local.yaml)."""
    import yaml

    from bm.sim.hardware import calibrate, cpu_local_path

    row = calibrate()
    typer.echo(yaml.safe_dump(row, sort_keys=False).rstrip())
    typer.echo(f"written: {cpu_local_path()}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
