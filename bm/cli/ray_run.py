"""What ``bm run --ray`` does between the command line's checks and its summary table: the flags as
:class:`~bm.ray.driver.RayOptions` and the run on the replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from bm.cli.run import RunOptions
from bm.config import BmConfig
from bm.ray.api import run_ray
from bm.ray.driver import RayOptions
from bm.ray.replica import LineOptions
from bm.runfiles.identity import run_identity, run_options
from bm.runfiles.run_summary import RunSummary


def run_with_ray(
    options: RunOptions,
    config: BmConfig,
    out: Path,
    console: Console,
    interrupts: Any,
    replicas: int | None,
    replica_threads: int | None,
    block_lines: int,
    tries: int,
    tensor_parallel: int = 1,
    rank_timeout_s: float = 300.0,
) -> RunSummary:
    """``bm run``'s options (checked, the out directory prepared and a resume's identity checked) run on
    the replicas; the summary the command prints."""
    assert options.prompts is not None
    identity = run_identity(
        options.prompts,
        config,
        run_options(
            options.default_max_tokens, options.ignore_eos, options.chat_template, options.tool_call_parser
        ),
        options.run_seed,
        name=options.prompts_name,
    )
    line = LineOptions(
        options.default_max_tokens,
        options.ignore_eos,
        options.run_seed,
        options.chat_template,
        options.tool_call_parser,
    )
    ray_options = RayOptions(
        replicas, replica_threads, block_lines, tries, None, tensor_parallel, rank_timeout_s
    )
    name = options.prompts_name or str(options.prompts)
    return run_ray(
        options.prompts, name, config, out, line, ray_options, identity, options.resume, console, interrupts
    )
