"""What ``bm run`` / ``bm bench`` do before and after their single-process body on a multi-rank run.

Every rank parses the same command line; rank 0 goes on into the command (it alone reads inputs and
writes files, through the coordinator from :func:`bm.distributed.engine.engine_loop`), and every other
rank serves rounds here and exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import typer
from rich.console import Console
from rich.markup import escape

from bm.config import BmConfig
from bm.parallel.layout import (
    LAUNCHED_BY_BM,
    ParallelError,
    ParallelLayout,
    finish_parallel,
    run_fault,
    setup_parallel,
)

log = logging.getLogger("bm")


def start(
    config: BmConfig, tensor_parallel: int, data_parallel: int | None, rank_timeout_s: float
) -> ParallelLayout | None:
    """Join the run's ranks. Returns the layout on rank 0 (which goes on into the command); on every
    other rank it serves the run and then exits the process (1 when the run failed)."""
    layout = setup_parallel(tensor_parallel, data_parallel, rank_timeout_s, config.model.device)
    if layout.rank == 0:
        return layout
    if os.environ.get(LAUNCHED_BY_BM):
        # Ctrl-C in the terminal reaches every rank bm started; rank 0 alone handles it (it cancels the
        # run, and every request still gets its record), so the others must not die of it mid-exchange.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    from bm.distributed.engine import run_worker
    from bm.runtime import load_model

    code = 0
    try:
        run_worker(config, layout, load_model(config.model))
    except Exception as exc:  # rank 0 reports the run's outcome; this rank says why it stopped
        print(f"bm rank {layout.rank}: stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    finally:
        finish_parallel()
    # Nothing of this rank outlives the run; skipping the interpreter's slow teardown of torch saves
    # seconds per rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def finish() -> str | None:
    """Rank 0, after the command: leave the group; returns why the run ended early, if it did."""
    fault = run_fault()
    finish_parallel()
    return fault


def check_ranks(cfg: BmConfig, tensor_parallel: int) -> None:
    """What a multi-rank run needs of the config (a :class:`ParallelError` naming the fix); ``bm run
    --ray --tensor-parallel`` asks the same before any replica starts its ranks."""
    if getattr(cfg.engine, "executor", "torch") == "sim":
        raise ParallelError(
            "engine.executor is sim: the simulator replays on a virtual clock in one process; "
            "drop --data-parallel or set engine.executor=torch"
        )
    if tensor_parallel > 1 and not cfg.model.path:
        raise ParallelError(
            "--tensor-parallel needs model.path (a checkpoint directory): transformers shards "
            "weights while loading them from a checkpoint, and a model built from a config has none "
            "to shard; save one with save_pretrained() and pass --model DIR"
        )


def start_ranks(
    console: Console, cfg: BmConfig, tensor_parallel: int, data_parallel: int | None, rank_timeout: float
) -> bool:
    """The CLI's entry: on a multi-rank run join the ranks (ranks other than 0 serve and exit inside);
    returns whether the run is multi-rank. A bad setting exits with code 2 and one line."""
    if (data_parallel or 1) * tensor_parallel == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    try:
        check_ranks(cfg, tensor_parallel)
        start(cfg, tensor_parallel, data_parallel, rank_timeout)
    except ParallelError as exc:
        Console(stderr=True).print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    return True


def end_ranks(console: Console, multi_rank: bool) -> None:
    """Rank 0 after a multi-rank run: leave the group; a dead or hung rank makes the exit code 1."""
    if not multi_rank:
        return
    fault = finish()
    if fault:
        Console(stderr=True).print(f"[red]error:[/] {escape(fault)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)
