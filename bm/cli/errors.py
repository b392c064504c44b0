"""The one way every ``bm`` command reports an error: ``error: ...`` on standard error.

Errors used to go to stdout (only ``bm bench --json`` sent them to stderr), so ``bm run ... 2>err.log``
caught nothing and a script that parsed stdout read the error as output. Messages are printed as text,
never as rich markup: a message quoting ``[len*(1-r), len*(1+r)]`` or a file holding ``[red]`` keeps
its brackets.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

from bm.cli.exit_codes import USAGE


def error_console() -> Console:
    """A console on standard error (the stream as it is now: a test runner may have swapped it)."""
    return Console(stderr=True)


def print_error(message: str, prefix: str = "error:") -> None:
    """Print one error line (wrapped only by the terminal) to standard error."""
    error_console().print(f"[red]{prefix}[/] {escape(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = USAGE) -> typer.Exit:
    """Print ``message`` as an error and return the exit to raise (``raise fail(...) from None``)."""
    print_error(message)
    return typer.Exit(code=code)


def disk_full_message(exc: OSError, resume: str | None) -> str:
    """A write that found no room (``exc``: ENOSPC or EDQUOT, naming its file) as one line: where, that
    what was written is whole (bm's line files take a refused line back), and the command that goes on
    (``resume``, when the command can resume) once there is room."""
    where = exc.filename or "an output file"
    reason = (exc.strerror or "no space left on device").lower()
    text = f"{where}: {reason}; every record written before it is whole"
    if resume is not None:
        return f"{text}. Free some space there, then finish the run with: {resume}"
    return f"{text}. Free some space there, then run the command again (with --resume where it has one)"
