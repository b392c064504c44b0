"""The driver of ``bm run --ray``: independent engine replicas over the blocks of a prompts file.

Ray Data reads the file as blocks of fixed line ranges (:mod:`bm.ray.blocks`), and an actor pool of
replicas (:class:`bm.ray.replica.Replica`, each its own ``bm.LLM``) takes them as it frees up: no
lockstep, a slow replica only runs fewer blocks. The driver writes each finished block's records to its
part file as it arrives and assembles ``outputs.jsonl`` in input order at the end (each file written in
one step, :func:`bm.files.replacing`).

Faults are Ray's to retry: a replica whose process dies is restarted by Ray (``max_restarts=-1``), and
the blocks it held are retried on it, up to ``tries`` times in all (``max_task_retries``). A block that
fails every try is skipped by Ray Data (``max_errored_blocks``) instead of ending the run; the driver
then runs that block's lines once more as blocks of one line, so the line that fails every try (a
poison line) ends as one error record and every other line gets its own. That second pass runs once,
over the failed blocks only, and says so in the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from bm.config import BmConfig
from bm.engine.requests.request import error_response
from bm.ray.blocks import (  # fmt: skip
    BatchOutputLines,
    Block,
    PartStore,
    assemble,
    block_row,
    block_rows,
    file_verdicts,
    line_blocks,
    plan_blocks,
    read_bytes,
)
from bm.ray.placement import pool_strategy, replica_layout
from bm.ray.replica import FAULT_ENV, LineOptions, Replica
from bm.ray.session import connect, disconnect
from bm.runfiles.openai_batch import IgnoredFieldNotices, is_batch_file
from bm.runfiles.openai_batch_output import token_decoder
from bm.runfiles.records import cancelled_record, output_record
from bm.runfiles.served_models import ANY_MODEL, ServedModels
from bm.runfiles.writers import JsonlWriter

DEFAULT_BLOCK_LINES = 64
DEFAULT_TRIES = 3
DEFAULT_RANK_TIMEOUT_S = 300.0  # bm run's --rank-timeout


@dataclass(frozen=True)
class RayOptions:
    """How the replicas are laid out and how hard a block is tried (``bm run --ray``'s flags)."""

    replicas: int | None = None  # None: from the cluster's resources (GPUs, else CPUs / threads)
    replica_threads: int | None = None  # torch threads of a CPU replica
    block_lines: int = DEFAULT_BLOCK_LINES
    tries: int = DEFAULT_TRIES  # runs of a block before it is narrowed down to its lines
    address: str | None = (
        None  # a running cluster (None: RAY_ADDRESS, one started here by `ray start`, or a new local one)
    )
    tensor_parallel: int = 1  # ranks per replica, all on the replica's node (bm.distributed.worker)
    rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S  # bounds each exchange between a replica's ranks


@dataclass
class RayReport:
    """What ``summary.json``'s ``parallel.ray`` says of a run."""

    replicas: int = 0
    tensor_parallel: int = 1  # ranks (processes) per replica
    replica_threads: int | None = None
    num_cpus_per_replica: float = 0.0
    num_gpus_per_replica: float = 0.0
    block_lines: int = 0
    num_blocks: int = 0
    num_blocks_kept: int = 0  # whole blocks a resume kept
    num_blocks_run: int = 0
    num_blocks_failed: int = 0  # failed every try, then run line by line
    num_replica_restarts: int = 0  # replicas that Ray restarted after their process died
    lines_failed: list[int] = field(default_factory=list)  # indexes that failed every try alone too
    blocks_by_replica: dict[str, int] = field(default_factory=dict)


def run_blocks(
    prompts: Path,
    config: BmConfig,
    out_dir: Path,
    line: LineOptions,
    options: RayOptions,
    console: Console,
    *,
    resume: bool = False,
    stop: Callable[[], bool] = lambda: False,
    on_loaded: Callable[[str], None] | None = None,
    count: Callable[[dict[str, Any], bool], None] = lambda record, kept: None,
) -> tuple[RayReport, bool]:
    """Run every block of ``prompts`` without a part in ``out_dir/parts`` and assemble ``outputs.jsonl``
    (and, for an OpenAI batch file, ``batch_output.jsonl``).

    ``stop()`` is asked after each block (an interrupt: the blocks not done get ``cancelled`` records in
    ``outputs.jsonl`` and no part, so a resume runs them); ``count(record, kept)`` sees every record of
    ``outputs.jsonl`` (``kept``: carried over from an earlier run); ``on_loaded`` gets the model's name as
    a replica loaded it. Returns the report and whether the run was stopped."""
    import ray

    started_here = connect(options.address)
    store = PartStore(out_dir)
    block_lines = options.block_lines
    if resume and store.exists():
        block_lines = store.block_lines() or block_lines
        if block_lines != options.block_lines:
            console.print(
                f"--resume: the parts here were cut into blocks of {block_lines} lines; keeping that"
            )
    else:
        store.start(block_lines)
    blocks = plan_blocks(prompts, block_lines)
    batch = is_batch_file(prompts)
    # the whole file's pass, before any replica starts: a batch file's unknown body fields are said here
    notices = IgnoredFieldNotices() if batch else None
    verdicts = file_verdicts(prompts, batch, notices, ServedModels.of(config.model) if batch else ANY_MODEL)
    report = RayReport(block_lines=block_lines, num_blocks=len(blocks))
    kept: dict[int, dict[int, dict[str, Any]]] = {}  # block -> its final records, where some lines rerun
    kept_indexes: set[int] = set()
    pending: list[Block] = []
    for block in blocks:
        final = store.kept(block.block_id) if resume else None
        if final is not None:
            kept_indexes.update(final)
            if len(final) == len(store.read(block.block_id)):
                report.num_blocks_kept += 1
                continue
            kept[block.block_id] = final
        pending.append(block)
    layout = replica_layout(
        ray.cluster_resources(),
        options.replicas,
        options.replica_threads,
        config.model.device,
        options.tensor_parallel,
    )
    report.replicas, report.num_cpus_per_replica, report.num_gpus_per_replica, report.replica_threads = layout
    report.tensor_parallel = options.tensor_parallel
    report.num_blocks_run = len(pending)
    console.print(
        f"bm run --ray: {len(blocks)} block(s) of {block_lines} lines, {len(pending)} to run "
        f"({report.num_blocks_kept} kept), on {report.replicas} replica(s)"
        + (f" of {report.tensor_parallel} tensor-parallel ranks each" if report.tensor_parallel > 1 else ""),
        highlight=False,
    )
    stopped = False
    try:
        runner = _Runner(prompts, batch, config, out_dir, line, options, report, store, console, on_loaded)
        stopped = runner.run(pending, verdicts, kept, stop)
        failed = [b for b in pending if not store.has(b.block_id)]
        if failed and not stopped:
            stopped = runner.isolate(failed, verdicts, kept, stop)
    finally:
        if started_here:
            disconnect()  # once Ray Data's threads have ended (bm.ray.session)

    def missing(block: Block) -> list[dict[str, Any]]:
        rows = block_rows(read_bytes(prompts, block), block, prompts.parent, verdicts, batch)
        final = kept.get(block.block_id, {})
        return [final.get(row.index) or cancelled_record(row) for row in rows]

    output = _batch_output(prompts, config) if batch else None
    assemble(
        store, blocks, out_dir, missing, lambda r: count(r, r["index"] in kept_indexes), batch_output=output
    )
    return report, stopped


def _batch_output(prompts: Path, config: BmConfig) -> Callable[[Path], BatchOutputLines]:
    """The writer of ``batch_output.jsonl`` (opened by assembly on its temporary file), naming the
    model and its tokens as a one-process run does (``Session.open_batch``): the model as the user
    named it, token strings by the model's tokenizer, loaded here alone (the driver holds no model)."""
    from bm.runtime.model_loader import load_tokenizer

    decode = token_decoder(load_tokenizer(config.model))
    served = ServedModels.of(config.model)
    return lambda path: BatchOutputLines(prompts, path, served.names[0], decode, served)


class _Runner:
    """One Ray Data pass over some blocks: the dataset, the replicas, and what comes back."""

    def __init__(
        self,
        prompts: Path,
        batch: bool,
        config: BmConfig,
        out_dir: Path,
        line: LineOptions,
        options: RayOptions,
        report: RayReport,
        store: PartStore,
        console: Console,
        on_loaded: Callable[[str], None] | None,
    ) -> None:
        self.prompts, self.config, self.out_dir, self.line = prompts, config, out_dir, line
        self.batch = batch  # an OpenAI batch file (bm.runfiles.openai_batch reads its lines)
        self.options, self.report, self.store, self.console = options, report, store, console
        self.on_loaded = on_loaded
        self.run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"

    def run(
        self,
        blocks: list[Block],
        verdicts: dict[int, str],
        kept: dict[int, dict[int, dict[str, Any]]],
        stop: Callable[[], bool],
        *,
        write: Callable[[int, list[dict[str, Any]]], None] | None = None,
    ) -> bool:
        """Run ``blocks`` on the replicas; each block's records go to its part (merged with the records
        ``kept`` of it), or to ``write`` when lines are tried alone. Returns whether ``stop()`` ended the
        pass early."""
        if not blocks:
            return False
        if stop():  # a signal during the cluster's start: no replica is started for nothing
            return True
        import ray.data

        context = ray.data.DataContext.get_current()
        before, context.max_errored_blocks = context.max_errored_blocks, -1  # failed blocks: isolated below
        try:
            dataset = self._dataset(blocks, verdicts, kept, alone=write is not None)
            return self._consume(dataset, len(blocks), kept, stop, write or self.store.write)
        finally:
            context.max_errored_blocks = before

    def _consume(
        self,
        dataset: Any,
        total: int,
        kept: dict[int, dict[int, dict[str, Any]]],
        stop: Callable[[], bool],
        write: Callable[[int, list[dict[str, Any]]], None],
    ) -> bool:
        """Write each block's records as its row comes back (in the order the replicas finish them)."""
        done = 0
        started = time.perf_counter()
        rows = iter(dataset.iter_rows())
        with JsonlWriter(self.out_dir / "stats.jsonl", append=True) as stats, contextlib.closing(rows):
            # closed on the way out, stop() included: an abandoned iterator left Ray Data's executor
            # thread running into the interpreter's exit, which then ended the process with status 1
            for row in rows:
                block_id = int(row["block"])
                records = [json.loads(text) for text in str(row["part"]).splitlines() if text]
                write(block_id, [*kept.get(block_id, {}).values(), *records])
                replica = str(row["replica"])
                self.report.blocks_by_replica[replica] = self.report.blocks_by_replica.get(replica, 0) + 1
                if self.on_loaded is not None and row["loaded"]:
                    self.on_loaded(str(row["loaded"]))
                if row["restarted"]:
                    self.report.num_replica_restarts += 1
                    self.console.print(
                        f"bm run --ray: replica {replica} was restarted after its process died; Ray retried "
                        f"its unfinished block(s) (block {block_id} finished on the new process)",
                        highlight=False,
                    )
                for text in str(row["stats"]).splitlines():
                    stats.write(_tagged(text, self.run_id, replica))
                done += 1
                if done == total or done % max(1, total // 10) == 0:
                    elapsed = time.perf_counter() - started
                    self.console.print(
                        f"bm run --ray: {done}/{total} blocks ({elapsed:.1f} s)", highlight=False
                    )
                if stop():
                    return True
        return False

    def isolate(
        self,
        failed: list[Block],
        verdicts: dict[int, str],
        kept: dict[int, dict[int, dict[str, Any]]],
        stop: Callable[[], bool],
    ) -> bool:
        """The blocks that failed every try, run again as blocks of one line each: every line that runs
        gets its record, and a line that fails every try alone gets one error record. Runs once."""
        self.report.num_blocks_failed = len(failed)
        singles = [
            s
            for b in failed
            for s in line_blocks(self.prompts, b)
            if s.block_id not in kept.get(b.block_id, {})
        ]
        self.console.print(
            f"bm run --ray: {len(failed)} block(s) failed on {_tries(self.options.tries, 'their')}; "
            f"running their {len(singles)} line(s) one at a time to find the line(s) that fail",
            highlight=False,
        )
        found: dict[int, dict[str, Any]] = {}
        stopped = self.run(
            singles,
            verdicts,
            {},
            stop,
            write=lambda i, records: found.update({r["index"]: r for r in records}),
        )
        if stopped:
            return True
        for block in failed:
            records = dict(kept.get(block.block_id, {}))
            data = read_bytes(self.prompts, block)
            for row in block_rows(data, block, self.prompts.parent, verdicts, self.batch):
                if row.index in records:
                    continue
                record = found.get(row.index)
                if record is None:
                    self.report.lines_failed.append(row.index)
                    message = (
                        f"the replica failed on this line on {_tries(self.options.tries, 'its')} (its "
                        "process died, or the engine raised; the Ray log above says which), so it was left "
                        "out of the run"
                    )
                    record = output_record(row, error_response(row.index, message), None)  # type: ignore[arg-type]
                    self.console.print(
                        f"bm run --ray: {row.where} failed on every try; it gets an error record",
                        highlight=False,
                    )
                records[row.index] = record
            self.store.write(block.block_id, list(records.values()))
        return False

    def _dataset(
        self,
        blocks: list[Block],
        verdicts: dict[int, str],
        kept: dict[int, dict[int, dict[str, Any]]],
        alone: bool,
    ) -> Any:
        import ray.data

        report = self.report
        # The blocks as Ray Data rows (one Ray block each): small descriptors, read by the replica that
        # takes them, so no read stage holds CPUs or starts processes of its own.
        rows = [block_row(b, verdicts, kept.get(b.block_id, {})) for b in blocks]
        dataset = ray.data.from_items(rows, override_num_blocks=len(rows))
        strategy = pool_strategy(report.replicas, alone)
        with warnings.catch_warnings():
            # max_restarts and max_task_retries reach the actors through map_batches' **ray_remote_args,
            # which Ray 2.60 deprecates (RayDeprecationWarning: "removed in Ray 2.64"). Ray 2.60 has no
            # other way to set them for an actor pool: map_batches' named remote parameters are
            # label_selector, fallback_strategy, max_calls, resources, accelerator_type and runtime_env;
            # ray_remote_args_fn is deprecated too; and DataContext bounds only application errors
            # (actor_task_retry_on_errors, max_map_retries) and deaths in the constructor
            # (max_consecutive_actor_init_deaths). Without the keys Ray Data's actor pool defaults to
            # max_restarts=-1 and max_task_retries=-1, which retry a poison line's block forever. So on
            # a Ray that removes the keywords, map_batches raises TypeError here, before any replica
            # starts, and every --ray run fails at once; tests/test_ray.py's poison-line and killed-
            # replica tests are the ones to rerun on the fix (docs/parallel.md, "Ray versions").
            warnings.simplefilter("ignore", DeprecationWarning)
            return dataset.map_batches(
                Replica,
                fn_constructor_kwargs={
                    "config": self.config,
                    "options": self.line,
                    "prompts": str(self.prompts),
                    "threads": report.replica_threads,
                    "fault": os.environ.get(FAULT_ENV),
                    "logits_dir": str(self.out_dir),
                    "batch": self.batch,
                    "tensor_parallel": self.options.tensor_parallel,
                    "rank_timeout_s": self.options.rank_timeout_s,
                },
                batch_size=None,
                batch_format="numpy",
                compute=strategy,
                num_cpus=report.num_cpus_per_replica,
                num_gpus=report.num_gpus_per_replica,
                max_restarts=-1,
                max_task_retries=max(self.options.tries - 1, 0),
            )


def _tries(count: int, whose: str) -> str:
    return f"{whose} one try" if count == 1 else f"each of {whose} {count} tries"


def _tagged(row: str, run_id: str, replica: str) -> str:
    """A stats line with its run and replica (each replica's "Iteration Counter" is its own)."""
    return row[:-1] + f', "Run Id": "{run_id}", "Replica": "{replica}"}}' if row.endswith("}") else row
