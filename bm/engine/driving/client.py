"""The one client layer between a caller and the engine loop: requests queue in, one final response per
request comes out.

``bm.LLM``'s session (and through it ``bm run``), :func:`bm.batch_manager.generate` and the seed's
offline client all do this one job, so they share this class: the engine loop pulls requests as it has
room (:meth:`EngineClient.get_requests`, nothing once stopped) and pushes responses
(:meth:`EngineClient.send_response`); a streamed request's responses are joined into one final
:class:`~bm.engine.requests.request.Response`, which goes to ``on_final``, to :attr:`EngineClient.results` when
kept, and to the queue :meth:`EngineClient.next_final` reads. Plain Python, no torch.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from bm.engine.driving.loop import RequestQueue
from bm.engine.requests.request import Response


@dataclasses.dataclass
class _Streamed:
    """The tokens (and their log probs) of a streamed request's responses before its final one."""

    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_log_probs: list[float] | None = None
    output_top_log_probs: list[list[tuple[int, float]]] | None = None


class EngineClient:
    """Requests in, finals out, over the engine loop's two callbacks.

    ``requests``: handed out first, in order. ``keep_results``: keep every final in :attr:`results`;
    without, finals wait in a queue for :meth:`next_final` instead (``bm run`` over millions of lines
    keeps nothing per request). A final goes to one of the two, never both.
    """

    def __init__(
        self,
        requests: Iterable[Any] = (),
        on_final: Callable[[Response], None] | None = None,
        *,
        keep_results: bool = True,
    ) -> None:
        self._pending = RequestQueue(requests)
        self._expected = len(self._pending)
        self._on_final = on_final
        self._keep = keep_results
        self._lock = threading.Lock()
        self._all_final = threading.Event()
        self._finals: queue.Queue[tuple[Response, float]] = queue.Queue()
        self._streamed: dict[int, _Streamed] = {}
        self.results: dict[int, Response] = {}
        self.num_final = 0
        self.stopped = False
        # time.perf_counter() when the response next_final last returned came back from the engine
        # (RequestMetrics.finished_time); one value, so a long run keeps nothing per request
        self.last_finished_at: float | None = None
        if self._expected == 0:
            self._all_final.set()

    # -- requests in -----------------------------------------------------------------------------------

    def submit(self, request: Any) -> None:
        """One more request, handed out after those already waiting."""
        with self._lock:
            self._expected += 1
            self._all_final.clear()
        self._pending.put(request)

    def get_requests(self, max_new: int) -> list[Any]:
        """The engine loop's callback: up to ``max_new`` waiting requests (all when < 0); none once
        stopped."""
        return [] if self.stopped else self._pending.take(max_new)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_pending(self) -> list[Any]:
        """Every request not yet handed to the engine, removed; nothing more is handed out after this (an
        interrupted caller accounts for each one)."""
        self.stopped = True
        return self._pending.take_all()

    # -- finals out ------------------------------------------------------------------------------------

    def send_response(self, response: Response) -> None:
        """The engine loop's callback: a streamed response's tokens are held; a final one, joined with
        them, is the request's result."""
        if not response.final:
            with self._lock:
                _hold(self._streamed.setdefault(response.request_id, _Streamed()), response)
            return
        with self._lock:
            held = self._streamed.pop(response.request_id, None)
            if held is not None and response.beams is None:
                _hold(held, response)
                response = dataclasses.replace(response, **dataclasses.asdict(held))
            if self._keep:
                self.results[response.request_id] = response
            self.num_final += 1
            done = self.num_final >= self._expected
        if not self._keep:
            self._finals.put((response, time.perf_counter()))
        if self._on_final is not None:
            self._on_final(response)
        if done:
            self._all_final.set()

    @property
    def num_finals_waiting(self) -> int:
        """Requests the engine has finished whose responses :meth:`next_final` has not handed out yet."""
        return self._finals.qsize()

    def next_final(self, timeout: float = 0.1) -> Response | None:
        """The next request's final response, or None when none came within ``timeout`` seconds (a
        client that keeps its results queues none: read :attr:`results`)."""
        try:
            response, self.last_finished_at = self._finals.get(timeout=timeout)
        except queue.Empty:
            return None
        return response

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every request handed in has its final response, waiting up to ``timeout`` seconds."""
        return self._all_final.wait(timeout)


def _hold(held: _Streamed, response: Response) -> None:
    held.output_ids.extend(response.output_ids)
    if response.output_log_probs is not None:
        held.output_log_probs = [*(held.output_log_probs or []), *response.output_log_probs]
    if response.output_top_log_probs is not None:
        held.output_top_log_probs = [*(held.output_top_log_probs or []), *response.output_top_log_probs]
