"""What ``bm run`` tells the user at its end: the run's tally (:class:`RunSummary`, also kept by ``bm run
--ray``'s driver), its table, and the command that resumes an interrupted run. Apart from the run loop
(:mod:`bm.cli.run`) because none of it needs the engine or torch: the Ray driver counts records with it
without loading a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from bm.scheduling import FinishReason


@dataclass
class RunSummary:
    """A run's counts as its records are written: what the end-of-run table, the exit code and the
    resume hint are computed from (records themselves stream to disk and are not kept)."""

    num_requests: int = 0
    num_ok: int = 0
    num_failed: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    wall_time_s: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    num_cancelled: int = 0  # ended by an interrupt: neither succeeded nor failed
    interrupted: bool = False
    records_before_interrupt: int | None = None  # requests finished when the first signal arrived
    # Final records kept from the previous run (--resume): not counted in this run's requests or tok/s.
    num_resumed: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        tokens = self.num_prompt_tokens + self.num_output_tokens
        return tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def count(self, reason: str) -> None:
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        if reason == "error":
            self.num_failed += 1
        elif reason == FinishReason.CANCELLED.label:
            self.num_cancelled += 1
        else:
            self.num_ok += 1


def count_record(summary: RunSummary, record: dict[str, Any]) -> None:
    """Tokens count only for requests that ran: a refused 200 KB prompt adds nothing to tok/s."""
    reason = record["finish_reason"]
    never_started = reason == "cancelled" and not record.get("num_output_tokens")
    if reason != "error" and not never_started:
        summary.num_prompt_tokens += record.get("num_prompt_tokens") or 0
        summary.num_output_tokens += record.get("num_output_tokens") or 0
    summary.count(reason)


# Parameters of ``bm run`` that the printed resume command sets itself, or must not repeat.
NOT_REPEATED = ("prompts", "out_dir", "resume", "overwrite")


def resume_command(prompts_name: str, out: Path, command: Callable[..., Any], values: dict[str, Any]) -> str:
    """The command that finishes an interrupted run: ``bm run`` with every option the user set (so the
    resume check, which compares the model, the config and the run options, accepts it), ``-o`` and
    ``--resume``. ``values`` are the command's parameters as parsed; each is matched to its option in
    ``command``'s declarations, not to a list kept here, so an option added to ``bm run`` later is
    repeated too. A value equal to its default is left out (it is the default again on resume).

    The printed command used to drop ``--ignore-eos`` and ``-s``; running it was then refused."""
    import inspect
    import shlex

    words = ["bm", "run", shlex.quote(prompts_name)]
    for name, parameter in inspect.signature(command).parameters.items():
        declared = parameter.default
        decls = getattr(declared, "param_decls", None)
        if name in NOT_REPEATED or name not in values or not decls:
            continue
        value, default = values[name], getattr(declared, "default", None)
        if value == default or value is None or value == []:
            continue
        words += _option_words(decls, value)
    words += ["-o", shlex.quote(str(out)), "--resume"]
    text = " ".join(words)
    if prompts_name in ("-", "/dev/stdin") or prompts_name.startswith("/dev/fd/"):
        text += "   (pipe the same input into it again)"
    return text


def _option_words(decls: tuple[str, ...], value: Any) -> list[str]:
    """An option with ``value`` as it is typed on a command line (quoted for a shell)."""
    import shlex
    from enum import Enum

    names = [n for decl in decls for n in decl.split("/") if n.startswith("-")]
    long = next((n for n in names if n.startswith("--")), names[0])
    if isinstance(value, bool):  # a flag; --x/--no-x declares both
        off = [n for decl in decls if "/" in decl for n in decl.split("/")[1:]]
        return [long] if value else off[:1]
    words: list[str] = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        text = item.value if isinstance(item, Enum) else item
        words += [long, shlex.quote(str(text))]
    return words


def summary_table(summary: RunSummary) -> Table:
    """The table ``bm run`` prints at its end (kept records of a ``--resume`` on their own row)."""
    table = Table(title="bm run", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    if summary.num_resumed:
        table.add_row("kept from the previous run", str(summary.num_resumed))
    table.add_row("requests", str(summary.num_requests))
    table.add_row("succeeded", str(summary.num_ok))
    table.add_row("failed", str(summary.num_failed))
    table.add_row("cancelled", str(summary.num_cancelled))
    for reason, count in sorted(summary.finish_reasons.items()):
        table.add_row(f"  finish_reason={reason}", str(count))
    table.add_row("prompt tokens", str(summary.num_prompt_tokens))
    table.add_row("output tokens", str(summary.num_output_tokens))
    table.add_row("wall time (s)", f"{summary.wall_time_s:.2f}")
    table.add_row("output tok/s", f"{summary.output_tokens_per_s:.1f}")
    table.add_row("total tok/s", f"{summary.total_tokens_per_s:.1f}")
    return table
