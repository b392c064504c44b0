"""The engine core on a worker thread, behind the Batch Manager's callbacks, with typed requests.

Each iteration is one :class:`~bm.engine.driving.driver.Driver` round: ``get_requests`` (fetch), the core's
:meth:`~bm.engine.step.core.EngineCore.step`, then ``send_response`` for every response, ``return_stats`` and
``poll_stop_signal`` (only while requests are active). This module adds the real-time part: the worker
thread, idling between arrivals, shutdown and cancel-all from other threads. :class:`EngineLoop` speaks the typed core (:class:`Request` in, :class:`Response` out);
:class:`bm.batch_manager.BatchManager` is the same loop with the seed's tensor maps at its edge. The loop
runs on the executor it is given (:func:`bm.batch_manager.torch_executor` over a model): the engine
never chooses one, so it imports no torch.

Faults stay with the request that caused them: an object from ``get_requests`` that is not a request
gets an error response of its own (when it names an id) and the rest of the list is admitted; a raising
``logits_post_processor`` ends only its request; a callback that raises is logged and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from bm.config import BmConfig
from bm.engine.driving.driver import Driver, to_request
from bm.engine.driving.worker import EngineWorker
from bm.engine.execution.protocol import Executor, hand_over_threads
from bm.engine.outputs.stats import IterationStats
from bm.engine.requests.request import Request, Response
from bm.engine.step.core import EngineCore
from bm.scheduling import FinishReason

__all__ = ["EngineLoop", "RequestQueue"]

log = logging.getLogger("bm")

PollStopSignal = Callable[[], Iterable[int]]
ReturnStats = Callable[[str], None]

_IDLE_SLEEP_S = 0.0005


class RequestQueue:
    """Requests waiting for the engine, taken as it has room: what every client's ``get_requests`` hands
    out, and what an interrupted caller takes back (``take_all``) to account for each one."""

    def __init__(self, requests: Iterable[Any] = ()) -> None:
        self._pending: deque[Any] = deque(requests)
        self._lock = threading.Lock()

    def put(self, request: Any) -> None:
        with self._lock:
            self._pending.append(request)

    def take(self, max_new: int) -> list[Any]:
        """Up to ``max_new`` requests, oldest first (all of them when ``max_new`` < 0)."""
        with self._lock:
            count = len(self._pending) if max_new < 0 else min(max_new, len(self._pending))
            return [self._pending.popleft() for _ in range(count)]

    def take_all(self) -> list[Any]:
        with self._lock:
            taken = list(self._pending)
            self._pending.clear()
            return taken

    def __len__(self) -> int:
        return len(self._pending)


class EngineLoop(EngineWorker):
    """Construct it with a config, the callbacks and the executor to run on; its worker thread starts at
    once.

    Call :meth:`shutdown` to stop: the worker stops fetching, finishes the active requests and exits.
    ``shutdown(cancel=True)`` (or :meth:`cancel_all`) ends every active request with finish reason
    ``cancelled`` instead. Also usable as a context manager, which shuts down on exit.
    """

    def __init__(
        self,
        config: BmConfig,
        get_requests: Callable[[int], list[Any]],
        send_response: Callable[..., None],
        poll_stop_signal: PollStopSignal | None = None,
        return_stats: ReturnStats | None = None,
        *,
        executor: Executor,
        check_integrity: bool = False,
    ) -> None:
        self.config = config
        self._send_response = send_response
        self._return_stats = return_stats
        self.core = EngineCore(config, executor, check_integrity=check_integrity)
        self.executor = self.core.executor
        self.model = getattr(self.executor, "model", None)
        self.driver = Driver(
            self.core,
            self.deliver,
            source=get_requests,
            stats=self._stats_json if return_stats is not None else None,
            poll_stop_signal=poll_stop_signal,
            convert=self.to_core,
        )
        self.kv_cache_manager = self.core.kv_cache_manager
        self.max_num_active_requests = self.core.max_num_active_requests
        hand_over_threads(self.executor)
        self._start_worker("bm-batch-manager")

    @property
    def num_active_requests(self) -> int:
        return self.core.num_active

    # -- the seam a tensor-map adapter overrides --------------------------------------------------------

    def to_core(self, request: Any) -> Request:
        """The typed request for what ``get_requests`` returned (raises RequestError when it is none)."""
        return to_request(request)

    def deliver(self, response: Response) -> None:
        self._send_response(response)

    # -- the loop: real time on this thread, one driver round at a time --------------------------------

    def _run(self) -> None:
        driver = self.driver
        while True:
            if self._cancel_requested.is_set():
                self._cancel_requested.clear()
                driver.cancel_all()
            try:
                out = driver.round(None if not self._shutdown.is_set() else [])
                worked = out.computed_tokens > 0
            except Exception as exc:  # a bug or a failing model: fail what is active, keep serving
                log.exception("batch manager iteration failed")
                self.error = exc
                driver.cancel_all(FinishReason.ERROR, f"internal error: {type(exc).__name__}: {exc}")
                worked = True
            if self._shutdown.is_set() and not self.core.num_active:
                self._release_executor()
                return
            if not worked:
                time.sleep(_IDLE_SLEEP_S)

    def _release_executor(self) -> None:
        """Give back what the executor put on a shared model (LoRA wrappers) when this engine ends, not
        whenever the garbage collector gets to it: engines come and go on one loaded model."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def deliver_safely(self, response: Response) -> None:
        self.driver.deliver(response)

    def _stats_json(self, stats: IterationStats) -> None:
        if self._return_stats is not None:
            self._return_stats(stats.to_json())
