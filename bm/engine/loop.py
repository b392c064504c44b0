"""The engine core on a worker thread, behind the Batch Manager's callbacks, with typed requests.

Each iteration: ``get_requests`` (fetch), the core's :meth:`~bm.engine.core.EngineCore.step`, then
``send_response`` for every response, ``poll_stop_signal`` and ``return_stats`` (only while requests are
active). :class:`EngineLoop` speaks the typed core (:class:`Request` in, :class:`Response` out);
:class:`bm.engine.batch_manager.BatchManager` is the same loop with the seed's tensor maps at its edge.

Faults stay with the request that caused them: an object from ``get_requests`` that is not a request
gets an error response of its own (when it names an id) and the rest of the list is admitted; a raising
``logits_post_processor`` ends only its request; a callback that raises is logged and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from bm.config import BmConfig
from bm.engine.core import EngineCore
from bm.engine.executor import Executor
from bm.engine.request import Request, RequestError, Response, error_response
from bm.scheduling import FinishReason

log = logging.getLogger("bm")

PollStopSignal = Callable[[], Iterable[int]]
ReturnStats = Callable[[str], None]

_IDLE_SLEEP_S = 0.0005


def default_executor(config: BmConfig, model: Any = None) -> Executor:
    """The torch executor over ``model`` (loaded from ``config.model`` when not given)."""
    from bm.runtime import load_model
    from bm.runtime.executor import TorchExecutor

    return TorchExecutor(model or load_model(config.model))


class EngineLoop:
    """Construct it with a config and the callbacks; its worker thread starts at once.

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
        model: Any = None,
        executor: Executor | None = None,
        check_integrity: bool = False,
    ) -> None:
        self.config = config
        self._get_requests = get_requests
        self._send_response = send_response
        self._poll_stop_signal = poll_stop_signal
        self._return_stats = return_stats
        self.executor = executor or default_executor(config, model)
        self.model = getattr(self.executor, "model", None)
        self.core = EngineCore(config, self.executor, check_integrity=check_integrity)
        self.kv_cache_manager = self.core.kv_cache_manager
        self.max_num_active_requests = self.core.max_num_active_requests
        self._shutdown = threading.Event()
        self._cancel_requested = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bm-batch-manager", daemon=True)
        self._thread.start()

    # -- public control -------------------------------------------------------------------------------

    @property
    def num_active_requests(self) -> int:
        return self.core.num_active

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

    def __enter__(self) -> EngineLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(cancel=exc[0] is not None)

    # -- the seam a tensor-map adapter overrides --------------------------------------------------------

    def to_core(self, request: Any) -> Request:
        """The typed request for what ``get_requests`` returned (raises RequestError when it is none).

        A :class:`Response` stands for a request a client could not even build (its error response).
        """
        if isinstance(request, Response):
            raise RequestError(request.error)
        if not isinstance(request, Request):
            raise RequestError(
                f"get_requests returned a {type(request).__name__}, not an InferenceRequest or a bm Request"
            )
        return request

    def deliver(self, response: Response) -> None:
        self._send_response(response)

    # -- the loop -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._cancel_requested.is_set():
                self._cancel_requested.clear()
                self._send_all(self.core.finish_all(FinishReason.CANCELLED))
            try:
                worked = self._step()
            except Exception as exc:  # a bug or a failing model: fail what is active, keep serving
                log.exception("batch manager iteration failed")
                self.error = exc
                message = f"internal error: {type(exc).__name__}: {exc}"
                self._send_all(self.core.finish_all(FinishReason.ERROR, message))
                worked = True
            if self._shutdown.is_set() and not self.core.num_active:
                return
            if not worked:
                time.sleep(_IDLE_SLEEP_S)

    def _step(self) -> bool:
        """One iteration; returns False when there was nothing to do."""
        self._fetch_new_requests()
        if not self.core.num_active:
            return False
        out = self.core.step()
        self._send_all(out.responses)
        self._apply_stop_signals()
        if self._return_stats is not None and out.stats is not None:
            try:
                self._return_stats(out.stats.to_json())
            except Exception:
                log.exception("return_stats callback failed")
        return out.computed_tokens > 0

    def _fetch_new_requests(self) -> None:
        if self._shutdown.is_set():
            return
        max_new = max(0, self.max_num_active_requests - self.core.num_active)
        try:
            new = self._get_requests(max_new) or []
        except Exception:
            log.exception("get_requests callback failed")
            return
        for i, obj in enumerate(new):
            rid = _request_id(obj)
            if i >= max_new:
                self._reject(rid, f"the batch manager accepts at most {max_new} new requests now")
                continue
            try:
                request = self.to_core(obj)
            except RequestError as exc:
                self._reject(rid, str(exc))
                continue
            except Exception as exc:  # a malformed object must not take the others down with it
                self._reject(rid, f"request {rid!r} could not be read: {type(exc).__name__}: {exc}")
                continue
            refused = self.core.add_request(request)
            if refused is not None:
                self.deliver_safely(refused)

    def _apply_stop_signals(self) -> None:
        if self._poll_stop_signal is None:
            return
        try:
            ids = set(self._poll_stop_signal() or ())
        except Exception:
            log.exception("poll_stop_signal callback failed")
            return
        for rid in ids:
            response = self.core.cancel(rid)
            if response is not None:
                self.deliver_safely(response)

    def _reject(self, request_id: Any, message: str) -> None:
        if request_id is None:
            log.error("dropped an object from get_requests with no request id: %s", message)
            return
        self.deliver_safely(error_response(request_id, message))

    def _send_all(self, responses: list[Response]) -> None:
        for response in responses:
            self.deliver_safely(response)

    def deliver_safely(self, response: Response) -> None:
        try:
            self.deliver(response)
        except Exception:
            log.exception("send_response callback failed for request %s", response.request_id)


def _request_id(obj: Any) -> Any:
    """The id an object from ``get_requests`` claims, for an error response; None when it has none."""
    rid = obj.get("request_id") if isinstance(obj, dict) else getattr(obj, "request_id", None)
    return rid
