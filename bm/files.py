"""Files written whole or not at all.

A results file that a killed process leaves half-written is worse than none: a resume or a reader
takes it for complete. Every file bm rewrites in one piece (a resumed run's kept records, a bench's
results, an OpenAI batch file's output, a ``--ray`` run's parts and assembled outputs, ``run.json``)
is written beside its name and renamed over it once whole; ``os.replace`` is atomic on one file
system, so a reader sees the old file or the new one, never part of either.

A file that grows a line at a time (``outputs.jsonl``, ``stats.jsonl``) cannot be renamed into place,
so it is appended with :func:`append_whole`, which takes a line back off when the file system refuses
part of it (a full disk): every such file ends with a whole line, and a resume that appends to it never
leaves a torn line in its middle (:func:`trim_torn_tail` cuts what a killed process left).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

# A write refused for want of room: the file system is full, or the user's quota is spent.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system (or the quota) had no room for a write."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


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


def write_whole(path: Path, text: str) -> None:
    """``path`` holds ``text`` (UTF-8), or what it held before: never an empty or partial file. A
    refused write raises :class:`OSError` naming ``path`` (the bare error of a write names no file)."""
    try:
        with replacing_text(path) as f:
            f.write(text)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def append_whole(f: BinaryIO, data: bytes, end: int, path: Path) -> int:
    """Append ``data`` (whole lines) to ``f``, an unbuffered binary file whose whole lines end at byte
    ``end``; returns the new end. When the file system takes part of ``data`` and then refuses the rest
    (a full disk writes what fits), the file is cut back to ``end`` before the error (naming ``path``)
    is raised, so it never ends in a torn line."""
    view = memoryview(data)
    try:
        while view:
            written = f.write(view)
            if not written:  # a regular file takes something or raises; be safe all the same
                raise OSError(errno.EIO, "the write was refused")
            view = view[written:]
    except OSError as exc:
        with contextlib.suppress(OSError):  # shrinking a file takes no room
            os.ftruncate(f.fileno(), end)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    return end + len(data)


def trim_torn_tail(path: Path) -> int:
    """Cut ``path`` back to its last whole line (a process killed mid-write, or a full disk before
    bm took torn lines back, may have left part of one); returns its size after. A missing file is 0."""
    try:
        f = path.open("r+b")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - (1 << 16))
            f.seek(start)
            chunk = f.read(end - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end == size:
            return size
        f.truncate(end)
        return end


def file_digest(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, read a megabyte at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
