"""The engine across ranks: rank 0 coordinates, every rank runs its replica's core, in lockstep rounds.

One round, on every rank::

    broadcast (rank 0)   new requests for each replica, or stop / cancel
    step                 each rank's EngineCore.step() (a replica's shards compute one forward together)
    gather   (to rank 0) each replica's responses, stats line, active count, schedule digest

Rank 0 fetches from the client's ``get_requests`` and hands each new request to the replica with the
fewest outstanding tokens (prompt + tokens still to generate), so a replica given long requests gets
fewer of them; it delivers every gathered response through ``send_response`` and every stats line
(tagged with the layout) through ``return_stats``. Only the first shard of each replica reports.

Within a replica every shard runs the same core on the same requests in the same order, so every shard
computes the same schedule by itself: the core is deterministic given its inputs, and the only inputs
that could differ (sampled tokens, the KV pool size) are made equal: tokens are broadcast from the
first shard, the pool is the smallest any shard can hold. Broadcasting the schedule instead would ship
block tables every iteration for nothing; each round's gather carries a digest of every shard's
schedule, and rank 0 stops the run if two shards of a replica ever disagree.

A collective that fails (a rank died: its sockets close) or times out (a rank hangs: ``--rank-timeout``)
ends the run on rank 0 with every unfinished request answered by an error response, or, in a process
that asked for it (:func:`bm.parallel.layout.exit_on_rank_fault`: a ``bm run --ray`` replica, whose
blocks Ray retries when its process dies), ends rank 0's process before any response is written.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from typing import Any

from bm.batch_manager.executors import torch_executor
from bm.config import BmConfig
from bm.engine.driving.driver import Driver, claimed_id, to_request
from bm.engine.driving.worker import EngineWorker
from bm.engine.execution.protocol import (
    CacheLayout,
    ExecutionBatch,
    ExecutionResult,
    Executor,
    FinalOutputs,
    ModelLimits,
    hand_over_threads,
)
from bm.engine.outputs.stats import IterationStats
from bm.engine.requests.request import Request, RequestError, Response, error_response
from bm.engine.step.core import EngineCore, StepOutput
from bm.parallel import layout as _layout
from bm.parallel.layout import ParallelLayout
from bm.scheduling.request import LlmRequest

log = logging.getLogger("bm")

# Between rounds with nothing to compute (waiting for arrivals): every round is two collectives on every
# rank, so an idle run should not spin them as fast as it can.
_IDLE_SLEEP_S = 0.001
_RUN, _CANCEL, _STOP = "run", "cancel", "stop"


class ParallelExecutor:
    """A replica shard's executor: the torch executor, with the shards made to agree.

    The pool size is the minimum over the replica's shards (each sizes blocks for its own heads, and
    every shard's scheduler must see the same pool); sampled tokens are the first shard's."""

    def __init__(self, inner: Executor, layout: ParallelLayout) -> None:
        self.inner = inner
        self.layout = layout
        self.model = getattr(inner, "model", None)

    @property
    def limits(self) -> ModelLimits:
        return self.inner.limits

    def num_kv_blocks(self, kv_config: Any, max_useful_tokens: int) -> int:
        blocks = self.inner.num_kv_blocks(kv_config, max_useful_tokens)
        if self.layout.tensor_parallel == 1:
            return blocks
        import torch
        import torch.distributed as dist

        value = torch.tensor([blocks], dtype=torch.long)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=_layout.tp_group())
        return int(value.item())

    def bind(self, layout: CacheLayout) -> None:
        self.inner.bind(layout)

    def admit(self, request: LlmRequest) -> None:
        inputs = request.model_inputs
        if self.layout.tensor_parallel > 1 and inputs is not None and inputs.lora is not None:
            # each shard holds a slice of every projection, and adapter weights are not split to match
            raise RequestError(
                f"lora_task_id: LoRA adapters are not supported under tensor parallelism (this run has "
                f"--tensor-parallel {self.layout.tensor_parallel}); serve LoRA requests with "
                "--tensor-parallel 1 (replicas from --data-parallel each run adapters whole)"
            )
        self.inner.admit(request)

    def execute(self, batch: ExecutionBatch) -> ExecutionResult:
        result = self.inner.execute(batch)
        if self.layout.tensor_parallel == 1:
            return result
        import torch.distributed as dist

        tokens = [[token, lp] for _item, token, lp in result.sampled]
        message = [(tokens, result.faults)]
        dist.broadcast_object_list(message, src=self.layout.tp_ranks[0], group=_layout.tp_group())
        tokens, faults = message[0]
        result.sampled = [
            (item, token, lp) for (item, _t, _lp), (token, lp) in zip(result.sampled, tokens, strict=True)
        ]
        result.faults = faults
        return result

    def final_outputs(self, request: LlmRequest) -> FinalOutputs:
        return self.inner.final_outputs(request)

    def release(self, request: LlmRequest) -> None:
        self.inner.release(request)

    def load_adapter(self, slot: int, adapter: Any) -> None:
        self.inner.load_adapter(slot, adapter)

    def __getattr__(self, name: str) -> Any:
        """Anything else the executor protocol grows is the inner executor's (nothing to agree on)."""
        if name == "inner":  # not yet set (unpickling, early failure): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def build_rank_core(config: BmConfig, layout: ParallelLayout, model: Any = None) -> EngineCore:
    """This rank's core over its (sharded, when tensor-parallel) model, its executor made to agree with
    the replica's other shards once every rank is up."""
    executor = torch_executor(config, model)
    _layout.wait_for_all_ranks()
    return EngineCore(config, ParallelExecutor(executor, layout))


