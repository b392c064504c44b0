"""The ``bm`` console script (and ``python -m bm``): the signal handlers first, then the command line.

Importing the command line (typer, rich, the config) takes about a second, and a Ctrl-C in it showed a
``KeyboardInterrupt`` traceback; SIGTERM killed the process outright (exit 143). So this module, which
imports nothing heavy, installs bm's handlers before anything else loads. Until a command takes over
with its own (:class:`~bm.cli.interrupts.Interrupts`), the first signal stops the start-up where it is:
nothing has run, and the process exits 130 with one line saying so.
"""

from __future__ import annotations

import sys

from bm.cli.interrupts import INTERRUPTED_EXIT, Interrupted, Interrupts


def main() -> None:
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
