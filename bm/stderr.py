"""The one way every ``bm`` command reports an error: ``error: ...`` on standard error.

Errors used to go to stdout (only ``bm bench --json`` sent them to stderr), so ``bm run ... 2>err.log``
caught nothing and a script that parsed stdout read the error as output. Messages are printed as text,
never as rich markup: a message quoting ``[len*(1-r), len*(1+r)]`` or a file holding ``[red]`` keeps
its brackets. A run's readers warn the same way (``warning: ...``), so the printer is a module of its own at the
bottom of the package order, which every command and reader may import; how a command stops on an error
is ``bm.cli.errors``.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape


def error_console() -> Console:
    """A console on standard error (the stream as it is now: a test runner may have swapped it)."""
    return Console(stderr=True)


def print_error(message: str, prefix: str = "error:") -> None:
    """Print one error line (wrapped only by the terminal) to standard error."""
    error_console().print(f"[red]{prefix}[/] {escape(message)}", highlight=False, soft_wrap=True)
