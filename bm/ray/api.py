"""``bm run --ray`` as a whole: the run directory (identity, resume, summary) around the driver, and the
library's door to it, :func:`run_batch`.

The run directory is a plain ``bm run``'s: ``run.json`` records what produced it (so ``--resume`` refuses
another model, config, run options or seed), ``outputs.jsonl`` holds one record per input line in input
order (and, for an OpenAI batch file, ``batch_output.jsonl`` one output line per input line),
``stats.jsonl`` the replicas' iteration stats, ``summary.json`` the counts and the replicas' layout.
Besides, ``parts/`` holds each finished block's records: what a resume after a killed driver keeps.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

import bm
from bm.config import BmConfig
from bm.files import write_whole
from bm.ray.driver import DEFAULT_BLOCK_LINES, DEFAULT_RANK_TIMEOUT_S, DEFAULT_TRIES, RayOptions, run_blocks
from bm.ray.replica import LineOptions
from bm.runfiles.diskspace import run_output_bytes
from bm.runfiles.identity import (
    check_resume_mode,
    check_run_identity,
    model_named,
    run_identity,
    run_options,
    run_seed_for,
    saved_identity,
    write_run_identity,
)
from bm.runfiles.outdir import prepare_out_dir
from bm.runfiles.outlock import release
from bm.runfiles.run_summary import RunSummary, count_record
from bm.runfiles.source import PromptsSource, open_prompts


def run_batch(
    prompts: str | Path,
    out_dir: str | Path,
    *,
    model: str | None = None,
    config: str | Path | BmConfig | None = None,
    max_tokens: int = 64,
    ignore_eos: bool = False,
    chat_template: str | Path | None = None,
    seed: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    replicas: int | None = None,
    replica_threads: int | None = None,
    block_lines: int = DEFAULT_BLOCK_LINES,
    tries: int = DEFAULT_TRIES,
    tensor_parallel_size: int = 1,
    rank_timeout: float = DEFAULT_RANK_TIMEOUT_S,
    address: str | None = None,
    console: Console | None = None,
    **engine_options: Any,
) -> RunSummary:
    """``bm run PROMPTS --ray -o OUT_DIR`` from Python: every line of ``prompts`` (bm's JSONL, or an
    OpenAI batch file) answered by engine replicas on the Ray cluster (``address``, ``RAY_ADDRESS``, one
    started here with ``ray start``, or a local one started for the call), one record per line in
    ``OUT_DIR/outputs.jsonl`` (and a batch file's output lines in ``OUT_DIR/batch_output.jsonl``).

    ``model``/``config``/``engine_options`` as for :class:`bm.LLM`; ``max_tokens``, ``ignore_eos``,
    ``chat_template`` (a Jinja file, as ``--chat-template``: it renders ``messages`` lines instead of
    the model's template, and is checked by the same code), ``seed``, ``resume`` and ``overwrite`` as
    ``bm run``'s flags; ``replicas`` (default: the cluster's
    GPUs, else its CPUs over ``replica_threads``), ``block_lines`` (lines per block: the unit of work, of
    retry and of resume) and ``tries`` (runs of a block before its lines are tried one by one) as
    ``bm run --ray``'s; ``tensor_parallel_size`` (each replica's model split over that many ranks, as
    ``--tensor-parallel``: a checkpoint directory as ``model``) and ``rank_timeout`` (seconds, as
    ``--rank-timeout``). Raises ``ValueError`` (an :class:`~bm.runfiles.outdir.OutDirError`, a
    :class:`~bm.runfiles.source.PromptsFileError`, a :class:`~bm.chat_template.ChatTemplateError` or an
    :class:`~bm.llm_params.InvalidParameterError`) for what cannot run, before any replica starts."""
    from bm.llm_config import build_config
    from bm.runfiles.chat import read_chat_template

    cfg = build_config(model, config, engine_options)
    out = Path(out_dir)
    source = open_prompts(prompts, has_tokenizer=not cfg.model.has_no_tokenizer)
    check_ray_run(
        cfg, None, tensor_parallel_size, rank_timeout, source, replicas, replica_threads, block_lines, tries
    )
    template = None if chat_template is None else read_chat_template(Path(chat_template), "chat_template")
    needed = run_output_bytes(source.path, max_tokens, out, resume)
    prepare_out_dir(
        out, resume=resume, overwrite=overwrite, prompts=source.path, prompts_name=source.name, needed=needed
    )
    run_seed = run_seed_for(out, seed, resume)
    line = LineOptions(max_tokens, ignore_eos, run_seed, template)
    known = saved_identity(out) if resume else None  # its file digests hold while the files are unchanged
    flags = run_options(max_tokens, ignore_eos, template)
    identity = run_identity(source.path, cfg, flags, run_seed, name=source.name, known=known)
    if resume:
        check_resume_mode(out, ray=True)
        check_run_identity(out, identity)
    options = RayOptions(
        replicas, replica_threads, block_lines, tries, address, tensor_parallel_size, rank_timeout
    )
    console = console or Console()
    try:
        return run_ray(source.path, source.name, cfg, out, line, options, identity, resume, console)
    finally:  # a library caller's process lives on: the directory is free again once the run returns
        release(out)


def run_ray(
    prompts: Path,
    prompts_name: str,
    config: BmConfig,
    out_dir: Path,
    line: LineOptions,
    options: RayOptions,
    identity: dict[str, Any],
    resume: bool,
    console: Console,
    interrupts: Any = None,
) -> RunSummary:
    """Run a checked prompts file on the replicas (``out_dir`` prepared, ``identity`` checked on a
    resume) and write ``run.json``, ``outputs.jsonl`` and ``summary.json``; what ``bm run --ray`` and
    :func:`run_batch` share. ``interrupts`` (bm.cli.interrupts): a first Ctrl-C stops after the block
    that is finishing; the blocks not done get ``cancelled`` records and run on ``--resume``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Written before any part: a driver killed after this leaves a directory that --resume can check.
    write_run_identity(out_dir, identity, model_named(config))
    summary = RunSummary()
    loaded: list[str] = []

    def on_loaded(name: str) -> None:
        if not loaded:
            loaded.append(name)
            write_run_identity(out_dir, identity, name)

    def count(record: dict[str, Any], kept: bool) -> None:
        if kept:
            summary.num_resumed += 1
        else:
            summary.num_requests += 1
            count_record(summary, record)

    def stop() -> bool:
        if interrupts is not None and interrupts.signal_name is not None:
            summary.interrupted = True
        return summary.interrupted

    if interrupts is not None:  # start-up is over: a signal now stops after the blocks in progress
        interrupts.running()

    started = time.perf_counter()
    report, _stopped = run_blocks(
        prompts,
        config,
        out_dir,
        line,
        options,
        console,
        resume=resume,
        stop=stop,
        on_loaded=on_loaded,
        count=count,
    )
    summary.wall_time_s = time.perf_counter() - started
    document = {
        "bm_version": bm.__version__,
        "prompts": prompts_name,
        "model": loaded[0] if loaded else model_named(config),
        "config": config.to_dict(),
        "parallel": {"ray": asdict(report)},
        **asdict(summary),
        "output_tokens_per_s": summary.output_tokens_per_s,
        "total_tokens_per_s": summary.total_tokens_per_s,
    }
    write_whole(out_dir / "summary.json", json.dumps(document, indent=2) + "\n")
    return summary


