"""One writer per output directory: an exclusive lock on ``-o`` for as long as the process lives.

Two ``bm run``s into one directory both exited 0, and one run's records were lost; once the records came
from one run while ``run.json`` described the other, so a later resume would have mixed them. Every
command that writes into ``-o`` (``bm run``, ``bm run --ray``'s driver, ``bm bench``, ``bm compare``,
``bm sweep``) takes this lock before it writes anything there (:func:`bm.runfiles.outdir.prepare_out_dir`).

The lock is ``flock`` on ``OUT/.bm.lock``, which says who holds it (pid, command line, since when, host).
The kernel releases a ``flock`` when its last descriptor closes, so a process that ends in any way,
SIGKILL included, leaves the directory free; the file stays, and is no sign of a writer by itself. The
descriptor is kept open in this module until the process ends (or :func:`release` is called by a library
caller that runs many times in one process), and child processes do not keep it (it is not inherited
across ``exec``, and a forked child closes its copy), so a replica, a rank or a worker outliving its
parent cannot keep the directory locked. Ray's workers never write into ``-o``: they
hand their records to the driver, which holds the lock. Within one process a second lock of the same
directory succeeds (the process is its one writer); two processes never both hold it. ``flock`` is
advisory and local: it does not stop another program, and over NFS it is only as good as the server's
lock support.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
from pathlib import Path

LOCK_NAME = ".bm.lock"

_held: dict[Path, int] = {}  # resolved directory -> the open descriptor of its lock file
_guard = threading.Lock()


class DirectoryLocked(ValueError):
    """Another process holds the directory; phrased for the user (exit code 2)."""


def acquire(out: Path, flag: str = "-o") -> bool:
    """Lock ``out`` (an existing directory) for this process; raises :class:`DirectoryLocked` naming the
    process that holds it, or :class:`OSError` when the lock file cannot be written. Returns whether the
    lock file was created here (so a command that takes its directory back can remove it again)."""
    key = out.resolve()
    with _guard:
        if key in _held:
            return False
        path = key / LOCK_NAME
        while True:
            created = not path.exists()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise DirectoryLocked(
                    f"{flag} {str(out)!r} is being written by another process ({holder}); wait for it to "
                    f"end (or stop it), or give another {flag} directory"
                ) from None
            if _same_file(fd, path):
                break
            os.close(fd)  # its holder removed the file after we opened it: lock the one there now
        try:
            _describe(fd)
        except OSError:  # no room for even this line: the file system is full
            if created:
                path.unlink(missing_ok=True)
            os.close(fd)
            raise
        _held[key] = fd
        return created


def release(out: Path, remove: bool = False) -> None:
    """Give up this process's lock of ``out`` (nothing if it holds none); ``remove``: delete the lock file
    first (while still holding it, so no other process can have locked the file being removed)."""
    key = out.resolve()
    with _guard:
        fd = _held.pop(key, None)
        if fd is None:
            return
        if remove:
            (key / LOCK_NAME).unlink(missing_ok=True)
        os.close(fd)


def holds(out: Path) -> bool:
    """Whether this process holds ``out``'s lock."""
    with _guard:
        return out.resolve() in _held


def _forget_in_child() -> None:
    """A forked child (``bm sweep``'s simulation workers) closes its copies of the lock descriptors: a
    worker outliving a killed parent would otherwise keep the directory locked. Closing a copy never
    unlocks the parent's (``flock`` holds until every copy is closed; only ``LOCK_UN`` would)."""
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _describe(fd: int) -> None:
    """Write who holds the lock into its file (read by the next process that finds it locked)."""
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    about = {
        "pid": os.getpid(),
        "command": _command_line(),
        "since": since,
        "host": socket.gethostname(),
    }
    data = (json.dumps(about) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _command_line() -> str:
    """This process's command line, as ``bm run ...`` when it is bm's (``bm``, ``python -m bm``)."""
    words = sys.argv or [""]
    if Path(words[0]).name in ("bm", "main.py", "__main__.py"):
        return shlex.join(["bm", *words[1:]])
    return shlex.join(words)


def _holder(fd: int) -> str:
    """The holder as its lock file describes it: ``pid 123, `bm run ...`, since ...``."""
    try:
        about = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace"))
        words = [f"pid {about['pid']}", f"`{about['command']}`", f"since {about['since']}"]
    except (OSError, ValueError, KeyError, TypeError):
        return "it has not said who it is yet"
    if about.get("host") not in (None, socket.gethostname()):
        words.append(f"on host {about['host']}")
    return ", ".join(words)
