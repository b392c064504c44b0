"""The ``bm`` console script (and ``python -m bm``): the signal handlers first, then the command line.

Importing the command line (typer, rich, the config) takes about a second, and a Ctrl-C in it showed a
``KeyboardInterrupt`` traceback; SIGTERM killed the process outright (exit 143). So this module, which
imports nothing heavy, installs bm's handlers before anything else loads. Until a command takes over
with its own (:class:`~bm.cli.interrupts.Interrupts`), the first signal stops the start-up where it is:
nothing has run, and the process exits 130 with one line saying so.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from typing import Any, NoReturn

from bm.cli.interrupts import INTERRUPTED_EXIT, SIGNALS, Interrupted, Interrupts


def main() -> None:
    try:
        _main()
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):  # sys.exit("message"): Python would print it on the way out
            print(code, file=sys.stderr)
        exit_process(code if isinstance(code, int) else (0 if code is None else 1))
    exit_process(0)


def exit_process(code: int) -> NoReturn:
    """The command is over and its results are written (bm's record files are unbuffered and closed):
    run the exit callbacks (temporary files, torchrun's children), flush the terminal, and end the
    process with the command's code without the interpreter's teardown.

    That teardown takes a second or more with torch loaded, and Python puts the default signal action
    back partway through it: a Ctrl-C or SIGTERM in that second ended a finished run with -2 or -15, as
    if it had failed (8 of 100 soak trials on a quiet machine, each signal within 1.5 s of the end).
    During the callbacks, a signal ends the process with the same code at once."""

    def finish(_signum: int, _frame: Any) -> None:
        _flush()
        os._exit(code)

    for sig in SIGNALS:
        signal.signal(sig, finish)
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


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
            from bm.cli.errors import disk_full_message
            from bm.cli.exit_codes import FAILED
            from bm.stderr import print_error

            print_error(disk_full_message(exc, None))
            sys.exit(FAILED)