def _digest(out: StepOutput) -> int:
    s = out.schedule
    return zlib.crc32(repr((s.context_ids, s.context_chunks, s.generation_ids, s.paused_ids)).encode())


class _Replica:
    """One rank's side of every round: its core's driver, fed the requests rank 0 assigned to it."""

    def __init__(self, core: EngineCore, layout: ParallelLayout) -> None:
        self.core = core
        self.layout = layout
        self._responses: list[Response] = []
        self._stats: str | None = None
        self.driver = Driver(core, self._responses.append, stats=self._keep_stats)

    def _keep_stats(self, stats: IterationStats) -> None:
        self._stats = stats.to_json()

    def round(self, assigned: list[Request], command: str) -> tuple[Any, ...]:
        self._responses.clear()
        self._stats = None
        out = self.driver.round(assigned, cancel=command == _CANCEL)
        responses, stats = list(self._responses), self._stats
        if self.layout.tp_rank != 0:  # the first shard speaks for the replica
            responses, stats = [], None
        return responses, stats, self.core.num_active, _digest(out), out.computed_tokens


def run_worker(config: BmConfig, layout: ParallelLayout, model: Any = None) -> None:
    """A rank other than 0: serve rounds until rank 0 says stop (or a collective fails: re-raised)."""
    import torch.distributed as dist

    replica = _Replica(build_rank_core(config, layout, model), layout)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        assignments, command = box[0]
        if command == _STOP:
            return
        payload = replica.round(assignments[layout.dp_rank], command)
        dist.gather_object(payload, None, dst=0)


class TokenBalancer:
    """Which replica gets the next request: the one with the fewest outstanding tokens (prompt plus
    tokens still to generate, over its unfinished requests), among those with a free slot.

    Round-robin would hand a replica stuck with long requests as many new ones as an idle one; counting
    tokens keeps every replica's remaining work about even, so they finish together."""

    def __init__(self, num_replicas: int) -> None:
        self.active = [0] * num_replicas  # requests each replica holds (as of its last report)
        self.outstanding = [0] * num_replicas  # tokens each replica still has to process
        self.owner: dict[int, int] = {}  # request id -> replica, until its final response
        self._remaining: dict[int, int] = {}  # request id -> its tokens still outstanding

    @property
    def busy(self) -> bool:
        return bool(self.owner) or any(self.active)

    def assign(self, request: Request, free: list[int]) -> int:
        candidates = [r for r, n in enumerate(free) if n > 0] or list(range(len(free)))
        replica = min(candidates, key=lambda r: (self.outstanding[r], r))
        tokens = len(request.input_ids) + max(0, int(request.request_output_len))
        self.active[replica] += 1
        self.outstanding[replica] += tokens
        self.owner[request.request_id] = replica
        self._remaining[request.request_id] = tokens
        return replica

    def progress(self, request_id: int, num_tokens: int, final: bool) -> None:
        """A response came back: its tokens are done; a final one settles the request."""
        replica = self.owner.get(request_id)
        if replica is None:
            return
        done = self._remaining[request_id] if final else min(num_tokens, self._remaining[request_id])
        self._remaining[request_id] -= done
        self.outstanding[replica] -= done
        if final:
            del self._remaining[request_id], self.owner[request_id]

    def drop_all(self) -> list[int]:
        """Forget every unfinished request (the run failed); returns their ids."""
        ids = list(self.owner)
        self.owner.clear()
        self._remaining.clear()
        self.active = [0] * len(self.active)
        self.outstanding = [0] * len(self.outstanding)
        return ids


