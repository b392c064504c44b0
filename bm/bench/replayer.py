"""The replay client: hands requests to the batch manager when their arrival time has come, and
timestamps every token that streams back.

It is a ``get_requests`` / ``send_response`` pair like any other client (the batch manager calls
``get_requests`` at the start of every iteration, also while idle), so honouring the arrival clock is
simply never returning a request before its time. All times are seconds since :meth:`Replayer.start`,
read from one clock (``time.perf_counter`` unless a test gives another).

A concurrency cap works like ``vllm bench serve --max-concurrency``: a request whose arrival has passed
waits client-side until fewer than ``max_concurrency`` requests are in flight; its *send time* is then
the moment the slot freed, and latencies are measured from that send time, as vLLM measures them.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bm.engine.requests.fields import FIELD_ALIASES  # vLLM's names for request fields, as in `bm run`
from bm.engine.requests.request import Request, Response
from bm.engine.requests.seeds import line_seed
from bm.scheduling import FinishReason
from bm.workloads import Workload


@dataclass
class Timeline:
    """What the client saw of one request; every time in seconds since the replay started."""

    request_id: int
    arrival_s: float
    send_s: float | None = None  # visible to the batch manager (arrival, or later under a concurrency cap)
    taken_s: float | None = None  # returned by get_requests: admitted by the batch manager
    token_s: list[float] = field(default_factory=list)  # one entry per output token
    engine_queue_s: float | None = None  # admission to first scheduled iteration (the final response's)
    num_pauses: int = 0
    finish_reason: str = FinishReason.NOT_FINISHED.label
    error: str | None = None
    done_s: float | None = None


class Replayer:
    """Replays ``requests`` at ``arrivals`` (seconds, non-decreasing) through the batch manager callbacks.

    Finished timelines are put on :attr:`finished` (a queue) so the caller can write records from its
    own thread, never from the batch manager's.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        arrivals: Sequence[float],
        *,
        max_concurrency: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if len(requests) != len(arrivals):
            raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
        if any(b < a for a, b in itertools.pairwise(arrivals)):
            raise ValueError("arrival times must not decrease")
        self._requests = list(requests)
        self.timelines = {
            r.request_id: Timeline(r.request_id, float(t)) for r, t in zip(requests, arrivals, strict=True)
        }
        if len(self.timelines) != len(self._requests):
            raise ValueError("request ids must be unique")
        self._next = 0
        self._slots: deque[float] | None = deque([0.0] * max_concurrency) if max_concurrency else None
        self._clock = clock
        self._t0: float | None = None
        self._lock = threading.Lock()
        self._all_done = threading.Event()
        self.finished: queue.Queue[Timeline] = queue.Queue()
        self.num_finished = 0
        self.num_output_tokens = 0
        # Known when nothing can end a request before its length (no end id, no stop words: --ignore-eos,
        # and every simulated request), so a progress display can tell the time left from tokens.
        known = all(r.end_id is None and not r.stop_words_list for r in self._requests)
        self.num_expected_output_tokens = sum(r.request_output_len for r in self._requests) if known else None
        if not self._requests:
            self._all_done.set()

    # -- clock --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._t0 = self._clock()

    def now(self) -> float:
        return 0.0 if self._t0 is None else self._clock() - self._t0

    @property
    def num_sent(self) -> int:
        return self._next

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def wait(self, timeout: float | None = None) -> bool:
        return self._all_done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._all_done.is_set()

    # -- the callbacks ------------------------------------------------------------------------------

    def get_requests(self, max_new: int) -> list[Request]:
        """Requests whose arrival has passed (and that have a concurrency slot), oldest first."""
        if self._t0 is None:
            return []
        with self._lock:
            now = self.now()
            out: list[Request] = []
            while self._next < len(self._requests) and (max_new < 0 or len(out) < max_new):
                request = self._requests[self._next]
                timeline = self.timelines[request.request_id]
                if timeline.arrival_s > now or (self._slots is not None and not self._slots):
                    break
                slot_free_s = self._slots.popleft() if self._slots is not None else 0.0
                timeline.send_s = max(timeline.arrival_s, slot_free_s)
                timeline.taken_s = now
                out.append(request)
                self._next += 1
            return out

    def next_release_s(self, max_new: int) -> float:
        """The clock time from which :meth:`get_requests` (``max_new``) would return a request, assuming
        no request finishes before then; infinity when none would (none left, no room, no slot)."""
        if self._t0 is None or max_new == 0 or self._next >= len(self._requests):
            return float("inf")
        if self._slots is not None and not self._slots:
            return float("inf")
        return self._t0 + self.timelines[self._requests[self._next].request_id].arrival_s

    def send_response(self, response: Response) -> None:
        now = self.now()
        with self._lock:
            timeline = self.timelines.get(response.request_id)
            if timeline is None or timeline.done_s is not None:
                return
            count = len(response.beams[0]) if response.beams else len(response.output_ids)
            timeline.token_s.extend([now] * count)
            self.num_output_tokens += count
            if response.final:
                self._finish(timeline, response, now)

    def _finish(self, timeline: Timeline, response: Response, now: float) -> None:
        timeline.finish_reason = response.finish_reason.label
        if response.error:
            timeline.error, timeline.finish_reason = response.error, FinishReason.ERROR.label
        if response.first_scheduled_time is not None:
            timeline.engine_queue_s = response.first_scheduled_time - response.arrival_time
        timeline.num_pauses = response.num_pauses
        self._close(timeline, now)

    def _close(self, timeline: Timeline, now: float) -> None:
        timeline.done_s = now
        if self._slots is not None:
            self._slots.append(now)
        self.num_finished += 1
        self.finished.put(timeline)
        if self.num_finished >= len(self._requests):
            self._all_done.set()

    def fail_unfinished(self, error: str, reason: str = FinishReason.ERROR.label) -> int:
        """End every request still open (never sent, or lost by a stopped batch manager) with ``error``.

        Stops sending at once, so a request is never both failed here and handed out later. ``reason``
        is ``cancelled`` when the user interrupted the run: those requests did not fail, and the results
        count them apart (an interrupted run showed them as failed and looked finished)."""
        with self._lock:
            self._next = len(self._requests)
            now = self.now()
            open_ = [t for t in self.timelines.values() if t.done_s is None]
            for timeline in open_:
                timeline.error, timeline.finish_reason = error, reason
                self._close(timeline, now)
            return len(open_)


def build_requests(
    workload: Workload, end_id: int | None, run_seed: int | None = None
) -> list[tuple[int, Request]]:
    """(index, request) for every runnable row; a row whose fields cannot make a request gets its error.

    Every request streams: the client timestamps each token, which is what TTFT and ITL need. With
    ``run_seed``, a row without a seed samples with one derived from it and the row's index, so
    duplicate rows differ and the same seed replays the same tokens."""
    built = []
    for index, req in enumerate(workload.requests):
        if not req.ok or req.input_ids is None:
            continue
        fields = {FIELD_ALIASES.get(k, k): v for k, v in req.fields.items() if k != "streaming"}
        if end_id is not None:
            fields.setdefault("end_id", end_id)
        if run_seed is not None:
            fields.setdefault("random_seed", line_seed(run_seed, index))
        try:
            request = Request(index, list(req.input_ids), req.max_tokens, streaming=True, **fields)
        except TypeError as exc:
            req.error = f"{req.where}: {exc}"
            continue
        built.append((index, request))
    return built
