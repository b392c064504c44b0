"""The engine session under ``bm.LLM``: typed core requests in, final responses out, and the progress bar.

Why its own module: ``LLM.generate`` and ``bm run`` both drive this one session (the CLI through
:meth:`bm.LLM.session`), and it knows nothing of prompts, text or vLLM's shapes.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bm.engine.driving.loop import RequestQueue
from bm.engine.requests.request import Request, Response


@contextmanager
def progress(show: bool, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr while a batch runs (rich, a dependency already), when stderr is a
    terminal; nothing otherwise."""
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file gets no bar frames
        yield lambda: None
        return
    columns = (TextColumn("bm.LLM"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("requests", total=total)
        yield lambda: bar.advance(task)


class Session:
    """Requests in, final responses out, over one engine loop (see :meth:`LLM.session`).

    Requests wait in a queue the engine pulls from as it has room; :meth:`cancel` stops handing them out
    and ends the active ones as ``cancelled``, and :meth:`take_pending` returns those never handed out, so
    an interrupted caller can still account for every request."""

    def __init__(self, llm: Any, return_stats: Callable[[str], None] | None = None) -> None:
        from bm.distributed.engine import engine_loop

        self._pending = RequestQueue()
        self._finished: queue.Queue[tuple[Response, float]] = queue.Queue()
        # time.perf_counter() when the response next_final last returned came back from the engine
        # (RequestMetrics.finished_time); one value, so a long bm run keeps nothing per request
        self.last_finished_at: float | None = None
        self.stopped = False
        self._manager = engine_loop(
            llm.config,
            self._get_requests,
            self._on_response,
            return_stats=return_stats,
            model=llm.loaded,
            **({"executor": executor} if (executor := llm._engine_executor()) is not None else {}),
        )

    @property
    def warmup(self) -> dict[str, Any] | None:
        """The engine's warm-up report (None when it ran none, or reused an earlier one's)."""
        core = getattr(self._manager, "core", None)
        return getattr(core, "warmup", None)

    def submit(self, request: Request) -> None:
        self._pending.put(request)

    def next_final(self, timeout: float = 0.1) -> Response | None:
        """The next request's final response, or None when none finished within ``timeout`` seconds."""
        try:
            response, self.last_finished_at = self._finished.get(timeout=timeout)
        except queue.Empty:
            return None
        return response

    @property
    def alive(self) -> bool:
        """False once the engine's worker has stopped (after :meth:`close`, or when it failed)."""
        return self._manager.is_alive()

    @property
    def error(self) -> BaseException | None:
        return getattr(self._manager, "error", None)

    def cancel(self) -> None:
        """Hand out nothing more, and end the active requests at the next iteration as ``cancelled``."""
        self.stopped = True
        self._manager.cancel_all()

    def take_pending(self) -> list[Request]:
        """Every request not yet handed to the engine, removed; nothing more is handed out after this."""
        self.stopped = True
        return self._pending.take_all()

    def close(self) -> None:
        self._manager.shutdown(cancel=True)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get_requests(self, max_new: int) -> list[Request]:
        return [] if self.stopped else self._pending.take(max_new)

    def _on_response(self, response: Response) -> None:
        if response.final:  # the engine's thread; a request's one final response (nothing streams here)
            self._finished.put((response, time.perf_counter()))
