"""SIGINT and SIGTERM during ``bm run``, installed before torch loads so no signal ever shows a traceback."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class Interrupts:
    """SIGINT and SIGTERM: the first stops the feeder and cancels what is active (records and summary are
    still written); the second exits at once, keeping every record already flushed."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.on_first: list[Any] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.signal_name is not None:
            return  # interrupted: a further signal while the summary is written still exits at once
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signal_name is not None:
            os.write(2, b"\ninterrupted again: exiting now (finished records are in outputs.jsonl)\n")
            os._exit(130)
        self.signal_name = signal.Signals(signum).name
        for callback in self.on_first:
            callback()
