"""Where a long run is: the time left, and a plain progress line where no progress bar can be drawn.

rich draws its bar only on a terminal; in a CI log or a pipe it shows nothing until the run ends, so a
job killed by its timeout says nothing about how far it got. Off a terminal ``bm bench`` and ``bm run``
print :func:`progress_line` instead, every :data:`PLAIN_INTERVAL_S` seconds and once at the end. Both
the bar and the line show the time left (:func:`eta_s`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console

PLAIN_INTERVAL_S = 10.0  # seconds between plain progress lines (tests set it smaller)


def eta_s(done: float, total: float | None, elapsed_s: float) -> float | None:
    """Seconds left to reach ``total`` at the rate so far (``done`` in ``elapsed_s``), or None when it
    cannot be told: no total, or nothing done yet to measure a rate by.

    Give output tokens when the run's total is known in advance (every request runs to its length, as
    under ``--ignore-eos``), else requests: tokens come steadily while requests finish in bursts."""
    if total is None or done <= 0 or elapsed_s <= 0:
        return None
    return max(total - done, 0) * elapsed_s / done


def format_duration(seconds: float | None) -> str:
    """``0:27``, ``12:05``, ``1:02:05`` (rounded up to the second); ``?`` when unknown."""
    if seconds is None:
        return "?"
    whole = int(-(-seconds // 1))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_line(
    command: str,
    finished: int,
    total: int | None,
    output_tokens: int,
    elapsed_s: float,
    eta: float | None,
    *,
    final: bool = False,
) -> str:
    """``bm bench [0:12] 312/1,024 requests, 45,210 output tokens (3,812/s), ETA 0:27``: under 80
    columns for runs of up to about 100,000 requests and an hour. ``final``: the run's last line,
    without an ETA (it may have ended early: interrupted, or its engine stopped)."""
    count = f"{finished:,}/{total:,}" if total is not None else f"{finished:,}"
    rate = output_tokens / elapsed_s if elapsed_s > 0 else 0.0
    line = (
        f"{command} [{format_duration(elapsed_s)}] {count} requests, "
        f"{output_tokens:,} output tokens ({rate:,.0f}/s)"
    )
    return line if final else f"{line}, ETA {format_duration(eta)}"


class PlainProgress:
    """Prints a :func:`progress_line` at most every ``interval_s`` (default :data:`PLAIN_INTERVAL_S`,
    read when constructed) and once more at :meth:`finish` unless nothing moved since the last one."""

    def __init__(
        self,
        console: Console,
        command: str,
        *,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.command = command
        self.interval_s = PLAIN_INTERVAL_S if interval_s is None else interval_s
        self._clock = clock
        self._next = clock() + self.interval_s
        self._last: tuple[int, int | None, int, float, float | None] | None = None
        self._printed: tuple[int, int | None, int, float, float | None] | None = None

    def update(
        self, finished: int, total: int | None, output_tokens: int, elapsed_s: float, eta: float | None
    ) -> None:
        """Remember where the run is; print it when the interval has passed."""
        self._last = (finished, total, output_tokens, elapsed_s, eta)
        now = self._clock()
        if now >= self._next:
            self._next = now + self.interval_s
            self._print(final=False)

    def finish(self) -> None:
        """The last figures given, as the run's final line (nothing if none were given, or if the last
        line printed already showed them)."""
        if self._last != self._printed:
            self._print(final=True)

    def _print(self, *, final: bool) -> None:
        if self._last is None:
            return
        self._printed = self._last
        line = progress_line(self.command, *self._last, final=final)
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)
