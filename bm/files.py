"""Files written whole or not at all.

A results file that a killed process leaves half-written is worse than none: a resume or a reader
takes it for complete. Every file bm rewrites in one piece (a resumed run's kept records, a bench's
results, an OpenAI batch file's output, a ``--ray`` run's parts and assembled outputs) is written
beside its name and renamed over it once whole; ``os.replace`` is atomic on one file system, so a
reader sees the old file or the new one, never part of either.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write, renamed over ``path`` once the ``with`` body is done;
    removed instead when the body raises. A process killed meanwhile leaves the old file (or none)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield temp
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    os.replace(temp, path)


@contextlib.contextmanager
def replacing_text(path: Path) -> Iterator[TextIO]:
    """:func:`replacing`, opened for UTF-8 text: the file is closed before it is renamed."""
    with replacing(path) as temp, temp.open("w", encoding="utf-8") as f:
        yield f
