"""A watcher that ends what a killed process started (:func:`watch` runs ``python -m bm.reaper TOKEN``).

A ``bm run --ray`` driver that starts its own Ray cluster is the parent of Ray's head processes. When the
driver is SIGKILLed, Ray's fate-sharing ends most of them, but its two node agents (``DashboardAgent``,
``RuntimeEnvAgent``, ray 2.60) stay alive under PID 1 for ever: each notices that the raylet died and
then blocks reporting it to the GCS, which died too. Nothing in a SIGKILLed process can clean up, so a
separate small process does. The driver marks its environment with a token before it starts anything;
every process started from it (and from those) inherits the mark, whatever session or parent it ends
up with. Once the driver is gone and a grace period has passed, the watcher kills every process that
still carries the mark. It reads ``/proc`` (Linux; elsewhere it does nothing) and imports nothing of
bm's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 5.0  # time the marked processes get to end by themselves (Ray's own shutdown)
TOKEN_ENV = "BM_REAPER_TOKEN"

_watchers: list[subprocess.Popen] = []  # kept open for the process's life: its stdin's end is the signal


def watch() -> None:
    """Start the watcher for this process (once): every process started from here on, directly or not,
    that is still alive ``GRACE_S`` seconds after this process ended, however it ended, is killed."""
    if _watchers or not Path("/proc/self/environ").exists():
        return
    token = f"{os.getpid()}-{time.time_ns()}"
    os.environ[TOKEN_ENV] = token
    watcher = subprocess.Popen(
        [sys.executable, "-m", "bm.reaper", token],
        stdin=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != TOKEN_ENV},  # never its own victim
        start_new_session=True,  # a Ctrl-C on the terminal is for the driver, not for its watcher
    )
    _watchers.append(watcher)


def marked(token: str) -> list[int]:
    """The live processes whose environment carries ``token``."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:  # gone, or not ours to read
                continue
            if needle in environ.split(b"\0"):
                found.append(int(entry))
    return found


def _main(token: str) -> None:
    while os.read(sys.stdin.fileno(), 4096):  # returns b"" once the driver's end closed: it has ended
        pass
    time.sleep(GRACE_S)
    for pid in marked(token):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _main(sys.argv[1])
