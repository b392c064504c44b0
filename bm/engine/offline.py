"""The simplest client of the batch manager: a fixed list of requests in, one result per request out.

It uses only the public callbacks, exactly as a library user would, and is what ``bm run`` and the
tests build on. Streamed responses are stitched back into one result per request.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from bm.config import BmConfig
from bm.engine.batch_manager import BatchManager
from bm.engine.inference_request import InferenceRequest
from bm.engine.stats import hit_rate
from bm.runtime import LoadedModel
from bm.scheduling import FinishReason


@dataclass
class RequestResult:
    request_id: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    error: str = ""
    num_responses: int = 0
    num_pauses: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    # Only when asked for (return_log_probs, beam_width > 1, return_*_logits); see the spec's response table.
    output_log_probs: list[float] | None = None
    cum_log_probs: list[float] | None = None  # one per beam
    beams: list[list[int]] | None = None  # every beam, best first (output_ids is the best)
    beam_log_probs: list[list[float]] | None = None
    context_logits: torch.Tensor | None = None  # [prompt, vocab]
    generation_logits: torch.Tensor | None = None  # [output, vocab]

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def cache_hit_rate(self) -> float:
        """Reused over looked-up context blocks (0 when block reuse looked nothing up)."""
        return hit_rate(self.num_reused_blocks, self.num_missed_blocks)


class OfflineClient:
    """Hands requests to the batch manager as it asks for them and collects every response."""

    def __init__(
        self,
        requests: Iterable[InferenceRequest],
        on_final: Callable[[RequestResult], None] | None = None,
    ) -> None:
        self._pending = deque(requests)
        self._expected = len(self._pending)
        self._on_final = on_final
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.results: dict[int, RequestResult] = {}
        self.num_final = 0
        if self._expected == 0:
            self._done.set()

    def get_requests(self, max_new: int) -> list[InferenceRequest]:
        with self._lock:
            count = len(self._pending) if max_new < 0 else min(max_new, len(self._pending))
            return [self._pending.popleft() for _ in range(count)]

    def send_response(
        self, request_id: int, tensors: dict[str, torch.Tensor], final: bool, error: str
    ) -> None:
        with self._lock:
            result = self.results.get(request_id)
            if result is None or result.finish_reason != FinishReason.NOT_FINISHED:
                result = self.results[request_id] = RequestResult(request_id)
            result.num_responses += 1
            _collect(result, tensors)
            if final:
                reason = tensors.get("finish_reason")
                result.finish_reason = (
                    FinishReason(int(reason[0])) if reason is not None else FinishReason.ERROR
                )
                result.error = error
                pauses = tensors.get("num_pauses")
                result.num_pauses = int(pauses[0]) if pauses is not None else 0
                for name in ("num_reused_blocks", "num_missed_blocks"):
                    value = tensors.get(name)
                    setattr(result, name, int(value[0]) if value is not None else 0)
                self.num_final += 1
        if final:
            if self._on_final is not None:
                self._on_final(result)
            if self.num_final >= self._expected:
                self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def _collect(result: RequestResult, tensors: dict[str, torch.Tensor]) -> None:
    """Append a (possibly streamed) response's tokens and optional tensors to the request's result."""
    ids = tensors.get("output_ids")
    lengths = tensors.get("sequence_length")
    if ids is not None and ids.shape[0] > 1:  # beams: the final response carries them all
        lens = lengths.tolist() if lengths is not None else [ids.shape[1]] * ids.shape[0]
        result.beams = [ids[b, :n].tolist() for b, n in enumerate(lens)]
        result.output_ids = list(result.beams[0])
        lp = tensors.get("output_log_probs")
        if lp is not None:
            result.beam_log_probs = [lp[0, b, :n].tolist() for b, n in enumerate(lens)]
            result.output_log_probs = list(result.beam_log_probs[0])
    elif ids is not None and ids.numel():
        result.output_ids.extend(ids[0].tolist())
        lp = tensors.get("output_log_probs")
        if lp is not None:
            if result.output_log_probs is None:
                result.output_log_probs = []
            result.output_log_probs.extend(lp[0, 0].tolist())
    cum = tensors.get("cum_log_probs")
    if cum is not None:
        result.cum_log_probs = cum[0].tolist()
    if "context_logits" in tensors:
        result.context_logits = tensors["context_logits"][0]
    if "generation_logits" in tensors:
        result.generation_logits = tensors["generation_logits"][0, 0]


def generate(
    requests: Iterable[InferenceRequest],
    config: BmConfig | None = None,
    *,
    model: LoadedModel | None = None,
    return_stats: Callable[[str], None] | None = None,
    check_integrity: bool = False,
    timeout: float | None = None,
) -> dict[int, RequestResult]:
    """Run ``requests`` to completion and return one :class:`RequestResult` per request id."""
    client = OfflineClient(requests)
    with BatchManager(
        config or BmConfig(),
        client.get_requests,
        client.send_response,
        return_stats=return_stats,
        model=model,
        check_integrity=check_integrity,
    ) as manager:
        if not client.wait(timeout):
            manager.shutdown(cancel=True)
            raise TimeoutError(f"requests did not finish within {timeout} s")
    if manager.error is not None:
        raise RuntimeError(f"the batch manager failed: {manager.error}") from manager.error
    return client.results
