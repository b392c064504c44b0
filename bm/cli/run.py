"""``bm run``: generate for every line of a prompts file, writing one output record per line.

The command is a client of the batch manager like any other: it feeds requests through ``get_requests``
and consumes ``send_response`` and ``return_stats``. Records are written as requests finish, so an
interrupted run keeps everything already done, and Ctrl-C cancels the rest (each still gets its record).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import bm
from bm.cli.interrupts import Interrupts
from bm.cli.outdir import read_final_records, run_identity, run_options, write_run_identity
from bm.cli.prompts import PromptLine, build_prompt_lines, codec_for
from bm.cli.writers import JsonlWriter
from bm.config import BmConfig
from bm.distributed import parallel_info
from bm.distributed.engine import engine_loop
from bm.engine import OfflineClient, Request, RequestResult
from bm.runtime import LoadedModel, load_model
from bm.runtime.native import runtime_info
from bm.scheduling import FinishReason
from bm.workloads.jsonl import ParsedLine


@dataclass
class RunSummary:
    num_requests: int = 0
    num_ok: int = 0
    num_failed: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    wall_time_s: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    records_before_interrupt: int | None = None  # requests finished when the first signal arrived
    num_resumed: int = 0  # final records kept from the previous run (--resume)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        tokens = self.num_prompt_tokens + self.num_output_tokens
        return tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def count(self, reason: str, ok: bool) -> None:
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        if ok:
            self.num_ok += 1
        else:
            self.num_failed += 1


def output_record(line: PromptLine, result: RequestResult | None, loaded: LoadedModel) -> dict[str, Any]:
    record: dict[str, Any] = {
        "index": line.index,
        "id": line.user_id,
        "num_prompt_tokens": line.num_prompt_tokens,
    }
    if result is None or result.error:
        # the engine does not know lines: the CLI names the line its request came from
        error = line.error if result is None else f"line {line.line_number}: {result.error}"
        output_ids = [] if result is None else result.output_ids
        record.update(
            output_ids=output_ids, num_output_tokens=len(output_ids), finish_reason="error", error=error
        )
        return record
    reason = result.finish_reason.label
    if loaded.tokenizer is not None:
        text = loaded.tokenizer.decode(result.output_ids)
        cut = min((i for i in (text.find(s) for s in line.stop) if i >= 0), default=-1)
        if cut >= 0:  # stop strings end the text before them, as in OpenAI's API
            text, reason = text[:cut], FinishReason.STOP_WORDS.label
        record["text"] = text
    record.update(
        output_ids=result.output_ids,
        num_output_tokens=len(result.output_ids),
        finish_reason=reason,
        error=None,
    )
    if result.beams is not None:
        record["beams"] = result.beams
    if result.output_log_probs is not None:
        record["output_log_probs"] = result.output_log_probs
    if result.beam_log_probs is not None:
        record["beam_log_probs"] = result.beam_log_probs
    if result.cum_log_probs is not None:
        record["cum_log_probs"] = (
            result.cum_log_probs if result.beams is not None else result.cum_log_probs[0]
        )
    return record


def write_logits(out_dir: Path, index: int, result: RequestResult) -> str | None:
    """Logits go to ``logits/<index>.safetensors`` beside outputs.jsonl (never inline); returns the path
    relative to the output directory, or None when the request asked for none."""
    tensors = {
        name: value.contiguous()
        for name, value in (
            ("context_logits", result.context_logits),
            ("generation_logits", result.generation_logits),
        )
        if value is not None
    }
    if not tensors:
        return None
    from safetensors.torch import save_file

    relative = Path("logits") / f"{index}.safetensors"
    (out_dir / "logits").mkdir(exist_ok=True)
    save_file(tensors, str(out_dir / relative))
    return relative.as_posix()


class _Feeder:
    """Hands the run's requests to the batch manager; once stopped it hands out nothing more, so an
    interrupt also ends the queued requests (they get a ``cancelled`` record from the CLI)."""

    def __init__(self, requests: list[Request]) -> None:
        self._pending = deque(requests)
        self._lock = threading.Lock()
        self.stopped = False

    def get_requests(self, max_new: int) -> list[Request]:
        if self.stopped:
            return []
        with self._lock:
            count = len(self._pending) if max_new < 0 else min(max_new, len(self._pending))
            return [self._pending.popleft() for _ in range(count)]

    def take_pending(self) -> list[Request]:
        self.stopped = True
        with self._lock:
            taken = list(self._pending)
            self._pending.clear()
        return taken


def run_prompts(
    parsed: list[ParsedLine],
    config: BmConfig,
    out_dir: Path,
    *,
    default_output_len: int,
    ignore_eos: bool,
    console: Console,
    show_progress: bool = True,
    prompts: Path | None = None,
    resume: bool = False,
    chat_template: str | None = None,
    batch_lines: list[Any] | None = None,
    interrupts: Interrupts | None = None,
) -> RunSummary:
    """Run every parsed line; ``out_dir`` has been checked (see :func:`prepare_out_dir`).

    With ``resume`` the final records already in ``outputs.jsonl`` are kept and only the other lines run;
    ``batch_lines`` (OpenAI batch input) also gets ``batch_output.jsonl`` in OpenAI's format."""
    if interrupts is None:
        with Interrupts() as own:
            return run_prompts(parsed, config, out_dir, default_output_len=default_output_len, ignore_eos=ignore_eos, console=console, show_progress=show_progress, prompts=prompts, resume=resume, chat_template=chat_template, batch_lines=batch_lines, interrupts=own)  # fmt: skip
    console.print(f"[bold]bm {bm.__version__}[/]  loading model ({_model_label(config)}) ...")
    loaded = load_model(config.model)
    default_end_id = None if ignore_eos else loaded.eos_token_id
    lines = build_prompt_lines(parsed, codec_for(loaded, chat_template), default_output_len, default_end_id)
    kept = read_final_records(out_dir / "outputs.jsonl", len(lines)) if resume else {}
    out_dir.mkdir(parents=True, exist_ok=True)
    if prompts is not None:
        options = run_options(default_output_len, ignore_eos, chat_template)
        write_run_identity(out_dir, run_identity(prompts, config, options), loaded.name)
    summary = RunSummary(num_requests=len(lines))
    finished: queue.Queue[RequestResult] = queue.Queue()
    to_run = [line for line in lines if line.index not in kept]
    valid = [line for line in to_run if line.request is not None]
    by_index = {line.index: line for line in valid}

    if resume:  # the kept records replace the old file in one step: a kill here loses nothing
        fresh = out_dir / "outputs.jsonl.tmp"
        with JsonlWriter(fresh) as rewrite:
            for record in kept.values():
                rewrite.write(record)
        os.replace(fresh, out_dir / "outputs.jsonl")
    for record in kept.values():
        summary.num_resumed += 1
        _count_record(summary, record)
    with JsonlWriter(out_dir / "outputs.jsonl", append=resume) as outputs, JsonlWriter(out_dir / "stats.jsonl", append=resume) as stats:  # fmt: skip
        for line in to_run:
            if line.error is not None:
                outputs.write(output_record(line, None, loaded))
                summary.count("error", ok=False)
        feeder = _Feeder([line.request for line in valid])  # type: ignore[misc]
        client = OfflineClient([], on_final=finished.put)
        started = time.perf_counter()
        manager = engine_loop(
            config, feeder.get_requests, client.send_response, return_stats=stats.write, model=loaded
        )
        written: set[int] = set()

        def first_interrupt() -> None:
            feeder.stopped = True
            manager.cancel_all()
            summary.interrupted = True
            summary.records_before_interrupt = len(written)

        interrupts.on_first.append(first_interrupt)
        if interrupts.signal_name is not None:  # the signal came while the model loaded
            first_interrupt()
        progress = _progress(console, show_progress)
        task = progress.add_task("generating", total=len(valid), tps="0")
        drained = False
        with progress:
            while len(written) < len(valid):
                if interrupts.signal_name is not None and not drained:
                    drained = True
                    console.print(
                        f"[yellow]{interrupts.signal_name}: cancelling the remaining requests "
                        "(again to exit at once) ...[/]"
                    )
                    for request in feeder.take_pending():
                        line = by_index[request.request_id]
                        outputs.write(cancelled_record(line))
                        written.add(line.index)
                        summary.count("cancelled", ok=True)
                        progress.update(task, advance=1)
                    continue
                try:
                    result = finished.get(timeout=0.1)
                except queue.Empty:
                    if not manager.is_alive():
                        break
                    continue
                line = by_index[result.request_id]
                record = output_record(line, result, loaded)
                logits_file = write_logits(out_dir, line.index, result)
                if logits_file is not None:
                    record["logits_file"] = logits_file
                outputs.write(record)
                written.add(result.request_id)
                _count_record(summary, record)
                elapsed = time.perf_counter() - started
                progress.update(task, advance=1, tps=f"{summary.num_output_tokens / max(elapsed, 1e-9):.0f}")
        summary.wall_time_s = time.perf_counter() - started
        manager.shutdown(cancel=True)
        for index, line in by_index.items():  # only if the worker died: every request still gets a record
            if index not in written:
                lost = RequestResult(
                    index, finish_reason=FinishReason.ERROR, error="the batch manager stopped"
                )
                outputs.write(output_record(line, lost, loaded))
                summary.count("error", ok=False)

    if batch_lines is not None:
        from bm.cli.openai_batch import write_batch_output

        tokenizer = loaded.tokenizer
        decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else None
        write_batch_output(out_dir, batch_lines, loaded.name, decode)
    (out_dir / "summary.json").write_text(
        json.dumps(
            {
                "bm_version": bm.__version__,
                "prompts": str(prompts) if prompts is not None else None,
                "model": loaded.name,
                "config": config.to_dict(),
                "runtime": runtime_info(loaded.device, loaded.dtype),
                "parallel": parallel_info(),
                **asdict(summary),
                "output_tokens_per_s": summary.output_tokens_per_s,
                "total_tokens_per_s": summary.total_tokens_per_s,
            },
            indent=2,
        )
        + "\n"
    )
    return summary


