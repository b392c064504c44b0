"""How a ``bm`` command stops on an error: the message on standard error (``bm.stderr``, the one
printer every command and a run's readers share) and the exit to raise, and the one line a full disk gets.
"""

from __future__ import annotations

import typer

from bm.cli.exit_codes import USAGE
from bm.stderr import print_error


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
