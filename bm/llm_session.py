"""The engine session under ``bm.LLM``: typed core requests in, final responses out, and the progress bar.

Why its own module: ``LLM.generate`` and ``bm run`` both drive this one session (the CLI through
:meth:`bm.LLM.session`), and it knows nothing of prompts, text or vLLM's shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bm.engine.driving.client import EngineClient


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


class Session(EngineClient):
    """Requests in, final responses out, over one engine loop (see :meth:`LLM.session`): the one client
    layer (:class:`~bm.engine.driving.client.EngineClient`, keeping nothing per request) and the loop it feeds.

    Requests wait in a queue the engine pulls from as it has room; :meth:`cancel` stops handing them out
    and ends the active ones as ``cancelled``, and :meth:`take_pending` returns those never handed out, so
    an interrupted caller can still account for every request."""

    def __init__(self, llm: Any, return_stats: Callable[[str], None] | None = None) -> None:
        from bm.distributed.engine import engine_loop

        super().__init__(keep_results=False)
        self._manager = engine_loop(
            llm.config,
            self.get_requests,
            self.send_response,
            return_stats=return_stats,
            model=llm.loaded,
            **({"executor": executor} if (executor := llm._engine_executor()) is not None else {}),
        )

    @property
    def warmup(self) -> dict[str, Any] | None:
        """The engine's warm-up report (None when it ran none, or reused an earlier one's)."""
        core = getattr(self._manager, "core", None)
        return getattr(core, "warmup", None)

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

    def close(self) -> None:
        self._manager.shutdown(cancel=True)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
