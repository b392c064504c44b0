"""What SIGINT and SIGTERM do, for every command: ``bm run`` (``--ray`` too), ``bm bench``, ``bm compare``
and ``bm sweep``. One policy, decided here and nowhere else (docs/exit-codes.md states it):

- **Start-up** (the checks, torch's import, the model load): nothing has run, so the first signal stops
  the start-up where it is: :class:`Interrupted` is raised in the main thread, and the command writes
  what an interrupted run writes (``bm run``: a ``cancelled`` record for every line, the summary and the
  resume command) without waiting for a load that would only be thrown away.
- **Running** (from :meth:`Interrupts.running`): the first signal stops admitting work and cancels what
  is in flight at the next iteration; the command writes its records and summary and prints how to
  finish (``--resume``). The callbacks given to :meth:`~Interrupts.running` do the stopping, and
  :attr:`~Interrupts.stop` is set for loops that poll.
- **Bounded**: the process ends within :data:`STOP_BOUND_S` seconds of the first signal, whatever
  happens; a watchdog exits 130 if the orderly stop has not, keeping every record already flushed.
- A **second signal** exits 130 at once.

Both signals exit 130 (the shell's code for Ctrl-C), so a script needs one case for "interrupted".
The handlers are installed before torch loads, so no signal ever shows a traceback. Other libraries
that install their own handlers (Ray's ``ray.init`` takes SIGTERM) are overruled with :meth:`reinstall`.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

STOP_BOUND_S = 60.0  # the longest a command may take to end after the first signal (docs/exit-codes.md)
BOUND_ENV = "BM_STOP_BOUND_S"  # overrides it (seconds; tests and slow clusters)


def watchdog_delay(bound_s: float) -> float:
    """When the watchdog fires: a little before the bound (5%, at most 3 s), because a loaded machine
    runs the timer's thread late. A busy Ray soak (load 13 on 2 cores) saw a watchdog armed for 60.0 s
    end its process at 60.15 s."""
    return bound_s - min(3.0, 0.05 * bound_s)


INTERRUPTED_EXIT = 130
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The first signal came during start-up. Not an ``Exception``, so no ``except Exception`` on the
    way (a model loader's fallbacks) swallows it; and not a ``KeyboardInterrupt``, which click turns
    into "Aborted!" and exit 1: it reaches :func:`bm.cli.entry.main`, or the command that handles it."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class Interrupts:
    """The signal handlers of one command, as a context manager around all of its work.

    ``bound_s``: the watchdog's bound (None: no watchdog, for a caller inside a process that must
    outlive the command, such as a test)."""

    def __init__(self, bound_s: float | None = -1.0) -> None:
        if bound_s is not None and bound_s < 0:
            bound_s = float(os.environ.get(BOUND_ENV, STOP_BOUND_S))
        self.bound_s = bound_s
        self.signal_name: str | None = None
        self.stop = threading.Event()  # set by the first signal
        self._running = False
        self._callbacks: list[Callable[[], None]] = []
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.signal_name is not None:
            # interrupted: a further signal while the process winds down still exits at once, and the
            # watchdog stays armed (a daemon thread: it never delays a normal exit)
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def interrupted(self) -> bool:
        return self.signal_name is not None

    def running(self, *callbacks: Callable[[], None]) -> None:
        """Start-up is over: from now on the first signal calls ``callbacks`` (stop admitting, cancel
        what is active) and the command goes on to write its results, instead of :class:`Interrupted`
        being raised. A signal that already came is acted on now."""
        self._callbacks.extend(callbacks)
        self._running = True
        if self.signal_name is not None:
            for callback in callbacks:
                callback()

    def starting(self) -> None:
        """Back to start-up behaviour (``bm compare`` loads a model between variants)."""
        self._running = False

    def reinstall(self) -> None:
        """Take SIGINT and SIGTERM back from a library that installed its own handlers (``ray.init``
        makes SIGTERM exit 15 with no records written)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if signal.getsignal(sig) != self._handle:
                    previous = signal.signal(sig, self._handle)
                    self._previous.setdefault(sig, previous)

    def check(self) -> None:
        """Raise :class:`Interrupted` when a signal came: for a start-up step that a signal could not
        cut short (one long call into a library)."""
        if self.signal_name is not None and not self._running:
            raise Interrupted(self.signal_name)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signal_name is not None:
            os.write(2, b"\ninterrupted again: exiting now (finished records are kept)\n")
            os._exit(INTERRUPTED_EXIT)
        self.signal_name = signal.Signals(signum).name
        self.stop.set()
        self._arm_watchdog()
        if not self._running:
            raise Interrupted(self.signal_name)
        for callback in self._callbacks:
            callback()

    def _arm_watchdog(self) -> None:
        if self.bound_s is None:
            return
        delay = watchdog_delay(self.bound_s)
        self._watchdog = threading.Timer(delay, _overdue, args=(delay, self.bound_s))
        self._watchdog.daemon = True
        self._watchdog.start()

    def disarm(self) -> None:
        """Stop the watchdog (a caller that handles the interrupt and goes on living)."""
        if self._watchdog is not None:
            self._watchdog.cancel()


def _overdue(delay_s: float, bound_s: float) -> None:
    os.write(
        2,
        f"\nstill stopping {delay_s:g} s after the interrupt, near the {bound_s:g} s bound: exiting now "
        "(finished records are kept; --resume runs the rest)\n".encode(),
    )
    os._exit(INTERRUPTED_EXIT)
