"""The Batch Manager: a worker thread running the in-flight batching loop over the user's callbacks.

One iteration is a flat list of named steps::

    fetch -> schedule -> allocate -> forward -> sample -> update -> respond -> stop signals -> stats

``get_requests`` is called at the start of each iteration, ``send_response`` at the end for every request
with something to report, ``poll_stop_signal`` and ``return_stats`` after that (stats only while requests
are active). All state of a request is freed before its final response is sent, so the caller may reuse
its id as soon as it sees ``final=True``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

from bm.config import BmConfig
from bm.engine import response_tensors
from bm.engine.execution import IterationExecutor, IterationResult
from bm.engine.inference_request import InferenceRequest, RequestError, RequestLimits, parse_request
from bm.engine.stats import IterationStats
from bm.kv import KVCacheManager
from bm.runtime import LoadedModel, ModelRunner, load_model, num_kv_blocks
from bm.runtime.decoding import Decoder
from bm.scheduling import FinishReason, LlmRequest, RequestState, SchedulerOutput
from bm.scheduling.factory import build_scheduler

log = logging.getLogger("bm")

GetRequests = Callable[[int], list[InferenceRequest]]
SendResponse = Callable[[int, dict[str, torch.Tensor], bool, str], None]
PollStopSignal = Callable[[], Iterable[int]]
ReturnStats = Callable[[str], None]

_IDLE_SLEEP_S = 0.0005


class BatchManager:
    """Construct it with a config and the callbacks; its worker thread starts at once.

    Call :meth:`shutdown` to stop: the worker stops fetching, finishes the active requests and exits.
    ``shutdown(cancel=True)`` (or :meth:`cancel_all`) ends every active request with finish reason
    ``cancelled`` instead. Also usable as a context manager, which shuts down on exit.
    """

    def __init__(
        self,
        config: BmConfig,
        get_requests: GetRequests,
        send_response: SendResponse,
        poll_stop_signal: PollStopSignal | None = None,
        return_stats: ReturnStats | None = None,
        *,
        model: LoadedModel | None = None,
        check_integrity: bool = False,
    ) -> None:
        self.config = config
        self._get_requests = get_requests
        self._send_response = send_response
        self._poll_stop_signal = poll_stop_signal
        self._return_stats = return_stats
        self._check_integrity = check_integrity

        self.model = model or load_model(config.model)
        engine, kv_cfg = config.engine, config.kv_cache
        self.max_seq_len = self._max_seq_len()
        self.max_num_active_requests = engine.max_num_active_requests or engine.max_batch_size
        num_blocks = num_kv_blocks(
            self.model, kv_cfg, max_useful_tokens=self.max_num_active_requests * self.max_seq_len
        )
        self.attention_window = self._attention_window()
        sinks = kv_cfg.sink_token_length if self.attention_window is not None else 0
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            kv_cfg.tokens_per_block,
            # V1 is the static baseline: a static-batching engine keeps no prefix cache.
            enable_block_reuse=kv_cfg.enable_block_reuse and engine.batching_scheme != "v1",
            max_attention_window=self.attention_window,
            sink_token_length=sinks,
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            kv_cfg.tokens_per_block,
            min(self.max_seq_len, num_blocks * kv_cfg.tokens_per_block),
            max_attention_window=self.attention_window,
            sink_token_length=sinks,
        )
        self.decoder = Decoder()
        self.scheduler = build_scheduler(engine, self.kv_cache_manager)
        self.executor = IterationExecutor(
            engine.batching_scheme, engine.max_num_tokens, self.kv_cache_manager, self.runner, self.decoder
        )
        self.limits = RequestLimits(
            vocab_size=self.model.vocab_size,
            max_seq_len=self.max_seq_len,
            # with chunking a prompt of any length fits the budget piece by piece
            max_num_tokens=None if engine.enable_chunked_context else engine.max_num_tokens,
            max_beam_width=engine.max_beam_width,
        )

        self._active: dict[int, LlmRequest] = {}  # insertion order is arrival order
        self._held: list[LlmRequest] = []  # finished, kept by the scheduler (V1 empty slots)
        self._iteration = 0
        self._start_time = time.perf_counter()
        self._shutdown = threading.Event()
        self._cancel_requested = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bm-batch-manager", daemon=True)
        self._thread.start()

    # -- public control -------------------------------------------------------------------------------

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

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

    def __enter__(self) -> BatchManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(cancel=exc[0] is not None)

    # -- the loop -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._cancel_requested.is_set():
                self._cancel_requested.clear()
                self._finish_all(FinishReason.CANCELLED, "")
            try:
                worked = self._step()
            except Exception as exc:  # a bug or a failing model: fail what is active, keep serving
                log.exception("batch manager iteration failed")
                self.error = exc
                self._finish_all(FinishReason.ERROR, f"internal error: {type(exc).__name__}: {exc}")
                worked = True
            if self._shutdown.is_set() and not self._active:
                return
            if not worked:
                time.sleep(_IDLE_SLEEP_S)

    def _step(self) -> bool:
        """One iteration; returns False when there was nothing to do."""
        self._fetch_new_requests()
        if not self._active:
            return False
        started = time.perf_counter()
        num_active = len(self._active)
        kv = self.kv_cache_manager
        reused_before, missed_before = kv.num_reused_blocks, kv.num_missed_blocks
        scheduled = self.scheduler.schedule_request(list(self._active.values()))
        reuse = (kv.num_reused_blocks - reused_before, kv.num_missed_blocks - missed_before)
        self._pause(scheduled.paused_requests)
        result = self.executor.run(scheduled)
        used_blocks = self.kv_cache_manager.pool.num_used_blocks
        num_finished = self._respond(result)
        self._apply_stop_signals()
        if self._check_integrity:
            self._verify()
        self._report_stats(scheduled, result, num_active, used_blocks, num_finished, started, reuse)
        return result.computed_tokens > 0

    # -- steps ----------------------------------------------------------------------------------------

    def _fetch_new_requests(self) -> None:
        if self._shutdown.is_set():
            return
        max_new = max(0, self.max_num_active_requests - len(self._active))
        try:
            new = self._get_requests(max_new) or []
        except Exception:
            log.exception("get_requests callback failed")
            return
        for i, request in enumerate(new):
            if i >= max_new:
                self._reject(request, f"the batch manager accepts at most {max_new} new requests now")
            else:
                self._admit(request)

    def _admit(self, request: InferenceRequest) -> None:
        rid = getattr(request, "request_id", None)
        if rid in self._active:
            self._reject(
                request, f"request id {rid} is already active; an id may be reused after its final response"
            )
            return
        try:
            llm_request = parse_request(request, self.limits)
        except RequestError as exc:
            self._reject(request, str(exc))
            return
        kv = self.kv_cache_manager
        needed = kv.get_needed_resource_to_completion(llm_request)
        if needed > kv.get_max_resource_count():
            self._reject(
                request,
                f"the request needs {needed} KV cache blocks (prompt {llm_request.num_prompt_tokens} + output "
                f"{llm_request.max_new_tokens} tokens) but the cache holds {kv.get_max_resource_count()} blocks "
                f"of {kv.tokens_per_block} tokens; raise kv_cache.max_tokens or kv_cache.free_memory_fraction, "
                "or lower request_output_len",
            )
            return
        llm_request.arrival_time = time.perf_counter()
        self._active[llm_request.request_id] = llm_request

    def _pause(self, paused: list[LlmRequest]) -> None:
        """Free a paused request's blocks; it waits in the queue and recomputes prompt + output later."""
        for req in paused:
            self.kv_cache_manager.free(req.request_id)
            req.pause()

    def _respond(self, result: IterationResult) -> int:
        """Send what each request has to report; finished ones are freed first. Returns how many ended."""
        finished = 0
        newly_finished = {id(r) for r in result.finished}
        for req in result.produced:
            if req.streaming and (id(req) not in newly_finished or self.scheduler.holds(req)):
                self._send(req, final=False)
        for req in [*self._held, *result.finished]:
            if self.scheduler.holds(req):
                continue
            self._release(req)
            self._send(req, final=True)
            finished += 1
        self._held = [r for r in self._active.values() if r.is_finished]
        return finished

    def _apply_stop_signals(self) -> None:
        if self._poll_stop_signal is None:
            return
        try:
            ids = set(self._poll_stop_signal() or ())
        except Exception:
            log.exception("poll_stop_signal callback failed")
            return
        for rid in ids:
            req = self._active.get(rid)
            if req is not None:
                if not req.is_finished:
                    req.finish_reason = FinishReason.CANCELLED
                self._release(req)
                self._send(req, final=True)

    def _report_stats(
        self,
        scheduled: SchedulerOutput,
        result: IterationResult,
        num_active: int,
        used_blocks: int,
        num_finished: int,
        started: float,
        reuse: tuple[int, int],
    ) -> None:
        self._iteration += 1
        if self._return_stats is None:
            return
        kv = self.kv_cache_manager
        now = time.perf_counter()
        stats = IterationStats(
            iteration=self._iteration,
            active_requests=num_active,
            max_requests=self.max_num_active_requests,
            max_blocks=kv.get_max_resource_count(),
            free_blocks=kv.get_max_resource_count() - used_blocks,
            used_blocks=used_blocks,
            tokens_per_block=kv.tokens_per_block,
            context_requests=len(scheduled.context_requests),
            generation_requests=len(scheduled.generation_requests),
            context_tokens=result.context_tokens,
            generation_tokens=result.generation_tokens,
            empty_generation_slots=result.empty_slots,
            padding_tokens=result.padding_tokens,
            computed_tokens=result.computed_tokens,
            num_forwards=result.num_forwards,
            paused_requests=len(scheduled.paused_requests),
            queued_requests=num_active - scheduled.num_scheduled,
            finished_requests=num_finished,
            elapsed_s=now - self._start_time,
            latency_ms=(now - started) * 1e3,
            reused_blocks=reuse[0],
            missed_blocks=reuse[1],
            cached_blocks=kv.pool.num_cached_blocks,
        )
        try:
            self._return_stats(stats.to_json())
        except Exception:
            log.exception("return_stats callback failed")

    # -- helpers --------------------------------------------------------------------------------------

    def _release(self, req: LlmRequest) -> None:
        """Free everything the request holds; afterwards its id may be reused."""
        self.kv_cache_manager.free(req.request_id)
        self.kv_cache_manager.free(req.padding_key)
        self.decoder.release(req.request_id)
        self._active.pop(req.request_id, None)
        req.state = RequestState.GENERATION_COMPLETE

    def _finish_all(self, reason: FinishReason, error: str) -> None:
        for req in list(self._active.values()):
            if not req.is_finished:
                req.finish_reason = reason
            self._release(req)
            self._send(req, final=True, error=error)
        self._held.clear()

    def _send(self, req: LlmRequest, final: bool, error: str = "") -> None:
        if req.beam_width > 1 and req.decoding.beam is not None:
            tensors = response_tensors.beam_outputs(req)
        else:
            start = req.num_streamed_tokens if req.streaming else 0
            new_tokens = req.output_ids[start:]
            req.num_streamed_tokens = len(req.output_ids)
            tensors = {
                "output_ids": torch.tensor([new_tokens], dtype=torch.int32),
                "sequence_length": torch.tensor([len(new_tokens)], dtype=torch.int32),
            }
            if req.output_log_probs is not None:
                tensors.update(response_tensors.log_probs(req, start))
        if final:
            if req.decoding is not None:
                tensors.update(response_tensors.logits(req))
            tensors.update(self._request_stats(req))
        self._deliver(req.request_id, tensors, final, error)

    @staticmethod
    def _request_stats(req: LlmRequest) -> dict[str, torch.Tensor]:
        """bm's extra tensors on a final response: why it ended and what the engine did with it."""
        scheduled = req.first_scheduled_time
        return {
            "finish_reason": torch.tensor([int(req.finish_reason)], dtype=torch.int32),
            "num_pauses": torch.tensor([req.num_pauses], dtype=torch.int32),
            # block reuse: blocks taken from the cache, and context blocks computed (every start summed)
            "num_reused_blocks": torch.tensor([req.num_reused_blocks], dtype=torch.int32),
            "num_missed_blocks": torch.tensor([req.num_missed_blocks], dtype=torch.int32),
            # seconds from admission to the first iteration that computed part of it (-1: never scheduled)
            "queue_time": torch.tensor(
                [scheduled - req.arrival_time if scheduled is not None else -1.0], dtype=torch.float64
            ),
        }

    def _reject(self, request: object, message: str) -> None:
        rid = getattr(request, "request_id", None)
        tensors = {
            "output_ids": torch.zeros((1, 0), dtype=torch.int32),
            "sequence_length": torch.zeros(1, dtype=torch.int32),
            "finish_reason": torch.tensor([int(FinishReason.ERROR)], dtype=torch.int32),
        }
        self._deliver(rid, tensors, True, message)

    def _deliver(self, request_id: object, tensors: dict[str, torch.Tensor], final: bool, error: str) -> None:
        try:
            self._send_response(request_id, tensors, final, error)  # type: ignore[arg-type]
        except Exception:
            log.exception("send_response callback failed for request %s", request_id)

    def _verify(self) -> None:
        kv = self.kv_cache_manager
        kv.check_integrity()
        owned = sum(
            kv.has_request(r.request_id) + kv.has_request(r.padding_key) for r in self._active.values()
        )
        if kv.num_requests != owned:
            raise AssertionError(f"{kv.num_requests - owned} block tables belong to no active request")

    def _max_seq_len(self) -> int:
        limits = [self.config.engine.max_seq_len, self.model.max_position_embeddings]
        if not self.model.sliding_window_on_every_layer:
            # Only some layers slide: one engine window cannot serve them all, so a sequence never
            # outgrows the window (attention is full there, windowed or not).
            limits.append(self.model.sliding_window)
        given = [x for x in limits if x]
        return min(given) if given else 1 << 20

    def _attention_window(self) -> int | None:
        """The engine's attention window: the smaller of kv_cache.max_attention_window and the model's own
        sliding window (when every layer slides); None when no sequence can outgrow it."""
        native = self.model.sliding_window if self.model.sliding_window_on_every_layer else None
        given = [w for w in (self.config.kv_cache.max_attention_window, native) if w]
        window = min(given) if given else None
        return window if window is not None and window < self.max_seq_len else None
