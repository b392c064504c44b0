"""The one driver of :class:`~bm.engine.step.core.EngineCore`: admit requests, step, route responses and
stats, apply stop signals and cancellations.

Three callers run the core, and each is a configuration of this driver rather than a loop of its own:

- :class:`bm.engine.driving.loop.EngineLoop`: real time on a worker thread, requests fetched from the client's
  ``get_requests``, responses and stats to its callbacks, stop signals polled after each iteration;
- :mod:`bm.distributed.engine`: one driver per replica shard, fed the requests rank 0 assigned in this
  round, its responses and stats collected for the gather;
- :func:`bm.bench.simulated.run_sim`: a virtual clock, requests from the replayer, tokens timestamped after each
  step and steady decode stretches advanced at once (:meth:`Driver.fast_forward`).

The driver never sleeps, never owns a thread and never advances a clock: how time passes is the
caller's. Callback failures are the driver's: a raising sink is logged and the round goes on, so one
bad client never takes the engine down with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bm.engine.outputs.stats import IterationStats
from bm.engine.requests.request import Request, RequestError, Response, error_response
from bm.engine.step.core import EngineCore, StepOutput
from bm.engine.step.fast_forward import DecodeRun
from bm.scheduling import FinishReason

log = logging.getLogger("bm")

Deliver = Callable[[Response], None]
StatsSink = Callable[[IterationStats], None]
Source = Callable[[int], Sequence[Any]]
PollStopSignal = Callable[[], Iterable[int]]


def to_request(obj: object) -> Request:
    """The typed request for what a client handed over (raises RequestError when it is none).

    A :class:`Response` stands for a request a client could not even build (its error response)."""
    if isinstance(obj, Response):
        raise RequestError(obj.error)
    if not isinstance(obj, Request):
        raise RequestError(
            f"get_requests returned a {type(obj).__name__}, not an InferenceRequest or a bm Request"
        )
    return obj


def claimed_id(obj: object) -> Any:
    """The id an object from a client claims, for an error response; None when it has none."""
    return obj.get("request_id") if isinstance(obj, dict) else getattr(obj, "request_id", None)


class Driver:
    """One core, its sinks, and the round every caller runs: fetch, admit, step, route, stop."""

    def __init__(
        self,
        core: EngineCore,
        deliver: Deliver,
        *,
        source: Source | None = None,
        stats: StatsSink | None = None,
        poll_stop_signal: PollStopSignal | None = None,
        on_step: Callable[[StepOutput], None] | None = None,
        convert: Callable[[Any], Request] = to_request,
    ) -> None:
        """``on_step`` sees each step's output before its responses are routed (the simulator
        timestamps the tokens there); ``convert`` turns what ``source`` returns into typed requests
        (the seed's tensor-map adapter overrides it)."""
        self.core = core
        self._deliver = deliver
        self._source = source
        self._stats = stats
        self._poll_stop_signal = poll_stop_signal
        self._on_step = on_step
        self._convert = convert

    @property
    def num_active(self) -> int:
        return self.core.num_active

    @property
    def free_slots(self) -> int:
        """Requests the core takes now (``max_num_active_requests`` less the active ones)."""
        return max(0, self.core.max_num_active_requests - self.core.num_active)

    # -- one round ------------------------------------------------------------------------------------

    def round(self, new: Sequence[Any] | None = None, *, cancel: bool = False) -> StepOutput:
        """Cancel everything first when asked, admit ``new`` (fetched from the source when None), step
        once, route the responses, apply stop signals, then report stats. Returns the step's output (empty when nothing was active)."""
        if cancel:
            self.cancel_all()
        self.admit(self.fetch() if new is None else new)
        if not self.core.num_active:
            return StepOutput()
        out = self.step()
        self.apply_stop_signals()
        self.report(out)
        return out

    def fetch(self) -> Sequence[Any]:
        """Up to :attr:`free_slots` new objects from the source (nothing when it fails: logged)."""
        if self._source is None:
            return []
        try:
            return self._source(self.free_slots) or []
        except Exception:
            log.exception("get_requests callback failed")
            return []

    def admit(self, new: Sequence[Any]) -> None:
        """Admit each object; one beyond the free slots, one that is not a request or one the core
        refuses gets its own error response, and the rest are admitted."""
        room = self.free_slots
        for i, obj in enumerate(new):
            rid = claimed_id(obj)
            if i >= room:
                self._reject(rid, f"the batch manager accepts at most {room} new requests now")
                continue
            try:
                request = self._convert(obj)
            except RequestError as exc:
                self._reject(rid, str(exc))
                continue
            except Exception as exc:  # a malformed object must not take the others down with it
                self._reject(rid, f"request {rid!r} could not be read: {type(exc).__name__}: {exc}")
                continue
            refused = self.core.add_request(request)
            if refused is not None:
                self.deliver(refused)

    def step(self) -> StepOutput:
        """One core iteration (none when nothing is active); its responses are routed."""
        if not self.core.num_active:
            return StepOutput()
        out = self.core.step()
        if self._on_step is not None:
            self._on_step(out)
        self.deliver_all(out.responses)
        return out

    def report(self, out: StepOutput) -> None:
        """The iteration's stats to the stats sink (a failing sink is logged)."""
        if self._stats is not None and out.stats is not None:
            try:
                self._stats(out.stats)
            except Exception:
                log.exception("return_stats callback failed")

    def fast_forward(self, until: float = float("inf")) -> DecodeRun | None:
        """Right after :meth:`step`: the steady decode stretch the core can skip (see the core)."""
        return self.core.fast_forward(until)

    # -- ending requests ------------------------------------------------------------------------------

    def apply_stop_signals(self) -> None:
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
                self.deliver(response)

    def cancel_all(self, reason: FinishReason = FinishReason.CANCELLED, error: str = "") -> None:
        """End every active request now (Ctrl-C, shutdown with cancel, or an internal error)."""
        self.deliver_all(self.core.finish_all(reason, error))

    # -- routing --------------------------------------------------------------------------------------

    def deliver(self, response: Response) -> None:
        try:
            self._deliver(response)
        except Exception:
            log.exception("send_response callback failed for request %s", response.request_id)

    def deliver_all(self, responses: Iterable[Response]) -> None:
        for response in responses:
            self.deliver(response)

    def _reject(self, request_id: Any, message: str) -> None:
        if request_id is None:
            log.error("dropped an object from get_requests with no request id: %s", message)
            return
        self.deliver(error_response(request_id, message))