def _count_record(summary: RunSummary, record: dict[str, Any]) -> None:
    """Tokens count only for requests that ran: a refused 200 KB prompt adds nothing to tok/s."""
    reason = record["finish_reason"]
    never_started = reason == "cancelled" and not record.get("num_output_tokens")
    if reason != "error" and not never_started:
        summary.num_prompt_tokens += record.get("num_prompt_tokens") or 0
        summary.num_output_tokens += record.get("num_output_tokens") or 0
    summary.count(reason, ok=reason != "error")


def cancelled_record(line: PromptLine) -> dict[str, Any]:
    """The record of a queued request an interrupt ended before it started."""
    return {
        "index": line.index,
        "id": line.user_id,
        "num_prompt_tokens": line.num_prompt_tokens,
        "output_ids": [],
        "num_output_tokens": 0,
        "finish_reason": FinishReason.CANCELLED.label,
        "error": None,
        "text": "",
    }


def _model_label(config: BmConfig) -> str:
    return config.model.preset or config.model.path or config.model.config or "embedded tiny-llama"


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[tps]} output tok/s"),
        console=console,
        disable=not enabled,
        transient=False,
    )


def summary_table(summary: RunSummary) -> Table:
    table = Table(title="bm run", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests", str(summary.num_requests))
    table.add_row("succeeded", str(summary.num_ok))
    table.add_row("failed", str(summary.num_failed))
    for reason, count in sorted(summary.finish_reasons.items()):
        table.add_row(f"  finish_reason={reason}", str(count))
    table.add_row("prompt tokens", str(summary.num_prompt_tokens))
    table.add_row("output tokens", str(summary.num_output_tokens))
    table.add_row("wall time (s)", f"{summary.wall_time_s:.2f}")
    table.add_row("output tok/s", f"{summary.output_tokens_per_s:.1f}")
    table.add_row("total tok/s", f"{summary.total_tokens_per_s:.1f}")
    return table
