"""The seed's offline door: a fixed list of requests (typed, or the seed's ``InferenceRequest``) in,
one final response per request out, over the one client layer (:mod:`bm.engine.driving.client`).

It uses only the public callbacks, exactly as a library user would; the seed's objects are translated
once at the door.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from bm.batch_manager.executors import torch_executor
from bm.batch_manager.inference_request import InferenceRequest, response_from_tensors, to_core_request
from bm.config import BmConfig
from bm.engine.driving.client import EngineClient
from bm.engine.driving.loop import EngineLoop
from bm.engine.execution.protocol import Executor
from bm.engine.requests.request import Request, RequestError, Response, error_response


class OfflineClient(EngineClient):
    """:class:`~bm.engine.driving.client.EngineClient` for the seed's types: ``InferenceRequest`` objects are
    read once as they are handed out, and the seed's ``send_response(request_id, tensors, final, error)``
    is taken when the client is handed to a :class:`~bm.batch_manager.manager.BatchManager`."""

    def get_requests(self, max_new: int) -> list[Request | Response]:
        return [_typed(r) for r in super().get_requests(max_new)]

    def send_response(
        self,
        response: Response | int,
        tensors: Mapping[str, Any] | None = None,
        final: bool = False,
        error: str = "",
    ) -> None:
        if not isinstance(response, Response):
            response = response_from_tensors(response, tensors or {}, final, error)
        super().send_response(response)


def _typed(request: Request | InferenceRequest) -> Request | Response:
    """Seed requests are read once here; one that cannot be read becomes its own error response."""
    if isinstance(request, InferenceRequest):
        try:
            return to_core_request(request)
        except RequestError as exc:
            return error_response(request.request_id, str(exc))
    return request


def generate(
    requests: Iterable[Request | InferenceRequest],
    config: BmConfig | None = None,
    *,
    model: Any = None,
    executor: Executor | None = None,
    return_stats: Callable[[str], None] | None = None,
    check_integrity: bool = False,
    timeout: float | None = None,
) -> dict[int, Response]:
    """Run ``requests`` to completion and return each request's final :class:`Response` (a streamed
    request's tokens joined) by request id, on
    ``executor`` (by default the torch executor over ``model``, or over ``config.model``). Past
    ``timeout`` seconds the engine is stopped and a ``TimeoutError`` names the requests that had no final
    response (a request the scheduler never runs shows up there)."""
    config = config or BmConfig()
    requests = list(requests)
    client = OfflineClient(requests)
    with EngineLoop(
        config,
        client.get_requests,
        client.send_response,
        return_stats=return_stats,
        executor=executor or torch_executor(config, model),
        check_integrity=check_integrity,
    ) as manager:
        if not client.wait(timeout):
            stuck = sorted({r.request_id for r in requests} - set(client.results))
            manager.shutdown(cancel=True)
            raise TimeoutError(
                f"requests {stuck} got no final response within {timeout} s "
                f"({len(requests) - len(stuck)} of {len(requests)} finished)"
            )
    if manager.error is not None:
        raise RuntimeError(f"the batch manager failed: {manager.error}") from manager.error
    return client.results
