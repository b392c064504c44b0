"""The ``bm`` console script (and ``python -m bm``): the signal handlers first, then the command line.

Importing the command line (typer, rich, the config) takes about a second, and a Ctrl-C in it showed a
``KeyboardInterrupt`` traceback; SIGTERM killed the process outright (exit 143). So this module, which
imports nothing heavy, installs bm's handlers before anything else loads. Until a command takes over
with its own (:class:`~bm.cli.interrupts.Interrupts`), the first signal stops the start-up where it is:
nothing has run, and the process exits 130 with one line saying so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

from bm.cli.interrupts import INTERRUPTED_EXIT, SIGNALS, Interrupted, Interrupts


def main() -> None:
    try:
        _main()
    except SystemExit as exc:
        code = exc.code
        keep_exit_code_on_late_signals(code if isinstance(code, int) else (0 if code is None else 1))
        raise
    keep_exit_code_on_late_signals(0)


def keep_exit_code_on_late_signals(code: int) -> None:
    """The command is over and its results are written: a signal while the interpreter tears down
    (a second or so with torch loaded) ends the process with the command's own exit code at once.
    Left to the default action, a SIGTERM there ended a finished run with -15, as if it had failed
    (1 of 53 soak trials beside busy loops)."""

    def finish(_signum: int, _frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)

    for sig in SIGNALS:
        signal.signal(sig, finish)


def _main() -> None:
    with Interrupts():
        try:
            from bm.cli.main import app

            app()
        except Interrupted as exc:
            print(f"{exc.signal_name}: interrupted during start-up; nothing ran", file=sys.stderr)
            sys.exit(INTERRUPTED_EXIT)
        except OSError as exc:  # a full disk under any command: one line, never a traceback
            from bm.files import is_disk_full

            if not is_disk_full(exc):
                raise
            from bm.cli.errors import disk_full_message, print_error
            from bm.cli.exit_codes import FAILED

            print_error(disk_full_message(exc, None))
            sys.exit(FAILED)
