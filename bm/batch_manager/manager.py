"""The Batch Manager as the seed defines it: the engine loop with tensor maps at its edge.

``get_requests`` returns :class:`InferenceRequest` objects (a uint64 id and named tensors) and
``send_response(request_id, tensors, final, error)`` receives the response table's tensors. Both are
translated at this edge (:func:`to_core_request`, :func:`response_tensors`); inside, the engine core works
on typed requests with plain lists. All state of a request is freed before its final response is sent,
so the caller may reuse its id as soon as it sees ``final=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from bm.batch_manager.executors import torch_executor
from bm.batch_manager.inference_request import InferenceRequest, response_tensors, to_core_request
from bm.config import BmConfig
from bm.engine.driving.loop import EngineLoop, PollStopSignal, ReturnStats
from bm.engine.execution.protocol import Executor
from bm.engine.requests.request import Request, Response
from bm.runtime import LoadedModel

GetRequests = Callable[[int], list[InferenceRequest]]
SendResponse = Callable[[int, dict[str, torch.Tensor], bool, str], None]

__all__ = ["BatchManager", "GetRequests", "PollStopSignal", "ReturnStats", "SendResponse"]


class BatchManager(EngineLoop):
    """The seed's Batch Manager. ``get_requests`` may also return typed :class:`Request` objects. It runs
    on ``executor``, by default the torch executor over ``model`` (or over ``config.model``)."""

    def __init__(
        self,
        config: BmConfig,
        get_requests: GetRequests,
        send_response: SendResponse,
        poll_stop_signal: Callable[[], Iterable[int]] | None = None,
        return_stats: Callable[[str], None] | None = None,
        *,
        model: LoadedModel | None = None,
        executor: Executor | None = None,
        check_integrity: bool = False,
    ) -> None:
        super().__init__(
            config,
            get_requests,
            send_response,
            poll_stop_signal,
            return_stats,
            executor=executor or torch_executor(config, model),
            check_integrity=check_integrity,
        )

    @property
    def runner(self) -> Any:
        """The torch executor's model runner (None under another executor)."""
        return getattr(self.executor, "runner", None)

    @property
    def attention_window(self) -> int | None:
        return self.core.attention_window

    def to_core(self, request: Any) -> Request:
        if isinstance(request, InferenceRequest):
            return to_core_request(request)
        return super().to_core(request)

    def deliver(self, response: Response) -> None:
        self._send_response(response.request_id, response_tensors(response), response.final, response.error)