class DistributedEngineLoop(EngineWorker):
    """Rank 0's engine: :class:`~bm.engine.driving.loop.EngineLoop`'s interface (callbacks in, a worker thread,
    ``shutdown`` / ``cancel_all`` / ``is_alive`` / ``error``) over every replica of the run."""

    def __init__(
        self,
        config: BmConfig,
        get_requests: Callable[[int], list[Any]],
        send_response: Callable[..., None],
        poll_stop_signal: Callable[[], Any] | None = None,
        return_stats: Callable[[str], None] | None = None,
        *,
        model: Any = None,
        executor: Executor | None = None,
        check_integrity: bool = False,
    ) -> None:
        if poll_stop_signal is not None or executor is not None:
            raise ValueError(
                "a multi-rank engine takes no poll_stop_signal or executor (bm run/bench use neither)"
            )
        self.layout = _layout.current_layout()
        self.config = config
        self._get_requests = get_requests
        self._send_response = send_response
        self._return_stats = return_stats
        self.replica = _Replica(build_rank_core(config, self.layout, model), self.layout)
        self.core = self.replica.core
        self.model = getattr(self.core.executor, "model", None)
        self.max_num_active_requests = self.core.max_num_active_requests
        dp = self.layout.data_parallel
        self.balancer = TokenBalancer(dp)
        self.replicas = [
            {"dp_rank": r, "num_requests": 0, "num_output_tokens": 0, "num_iterations": 0, "busy_s": 0.0}
            for r in range(dp)
        ]
        _layout._state.replicas = self.replicas
        loaded = getattr(self.model, "kv_shapes", None)
        if loaded is not None:  # what each rank caches: its own heads only under tensor parallel
            _layout._state.kv_heads_per_rank = sorted({heads for heads, _dim in loaded.values()})
        _layout._state.fault = None
        hand_over_threads(self.core.executor)
        self._start_worker("bm-distributed")

    @property
    def num_active_requests(self) -> int:
        return sum(self.balancer.active)

    # -- rounds ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._round():
                pass
        except Exception as exc:
            self.error = exc
            self._fail_everything(exc)

    def _round(self) -> bool:
        import torch.distributed as dist

        command = _RUN
        if self._cancel_requested.is_set():
            self._cancel_requested.clear()
            command = _CANCEL
        if self._shutdown.is_set() and not self.balancer.busy:
            dist.broadcast_object_list([([], _STOP)], src=0)
            return False
        assignments = self._dispatch() if command == _RUN else [[] for _ in range(self.layout.data_parallel)]
        dist.broadcast_object_list([(assignments, command)], src=0)
        mine = self.replica.round(assignments[0], command)
        gathered: list[Any] = [None] * self.layout.world_size
        dist.gather_object(mine, gathered, dst=0)
        worked = self._collect(gathered)
        if not worked:
            time.sleep(_IDLE_SLEEP_S)
        return True

    def _dispatch(self) -> list[list[Request]]:
        """New requests, each to the replica with the fewest outstanding tokens that has a free slot."""
        out: list[list[Request]] = [[] for _ in range(self.layout.data_parallel)]
        if self._shutdown.is_set():
            return out
        free = [max(0, self.max_num_active_requests - a) for a in self.balancer.active]
        if not sum(free):
            return out
        try:
            new = self._get_requests(sum(free)) or []
        except Exception:
            log.exception("get_requests callback failed")
            return out
        for obj in new:
            if isinstance(obj, Response):  # a request the client could not build: its own error
                self._deliver(obj)
                continue
            try:
                request = to_request(obj)
            except RequestError as exc:
                rid = claimed_id(obj)
                if rid is not None:
                    self._deliver(error_response(rid, str(exc)))
                continue
            replica = self.balancer.assign(request, free)
            free[replica] -= 1
            self.replicas[replica]["num_requests"] += 1
            out[replica].append(request)
        return out

    def _collect(self, gathered: list[Any]) -> bool:
        tp = self.layout.tensor_parallel
        worked = False
        for replica in range(self.layout.data_parallel):
            shards = gathered[replica * tp : (replica + 1) * tp]
            responses, stats, num_active, digest, computed = shards[0]
            if any(s[3] != digest for s in shards[1:]):
                raise RuntimeError(
                    f"the shards of replica {replica} scheduled different batches; their cores diverged"
                )
            self.balancer.active[replica] = num_active
            worked |= computed > 0
            figures = self.replicas[replica]
            for response in responses:
                self._account(replica, response)
                self._deliver(response)
            if stats is not None:
                figures["num_iterations"] += 1
                line = _tag(stats, replica, self.layout)
                figures["busy_s"] += _latency_s(stats)
                if self._return_stats is not None:
                    try:
                        self._return_stats(line)
                    except Exception:
                        log.exception("return_stats callback failed")
        return worked

    def _account(self, replica: int, response: Response) -> None:
        count = len(response.beams[0]) if response.beams else len(response.output_ids)
        self.replicas[replica]["num_output_tokens"] += count
        self.balancer.progress(response.request_id, count, response.final)

    def _deliver(self, response: Response) -> None:
        try:
            self._send_response(response)
        except Exception:
            log.exception("send_response callback failed for request %s", response.request_id)

    def _fail_everything(self, exc: BaseException) -> None:
        """A rank died or hung: answer every request in flight, and every one not yet fetched (or, where
        the process asked to exit on a fault, exit before any of them is answered)."""
        why = (
            f"a rank of this {self.layout.world_size}-rank run failed (it died, or stayed silent past "
            f"--rank-timeout {self.layout.rank_timeout_s:g}s) ({type(exc).__name__}: {_first_line(exc)})"
        )
        if _layout._state.exit_on_fault:  # the caller retries by restarting this process: no records
            _layout.exit_for_fault(why)
        message = f"{why}; this request did not finish: rerun it"
        _layout._state.fault = message
        log.error("%s", message)
        for rid in self.balancer.drop_all():
            self._deliver(error_response(rid, message))
        try:
            rest = self._get_requests(-1) or []
        except Exception:
            rest = []
        for obj in rest:
            rid = getattr(obj, "request_id", None)
            if rid is not None:
                self._deliver(error_response(rid, message))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


def _latency_s(stats: str) -> float:
    import json

    return float(json.loads(stats).get("Iteration Latency (ms)", 0.0)) / 1e3


def _tag(stats: str, replica: int, layout: ParallelLayout) -> str:
    """A replica's stats line with the rank layout added (TP and DP sizes, and which replica)."""
    import json

    data = json.loads(stats)
    data.update({"DP Rank": replica, "DP Size": layout.data_parallel, "TP Size": layout.tensor_parallel})
    return json.dumps(data)


def engine_loop(
    config: BmConfig, *args: Any, model: Any = None, executor: Executor | None = None, **kwargs: Any
) -> Any:
    """The engine for this process's layout: the plain :class:`EngineLoop` in a single-process run (on
    ``executor``, by default the torch executor over ``model``), the rank-0 coordinator of a multi-rank
    one (same interface, so clients need no change)."""
    if _layout.current_layout().is_distributed:
        return DistributedEngineLoop(config, *args, model=model, executor=executor, **kwargs)
    from bm.engine.driving.loop import EngineLoop

    return EngineLoop(config, *args, executor=executor or torch_executor(config, model), **kwargs)
