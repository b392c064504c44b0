"""``bm run``: generate for every line of a prompts file, writing one output record per line.

The command is a client of the batch manager like any other: it feeds requests through ``get_requests``
and consumes ``send_response`` and ``return_stats``. Records are written as requests finish, so an
interrupted run keeps everything already done, and Ctrl-C cancels the rest (each still gets its record).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

import bm
from bm.cli.interrupts import Interrupted, Interrupts
from bm.cli.progress import PlainProgress, eta_s, format_duration
from bm.config import BmConfig
from bm.engine.requests.request import error_response
from bm.files import replacing, write_whole
from bm.llm import LLM, Session
from bm.parallel import parallel_info
from bm.runfiles.identity import model_named, run_identity, run_options, write_run_identity
from bm.runfiles.outdir import iter_final_records
from bm.runfiles.prompts import codec_for, to_requests
from bm.runfiles.records import LineParts, cancelled_record, output_record, write_logits
from bm.runfiles.run_summary import RunSummary, count_record
from bm.runfiles.writers import JsonlWriter
from bm.runtime import LoadedModel
from bm.runtime.native import runtime_info
from bm.workloads.request import Row


def in_flight_limit(config: BmConfig) -> int:
    """How many requests a run keeps between its reader and its records: enough to keep every batch full
    (the engine's active requests, plus as many waiting), bounded so memory does not grow with the file."""
    engine = config.engine
    active = engine.max_num_active_requests or engine.max_batch_size
    return 2 * active + 64


@dataclass
class RunOptions:
    """How ``bm run`` answers a file: the flags that shape its requests, its records and its display."""

    default_max_tokens: int  # max_tokens of a line that gives none
    ignore_eos: bool = False
    show_progress: bool = True
    prompts: Path | None = None  # the input file (its digest makes the run's identity)
    prompts_name: str | None = None  # the input as the user named it (prompts may be bm's copy of a pipe)
    resume: bool = False
    chat_template: str | None = None
    tool_call_parser: str | None = None  # --tool-call-parser (None: detected from the chat template)
    batch_lines: dict[int, Any] | None = None  # OpenAI batch input: each line's BatchLine by index
    num_lines: int | None = None  # the file's lines, for the progress display's total
    run_seed: int | None = None


def run_prompts(
    parsed: Iterable[Row],
    config: BmConfig,
    out_dir: Path,
    options: RunOptions,
    console: Console,
    interrupts: Interrupts | None = None,
) -> RunSummary:
    """Run every parsed line; ``out_dir`` has been checked (see :func:`prepare_out_dir`).

    Lines stream: each is read, tokenized and handed to the engine only when fewer than
    :func:`in_flight_limit` requests are between the reader and their records, and a record is written
    (and forgotten) as its request finishes, so memory does not grow with the file. Every line still ends
    with exactly one record, interrupted or not. With ``options.resume`` the final records already in
    ``outputs.jsonl`` are kept and only the other lines run. ``options.batch_lines`` (OpenAI batch input)
    also gets ``batch_output.jsonl`` in OpenAI's format, a line written with each record."""
    if interrupts is None:
        with Interrupts(bound_s=None) as own:
            return run_prompts(parsed, config, out_dir, options, console, own)
    identity = None  # what the records depend on, the model files' digests taken before the load reads them
    if options.prompts is not None:
        identity = run_identity(
            options.prompts,
            config,
            run_options(
                options.default_max_tokens,
                options.ignore_eos,
                options.chat_template,
                options.tool_call_parser,
            ),
            options.run_seed,
            name=options.prompts_name,
        )
    console.print(f"[bold]bm {bm.__version__}[/]  loading model ({model_label(config)}) ...")
    try:
        llm: LLM | None = LLM(config=config)  # the library's front door loads the model, drives the engine
    except Interrupted as exc:  # nothing ran: every line gets its cancelled record, without the model
        console.print(f"[yellow]{exc.signal_name} while the model loaded: cancelling every request[/]")
        llm = None
    interrupts.running()  # from here a signal cancels; it no longer cuts the run short where it is
    from bm.bench.results import startup_document, startup_line

    if llm is not None:
        console.print(startup_line(llm.startup), highlight=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = RunSummary()
    done = _carry_over(out_dir, summary) if options.resume else set()
    loaded_name = llm.loaded.name if llm is not None else model_named(config)
    if identity is not None:
        write_run_identity(out_dir, identity, loaded_name)
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
    with JsonlWriter(out_dir / "outputs.jsonl", append=options.resume) as outputs, JsonlWriter(out_dir / "stats.jsonl", append=options.resume) as stats:  # fmt: skip
        run = _Run(summary, outputs, llm.loaded if llm is not None else None, out_dir)
        if options.batch_lines is not None:
            run.open_batch(
                options.batch_lines, done if options.resume else None, config.model.served_names[0]
            )
        started = time.perf_counter()
        if llm is None:
            _cancel_every_line(parsed, run, done)
        else:
            _generate(parsed, llm, run, done, options, console, interrupts, started, stats, run_id)
        summary.wall_time_s = time.perf_counter() - started
        run.close_batch()
    document = {
        "bm_version": bm.__version__,
        "run_id": run_id,
        "prompts": options.prompts_name or (str(options.prompts) if options.prompts is not None else None),
        "model": loaded_name,
        "config": (llm.config if llm is not None else config).to_dict(),  # resolved for the device: what ran
        "runtime": runtime_info(llm.loaded.device, llm.loaded.dtype, llm.loaded.quantization)
        if llm is not None
        else None,
        "parallel": parallel_info(),
        "startup": startup_document(llm.startup) if llm is not None else None,
        **asdict(summary),
        "output_tokens_per_s": summary.output_tokens_per_s,
        "total_tokens_per_s": summary.total_tokens_per_s,
    }
    write_whole(out_dir / "summary.json", json.dumps(document, indent=2) + "\n")
    return summary


def _generate(
    parsed: Iterable[Row],
    llm: LLM,
    run: _Run,
    done: set[int],
    options: RunOptions,
    console: Console,
    interrupts: Interrupts,
    started: float,
    stats: JsonlWriter,
    run_id: str,
) -> None:
    """The run proper: one engine session fed from the lines, a record written as each request ends."""
    summary = run.summary
    session = llm.session(return_stats=_marked(stats, run_id))

    def first_interrupt() -> None:
        session.cancel()
        summary.interrupted = True
        in_flight_lines = len({row.index for row in run.in_flight.values()})
        written = summary.num_requests - summary.num_resumed - in_flight_lines
        # and those the engine had finished that wait for their records (a loaded machine's main thread
        # lags the engine's by several iterations: 12 finished by length against 4 counted, in a soak)
        summary.records_before_interrupt = written + session.num_finals_waiting

    interrupts.running(first_interrupt)
    try:
        _feed(parsed, llm, session, run, done, options, console, interrupts, started)
    except OSError:  # a record could not be written (a full disk): stop the engine, then report it
        session.close()
        raise
    session.close()
    for row in list(run.in_flight.values()):  # only if the worker died: each row still gets a record
        run.finish(
            row, output_record(row, error_response(row.index, "the batch manager stopped"), llm.loaded)
        )
    run.in_flight.clear()


def _cancel_every_line(parsed: Iterable[Row], run: _Run, done: set[int]) -> None:
    """An interrupt during the model load: every line not already done ends ``cancelled`` (a resume
    runs them), read from the file as a run would, with no model."""
    run.summary.interrupted = True
    run.summary.records_before_interrupt = 0
    for entry in parsed:
        if entry.index in done:
            run.forget(entry.index)
            continue
        run.summary.num_requests += 1
        run.write(cancelled_record(entry))


def _feed(
    parsed: Iterable[Row],
    llm: LLM,
    session: Session,
    run: _Run,
    done: set[int],
    options: RunOptions,
    console: Console,
    interrupts: Interrupts,
    started: float,
) -> None:
    """Hand each line not already done to the engine as room frees up, and write every record."""
    loaded = llm.loaded
    default_end_id = None if options.ignore_eos else loaded.eos_token_id
    codec = codec_for(loaded, options.chat_template, options.tool_call_parser, llm.config.engine.max_seq_len)
    limit = in_flight_limit(llm.config)
    summary = run.summary
    # rich draws the bar on a terminal only; a CI log or a pipe gets a plain line every few seconds
    terminal = console.is_terminal
    with _progress(console, options.show_progress and terminal) as progress:
        run.total = None if options.num_lines is None else options.num_lines - len(done)
        run.task = progress.add_task("generating", total=run.total, tps="0", eta="?")
        run.progress, run.started = progress, started
        run.plain = PlainProgress(console, "bm run") if options.show_progress and not terminal else None
        for entry in parsed:
            if entry.index in done:
                run.forget(entry.index)
                continue
            summary.num_requests += 1
            if interrupts.signal_name is not None:
                run.cancel_unstarted(session, console, interrupts.signal_name)
                run.write(cancelled_record(entry))
                continue
            requests = to_requests(entry, codec, options.default_max_tokens, default_end_id, options.run_seed)
            if requests is None:
                run.write(output_record(entry, None, loaded))
                continue
            while len(run.in_flight) >= limit and not interrupts.interrupted:
                if not run.wait_one(session, console, interrupts):
                    break
            if interrupts.signal_name is not None:  # it came while this line waited for room: never sent
                run.cancel_unstarted(session, console, interrupts.signal_name)
                run.write(cancelled_record(entry))
                continue
            # A signal from here on finds the request queued: cancel_unstarted takes it back (each poll)
            for part, request in requests:  # one, or one per prompt of a completions prompt list
                run.in_flight[request.request_id] = part
                session.submit(request)
        while run.in_flight and run.wait_one(session, console, interrupts):
            pass
        if run.plain is not None:
            run.plain.finish()


class _Run:
    """The records side of a run: what is in flight (by index), writing a record, counting it."""

    def __init__(
        self, summary: RunSummary, outputs: JsonlWriter, loaded: LoadedModel | None, out_dir: Path
    ) -> None:
        self.summary = summary
        self.outputs = outputs
        self.loaded = loaded
        self.out_dir = out_dir
        self.in_flight: dict[int, Row] = {}  # by engine request id (a line's index, or a later prompt's)
        self.parts = LineParts()  # records of lines run as several requests, until the last comes
        self.progress: Progress | None = None
        self.task: Any = None
        self.started = 0.0
        self.total: int | None = None  # records this run will write, when the lines were counted
        self.num_written = 0
        self.plain: PlainProgress | None = None
        self.drained = False
        self.batch: Any = None  # BatchOutput, for an OpenAI batch file
        self.batch_lines: dict[int, Any] = {}

    def open_batch(self, batch_lines: dict[int, Any], keep: set[int] | None, model: str) -> None:
        """Write ``batch_output.jsonl`` beside the records (``keep``: the indexes a resume carries over;
        ``model``: the base model's first served name, echoed where a line's body names none)."""
        from bm.runfiles.openai_batch_output import BatchOutput, token_decoder

        tokenizer = getattr(self.loaded, "tokenizer", None)  # no model: a load cut short by a signal
        self.batch = BatchOutput(self.out_dir, model, token_decoder(tokenizer), keep)
        self.batch_lines = batch_lines

    def forget(self, index: int) -> None:
        """A line a resume keeps: its batch line was carried over, so nothing is written for it."""
        self.batch_lines.pop(index, None)

    def close_batch(self) -> None:
        if self.batch is not None:
            self.batch.close()

    def finish(self, row: Row, record: dict[str, Any]) -> None:
        """The record of an in-flight request (``row``): written, or held until the other prompts of its
        line have theirs (:class:`~bm.runfiles.records.LineParts`)."""
        whole = self.parts.add(row, record)
        if whole is not None:
            self.write(whole)

    def write(self, record: dict[str, Any]) -> None:
        self.outputs.write(record)
        if self.batch is not None:
            self.batch.write(self.batch_lines.pop(record["index"]), record)
        count_record(self.summary, record)
        self.num_written += 1
        self.show_progress(advance=1)

    def show_progress(self, advance: int = 0) -> None:
        """Records written, output tok/s and the time left (from records: output lengths are not
        known before the lines are read), on the bar or, off a terminal, as a plain line now and then."""
        if self.progress is None:
            return
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        tokens = self.summary.num_output_tokens
        eta = eta_s(self.num_written, self.total, elapsed)
        self.progress.update(
            self.task, advance=advance, tps=f"{tokens / elapsed:,.0f}", eta=format_duration(eta)
        )
        if self.plain is not None:
            self.plain.update(self.num_written, self.total, tokens, elapsed, eta)

    def wait_one(self, session: Session, console: Console, interrupts: Interrupts) -> bool:
        """Write the next finished request's record (or, after an interrupt, take back the requests the
        engine never started); False when none will come (the worker died)."""
        while True:
            if interrupts.signal_name is not None:
                self.cancel_unstarted(session, console, interrupts.signal_name)
                if not self.in_flight:  # every request was taken back: none is left to finish
                    return True
            result = session.next_final()
            if result is None:
                if not session.alive:
                    return False
                self.show_progress()  # the time goes on while no request finishes
                continue
            row = self.in_flight.pop(result.request_id)
            record = output_record(row, result, self.loaded)
            logits_file = write_logits(self.out_dir, row.index, result)
            if logits_file is not None:
                record["logits_file"] = logits_file
            self.finish(row, record)
            return True

    def cancel_unstarted(self, session: Session, console: Console, signal_name: str) -> None:
        """After an interrupt, at every poll: the requests not handed to the engine end as ``cancelled``.

        Not once only: a request the reader submits just after the signal (it had been built, or the
        signal landed between the reader's check and its submit) is queued where the stopped engine
        never takes it, and a run that took the queue once then waited for it for ever."""
        if not self.drained:
            self.drained = True
            console.print(
                f"[yellow]{signal_name}: cancelling the remaining requests (again to exit at once) ...[/]"
            )
        for request in session.take_pending():
            row = self.in_flight.pop(request.request_id)
            self.finish(row, cancelled_record(row))


def _carry_over(out_dir: Path, summary: RunSummary) -> set[int]:
    """``--resume``: keep the previous run's final records (rewritten in one step, so a kill here loses
    nothing) and return their indexes, which this run skips."""
    done: set[int] = set()
    outputs = out_dir / "outputs.jsonl"
    with replacing(outputs) as fresh, JsonlWriter(fresh) as rewrite:
        for record in iter_final_records(outputs):
            rewrite.write(record)
            done.add(record["index"])
            summary.num_resumed += 1
    return done


def _marked(stats: JsonlWriter, run_id: str) -> Callable[[str], None]:
    """Each stats row names its run: ``--resume`` appends to stats.jsonl, and the seed's
    "Iteration Counter" starts again at 1 in every run."""

    def write(row: str) -> None:
        with contextlib.suppress(OSError):  # on the engine's thread; the next record's write raises it
            stats.write(row[:-1] + f', "Run Id": "{run_id}"}}' if row.endswith("}") else row)

    return write


def model_label(config: BmConfig) -> str:
    """The model as the user named it, for the log and for a batch output line whose body names none."""
    return config.model.label


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=None),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
        TextColumn(
            "ETA {task.fields[eta]}  {task.fields[tps]} output tok/s", table_column=Column(no_wrap=True)
        ),
        console=console,
        disable=not enabled,
        transient=False,
    )
