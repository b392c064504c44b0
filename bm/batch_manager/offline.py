"""The simplest client of the engine: a fixed list of requests in, one result per request out.

It uses only the public callbacks, exactly as a library user would, and is what ``bm run`` and the
tests build on. It speaks the typed core (:class:`~bm.engine.request.Request`, plain lists); seed
``InferenceRequest`` objects are translated once at the door. Streamed responses are stitched back into
one result per request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bm.batch_manager.executors import torch_executor
from bm.batch_manager.inference_request import InferenceRequest, response_from_tensors, to_core_request
from bm.config import BmConfig
from bm.engine.driving.loop import EngineLoop, RequestQueue
from bm.engine.execution.protocol import Executor
from bm.engine.outputs.stats import hit_rate
from bm.engine.requests.request import (
    Request,
    RequestCounters,
    RequestError,
    Response,
    SampleOutput,
    error_response,
)
from bm.scheduling import FinishReason


@dataclass
class RequestResult(RequestCounters):
    request_id: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    error: str = ""
    num_responses: int = 0
    # Only when asked for (return_log_probs, beam_width > 1, return_*_logits); see the spec's response table.
    output_log_probs: list[float] | None = None
    cum_log_probs: list[float] | None = None  # one per beam
    beams: list[list[int]] | None = None  # every beam, best first (output_ids is the best)
    beam_log_probs: list[list[float]] | None = None
    context_logits: Any = None  # [prompt, vocab] tensor
    generation_logits: Any = None  # [output, vocab] tensor
    # top_logprobs: per token, the most likely (token, log prob) pairs; n > 1: every sample, index 0 first
    output_top_log_probs: list[list[tuple[int, float]]] | None = None
    samples: list[SampleOutput] | None = None

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified draft tokens (0 without drafts)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Reused over looked-up context blocks (0 when block reuse looked nothing up)."""
        return hit_rate(self.num_reused_blocks, self.num_missed_blocks)


class OfflineClient:
    """Hands requests to the engine as it asks for them and collects every response."""

    def __init__(
        self,
        requests: Iterable[Request | InferenceRequest],
        on_final: Callable[[RequestResult], None] | None = None,
    ) -> None:
        self._pending = RequestQueue(requests)
        self._expected = len(self._pending)
        self._on_final = on_final
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.results: dict[int, RequestResult] = {}
        self.num_final = 0
        if self._expected == 0:
            self._done.set()

    def get_requests(self, max_new: int) -> list[Request | Response]:
        return [_typed(r) for r in self._pending.take(max_new)]

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_pending(self) -> list[Request | InferenceRequest]:
        """Remove and return every request not yet handed to the engine (an interrupted run)."""
        return self._pending.take_all()

    def send_response(
        self,
        response: Response | int,
        tensors: Mapping[str, Any] | None = None,
        final: bool = False,
        error: str = "",
    ) -> None:
        """Takes a core :class:`Response`, or the seed's ``(request_id, tensors, final, error)`` when the
        client is handed to a :class:`~bm.batch_manager.manager.BatchManager`."""
        if not isinstance(response, Response):
            response = response_from_tensors(response, tensors or {}, final, error)
        with self._lock:
            result = self.results.get(response.request_id)
            if result is None or result.finish_reason != FinishReason.NOT_FINISHED:
                result = self.results[response.request_id] = RequestResult(response.request_id)
            result.num_responses += 1
            _collect(result, response)
            if response.final:
                result.finish_reason = response.finish_reason
                result.error = response.error
                result.copy_counters(response)
                self.num_final += 1
        if response.final:
            if self._on_final is not None:
                self._on_final(result)
            if self.num_final >= self._expected:
                self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def _typed(request: Request | InferenceRequest) -> Request | Response:
    """Seed requests are read once here; one that cannot be read becomes its own error response."""
    if isinstance(request, InferenceRequest):
        try:
            return to_core_request(request)
        except RequestError as exc:
            return error_response(request.request_id, str(exc))
    return request


def _collect(result: RequestResult, response: Response) -> None:
    """Append a (possibly streamed) response's tokens and optional outputs to the request's result."""
    if response.beams is not None:  # beams: the final response carries them all
        result.beams = [list(b) for b in response.beams]
        result.output_ids = list(result.beams[0]) if result.beams else []
        if response.cum_log_probs is not None and response.beam_log_probs is not None:
            result.beam_log_probs = [list(v) for v in response.beam_log_probs]
            result.output_log_probs = list(result.beam_log_probs[0]) if result.beam_log_probs else []
    else:
        result.output_ids.extend(response.output_ids)
        if response.output_log_probs is not None:
            if result.output_log_probs is None:
                result.output_log_probs = []
            result.output_log_probs.extend(response.output_log_probs)
        if response.output_top_log_probs is not None:
            if result.output_top_log_probs is None:
                result.output_top_log_probs = []
            result.output_top_log_probs.extend(response.output_top_log_probs)
    if response.samples is not None:
        result.samples = response.samples
    if response.cum_log_probs is not None:
        result.cum_log_probs = list(response.cum_log_probs)
    if response.context_logits is not None:
        result.context_logits = response.context_logits
    if response.generation_logits is not None:
        result.generation_logits = response.generation_logits


def generate(
    requests: Iterable[Request | InferenceRequest],
    config: BmConfig | None = None,
    *,
    model: Any = None,
    executor: Executor | None = None,
    return_stats: Callable[[str], None] | None = None,
    check_integrity: bool = False,
    timeout: float | None = None,
) -> dict[int, RequestResult]:
    """Run ``requests`` to completion and return one :class:`RequestResult` per request id, on
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
            done = {i for i, r in client.results.items() if r.finish_reason != FinishReason.NOT_FINISHED}
            stuck = sorted({r.request_id for r in requests} - done)
            manager.shutdown(cancel=True)
            raise TimeoutError(
                f"requests {stuck} got no final response within {timeout} s "
                f"({len(requests) - len(stuck)} of {len(requests)} finished)"
            )
    if manager.error is not None:
        raise RuntimeError(f"the batch manager failed: {manager.error}") from manager.error
    return client.results