def check_ray_run(
    config: BmConfig,
    data_parallel: int | None,
    tensor_parallel: int,
    rank_timeout_s: float,
    source: PromptsSource,
    *counts: int | None,
) -> None:
    """Refuse, before anything starts, what ``--ray`` does not run (a ``ValueError`` phrased for the user);
    ``counts``: --replicas, --replica-threads, --block-lines and --ray-tries as given. A tensor-parallel
    replica's ranks start inside its actor, so their settings are checked here, as ``bm run`` checks
    its own ranks' (the same checks)."""
    from bm.distributed.cli import check_ranks
    from bm.parallel.layout import validate

    for flag, value in zip(
        ("--replicas", "--replica-threads", "--block-lines", "--ray-tries"), counts, strict=False
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: give a whole number of at least 1")

    if (data_parallel or 1) > 1:
        raise ValueError(
            f"--ray with --data-parallel {data_parallel}: --ray already runs independent replicas; give "
            f"--replicas {data_parallel} instead of --data-parallel (docs/parallel.md says when to use which)"
        )
    validate(tensor_parallel, None, rank_timeout_s)
    if tensor_parallel > 1:
        check_ranks(config, tensor_parallel)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError(
            "--ray needs Ray: pip install 'bm[ray]' (or pip install 'ray[data]>=2.40')"
        ) from None
