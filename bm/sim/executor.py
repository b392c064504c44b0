"""The simulated executor: the fake executor's placeholder tokens, timed by the roofline cost model.

It computes no tensors. Each :meth:`SimExecutor.execute` prices the batch the engine core built, records
the duration as ``last_duration_s`` and advances the shared :class:`VirtualClock` by it, so everything
the core timestamps after the forward (first token, stats) reads simulated time. The scheduler, KV
manager, chunking and reuse around it are bm's own, unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bm.engine.execution.fake_executor import _MIX, FakeExecutor, fake_token
from bm.engine.execution.protocol import ExecutionBatch, ExecutionResult, ModelLimits, WorkKind
from bm.engine.requests.request import RequestError
from bm.scheduling.request import LlmRequest
from bm.sim.cost import CostModel, IterationCost


class VirtualClock:
    """Simulated seconds; callable like ``time.perf_counter`` so the core and the replayer can read it."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t


# Fields of a request whose answer only real logits can give (each a field of its Controls, named alike).
_LOGIT_FIELDS = (
    "stop_words_list",
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "logits_post_processor",
)


def logit_fields(request: LlmRequest) -> list[str]:
    """The request fields the simulator cannot honour, by their request-field names."""
    out = []
    if request.beam_width > 1:
        out.append("beam_width")
    controls = request.controls
    if controls is not None:
        out += [name for name in _LOGIT_FIELDS if getattr(controls, name)]
    return out


class SimExecutor(FakeExecutor):
    """Placeholder tokens, ``last_duration_s`` per iteration from ``cost_model``, KV capacity from memory."""

    def __init__(
        self,
        cost_model: CostModel,
        clock: VirtualClock | None = None,
        *,
        kv_blocks_override: int | None = None,
    ) -> None:
        model = cost_model.model
        super().__init__(max(model.vocab_size, 4), max_position_embeddings=model.max_position_embeddings)
        self._limits = ModelLimits(
            model.vocab_size, model.max_position_embeddings, device_type=cost_model.hardware.device_type
        )
        self.cost_model = cost_model
        self.clock = clock or VirtualClock()
        self.last_duration_s = 0.0
        self.last_cost: IterationCost | None = None
        self.total_duration_s = 0.0
        self.kv_capacity_tokens: int | None = None
        self._kv_blocks_override = kv_blocks_override

    def num_kv_blocks(self, kv_config: Any, max_useful_tokens: int) -> int:
        """Device memory minus this rank's weights, times ``free_memory_fraction``, over one token's KV
        (per rank); ``kv_cache.max_tokens`` and ``max_useful_tokens`` cap it as in a real run."""
        cm = self.cost_model
        free = cm.hardware.memory - cm.weight_bytes_per_rank()
        if free <= 0:
            raise RequestError(
                f"the model's weights ({cm.weight_bytes_per_rank() / 1e9:.1f} GB per device) do not fit "
                f"{cm.hardware.key}'s {cm.hardware.memory / 1e9:.0f} GB; raise --tensor-parallel"
            )
        per_token = cm.kv_bytes_per_token / cm.tp
        tokens = int(free * kv_config.free_memory_fraction / per_token)
        if kv_config.max_tokens is not None:
            tokens = min(tokens, kv_config.max_tokens)
        self.kv_capacity_tokens = tokens
        if self._kv_blocks_override is not None:
            return self._kv_blocks_override
        blocks = max(1, tokens // kv_config.tokens_per_block)
        # as a real run (bm.runtime.kv_sizing): never more than every admissible request at its longest
        return min(blocks, max(1, -(-max_useful_tokens // kv_config.tokens_per_block)))

    def admit(self, request: LlmRequest) -> None:
        fields = logit_fields(request)
        if fields:
            raise RequestError(
                f"request {request.request_id}: field {fields[0]!r} needs real logits, which the simulated "
                "executor does not compute (its tokens are placeholders); drop the field or run without "
                "--executor sim"
            )

    def execute(self, batch: ExecutionBatch) -> ExecutionResult:
        """Placeholder tokens for every sampling item (never the end id: lengths come from the dataset)."""
        result = ExecutionResult(num_forwards=len(batch.forwards))
        vocab = self._limits.vocab_size
        sampled = result.sampled
        for forward in batch.forwards:
            for item in forward:
                if not item.sample or item.kind is WorkKind.PADDING:
                    continue
                req = item.request
                position = item.start_pos + len(item.token_ids)
                token = fake_token(req.request_id, position, 0, vocab)
                if token == req.sampling.end_id:
                    token = token + 1 if token + 1 < vocab else 3
                sampled.append((item, token, None))
        cost = self.cost_model.iteration(batch)
        self.last_cost = cost
        self.last_duration_s = cost.seconds
        self.total_duration_s += cost.seconds
        self.clock.advance(cost.seconds)
        return result

    def decode_run(
        self, requests: list[LlmRequest], max_iterations: int, until: float
    ) -> tuple[list[float], list[list[int]]]:
        """Up to ``max_iterations`` generation iterations of ``requests`` (bm.engine.step.fast_forward), timed
        one after the other exactly as :meth:`execute` times each, none started at or after ``until``."""
        clock = self.clock
        cost_model = self.cost_model
        n = len(requests)
        # the fed token of each request sits at num_tokens - 1; every iteration moves all n by one
        positions = sum(r.num_tokens for r in requests) - n
        end_times: list[float] = []
        seconds = 0.0
        total = self.total_duration_s
        for _ in range(max_iterations):
            if clock.now >= until:
                break
            seconds = cost_model.decode_seconds(n, positions)
            total += seconds
            clock.now += seconds
            end_times.append(clock.now)
            positions += n
        done = len(end_times)
        if done:
            self.last_duration_s = seconds
            self.total_duration_s = total
            self.last_cost = None
        tokens = fake_tokens(requests, done, self._limits.vocab_size)
        return end_times, tokens


def fake_tokens(requests: list[LlmRequest], count: int, vocab_size: int, low: int = 3) -> list[list[int]]:
    """:func:`fake_token` for the next ``count`` positions of each request (bumped off its end id as
    :meth:`SimExecutor.execute` does), in one numpy pass: uint64 arithmetic wraps modulo 2**64, and the
    hash keeps its low 48 bits, so the values are exactly the scalar function's."""
    if count <= 0:
        return [[] for _ in requests]
    ids = np.array([r.request_id for r in requests], dtype=np.uint64)[:, None]
    first = np.array([r.num_tokens for r in requests], dtype=np.uint64)[:, None]
    positions = first + np.arange(count, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        mixed = (ids * np.uint64(1_000_003) + positions * np.uint64(8191) + np.uint64(17)) * np.uint64(_MIX)
    values = np.uint64(low) + (mixed & np.uint64(0xFFFFFFFFFFFF)) % np.uint64(vocab_size - low)
    out = values.astype(np.int64)
    end_ids = np.array([r.sampling.end_id for r in requests], dtype=np.int64)[:, None]
    hit = out == end_ids
    if hit.any():
        bumped = np.where(out + 1 < vocab_size, out + 1, 3)
        out = np.where(hit, bumped, out)
    return out.tolist()
