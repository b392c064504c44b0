"""The control surface every engine loop shares: a daemon worker thread, shutdown, cancel-all, and use as
a context manager. :class:`~bm.engine.driving.loop.EngineLoop` (one process) and
:class:`~bm.distributed.engine.DistributedEngineLoop` (rank 0 of several) are driven alike by their
clients through it; each only supplies the loop its thread runs."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any


class EngineWorker(ABC):
    """A worker thread running :meth:`_run` with ``shutdown`` / ``cancel_all`` / ``is_alive`` / ``error``."""

    def _start_worker(self, name: str) -> None:
        """Create the events and start the thread (call last in the subclass's ``__init__``)."""
        self._shutdown = threading.Event()
        self._cancel_requested = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @abstractmethod
    def _run(self) -> None:
        """The loop the worker thread runs: each engine loop supplies its own."""

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def cancel_all(self) -> None:
        """End every active request at the next iteration boundary with finish reason ``cancelled``."""
        self._cancel_requested.set()

    def shutdown(self, wait: bool = True, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop fetching; exit once no request is active (at once with ``cancel=True``)."""
        if cancel:
            self._cancel_requested.set()
        self._shutdown.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(cancel=exc[0] is not None)
