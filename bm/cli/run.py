"""``bm run``: generate for every line of a prompts file, writing one output record per line.

The command is a client of the batch manager like any other: it feeds requests through ``get_requests``
and consumes ``send_response`` and ``return_stats``. Records are written as requests finish, so an
interrupted run keeps everything already done, and Ctrl-C cancels the rest (each still gets its record).
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import bm
from bm.cli.prompts import PromptLine, read_prompt_lines
from bm.cli.writers import JsonlWriter
from bm.config import BmConfig
from bm.distributed import parallel_info
from bm.distributed.engine import engine_loop
from bm.engine import OfflineClient, RequestResult
from bm.runtime import LoadedModel, load_model
from bm.runtime.native import runtime_info
from bm.scheduling import FinishReason


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
        error = line.error if result is None else result.error
        output_ids = [] if result is None else result.output_ids
        record.update(
            output_ids=output_ids, num_output_tokens=len(output_ids), finish_reason="error", error=error
        )
        return record
    if loaded.tokenizer is not None:
        record["text"] = loaded.tokenizer.decode(result.output_ids)
    record.update(
        output_ids=result.output_ids,
        num_output_tokens=len(result.output_ids),
        finish_reason=result.finish_reason.label,
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


def run_prompts(
    prompts: Path,
    config: BmConfig,
    out_dir: Path,
    *,
    default_output_len: int,
    ignore_eos: bool,
    console: Console,
    show_progress: bool = True,
) -> RunSummary:
    console.print(f"[bold]bm {bm.__version__}[/]  loading model ({_model_label(config)}) ...")
    loaded = load_model(config.model)
    encode = loaded.tokenizer.encode if loaded.tokenizer is not None else None
    default_end_id = None if ignore_eos else loaded.eos_token_id
    encode_word = loaded.tokenizer.encode_word if loaded.tokenizer is not None else None
    lines = read_prompt_lines(prompts, encode, default_output_len, default_end_id, encode_word)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = RunSummary(num_requests=len(lines))
    finished: queue.Queue[RequestResult] = queue.Queue()
    valid = [line for line in lines if line.request is not None]
    by_index = {line.index: line for line in valid}

    with JsonlWriter(out_dir / "outputs.jsonl") as outputs, JsonlWriter(out_dir / "stats.jsonl") as stats:
        for line in lines:
            if line.error is not None:
                outputs.write(output_record(line, None, loaded))
                summary.count("error", ok=False)
        client = OfflineClient([line.request for line in valid], on_final=finished.put)
        started = time.perf_counter()
        manager = engine_loop(
            config, client.get_requests, client.send_response, return_stats=stats.write, model=loaded
        )
        progress = _progress(console, show_progress)
        task = progress.add_task("generating", total=len(valid), tps="0")
        written: set[int] = set()
        with progress:
            while len(written) < len(valid):
                try:
                    result = finished.get(timeout=0.1)
                except queue.Empty:
                    if not manager.is_alive():
                        break
                    continue
                except KeyboardInterrupt:
                    summary.interrupted = True
                    console.print("[yellow]interrupted: cancelling the remaining requests ...[/]")
                    manager.cancel_all()
                    continue
                line = by_index[result.request_id]
                record = output_record(line, result, loaded)
                logits_file = write_logits(out_dir, line.index, result)
                if logits_file is not None:
                    record["logits_file"] = logits_file
                outputs.write(record)
                written.add(result.request_id)
                summary.num_prompt_tokens += line.num_prompt_tokens or 0
                summary.num_output_tokens += len(result.output_ids)
                summary.count("error" if result.error else result.finish_reason.label, ok=not result.error)
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

    (out_dir / "summary.json").write_text(
        json.dumps(
            {
                "bm_version": bm.__version__,
                "prompts": str(prompts),
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


def _model_label(config: BmConfig) -> str:
    return config.model.path or config.model.config or "embedded tiny-llama"


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
