"""A deterministic executor without a model: each token is a pure function of request, position and beam.

It runs the real engine loop (scheduler, KV manager, pausing, chunking, reuse, beams) with no torch, so
scheduler behaviour is tested exactly as the engine drives it, and because a token depends only on where
it is produced, outputs are identical whatever the batching: the same invariant the model oracle checks.
It also checks what a real executor relies on: every position it is asked to compute has a block.
"""

from __future__ import annotations

from typing import Any

from bm.engine.execution.protocol import (
    PENDING_TOKEN,
    BeamStep,
    CacheLayout,
    DraftOutcome,
    ExecutionBatch,
    ExecutionResult,
    FinalOutputs,
    ModelLimits,
    WorkItem,
    WorkKind,
)
from bm.engine.requests.model_inputs import LoraSpec
from bm.kv import NO_BLOCK, cdiv
from bm.scheduling.request import LlmRequest

_MIX = 0x9E3779B97F4A7C15


def fake_token(request_id: int, position: int, beam: int, vocab_size: int, low: int = 3) -> int:
    """The token sampled at ``position`` (the position of the token produced) of a request's beam."""
    h = (request_id * 1_000_003 + position * 8191 + beam * 131 + 17) * _MIX & 0xFFFFFFFFFFFF
    return low + h % (vocab_size - low)


class FakeExecutor:
    """Tokens from :func:`fake_token`; ``end_at``: request id -> output length at which it samples its end id."""

    def __init__(
        self,
        vocab_size: int = 1000,
        *,
        max_position_embeddings: int | None = None,
        end_at: dict[int, int] | None = None,
        layer_windows: tuple[int | None, ...] = (),
        device_type: str = "cpu",
        chain: bool = False,
    ) -> None:
        """``layer_windows``: a model's attention window per layer (None: full attention), to exercise the
        cache's per-window accounting without a model. ``device_type``: the device whose engine defaults
        the core resolves (cpu or cuda). ``chain``: a token also depends on the input token before it, as
        a model's does, so a wrong input (a placeholder resolved to the wrong token) changes the output."""
        if vocab_size < 4:
            raise ValueError("the fake executor needs a vocabulary of at least 4 tokens")
        self._limits = ModelLimits(
            vocab_size, max_position_embeddings, layer_windows=layer_windows, device_type=device_type
        )
        self.end_at = dict(end_at or {})
        self.chain = chain
        self.layout: CacheLayout | None = None
        self.num_executed_tokens = 0
        self.adapter_loads: list[tuple[int, int]] = []  # (slot, task id), in load order

    @property
    def limits(self) -> ModelLimits:
        return self._limits

    def num_kv_blocks(self, kv_config: Any, max_useful_tokens: int) -> int:
        """Without a device the cache is as large as ``kv_cache.max_tokens`` says (required)."""
        if kv_config.max_tokens is None:
            raise ValueError("the fake executor needs kv_cache.max_tokens to size its cache")
        return max(1, kv_config.max_tokens // kv_config.tokens_per_block)

    def bind(self, layout: CacheLayout) -> None:
        self.layout = layout

    def admit(self, request: LlmRequest) -> None:
        return None

    def load_adapter(self, slot: int, adapter: LoraSpec) -> None:
        self.adapter_loads.append((slot, adapter.task_id))

    def execute(self, batch: ExecutionBatch) -> ExecutionResult:
        result = ExecutionResult(num_forwards=len(batch.forwards))
        rows: dict[int, list[WorkItem]] = {}
        for forward in batch.forwards:
            for item in forward:
                self._check_blocks(item)
                self.num_executed_tokens += len(item.token_ids)
                if not item.sample or item.kind is WorkKind.PADDING:
                    continue
                if item.request.beam_width > 1 and item.kind is not WorkKind.EMPTY_SLOT:
                    rows.setdefault(item.request.request_id, []).append(item)
                    continue
                if item.num_draft:
                    result.drafts[item.request.request_id] = self._verify(item)
                    continue
                result.sampled.append((item, self._token(item), None))
        for request_id, items in rows.items():
            result.beams[request_id] = self._beam_step(items)
        return result

    def final_outputs(self, request: LlmRequest) -> FinalOutputs:
        if request.beam_width > 1 and request.beam_tokens is not None:
            beams = [list(b) for b in request.beam_tokens]
            return FinalOutputs(beams=beams, beam_log_probs=[[0.0] * len(b) for b in beams])
        return FinalOutputs()

    def release(self, request: LlmRequest) -> None:
        return None

    def _verify(self, item: WorkItem) -> DraftOutcome:
        """Greedy verification against this executor's own tokens (what it would produce one a step)."""
        k = item.num_draft
        drafts = item.token_ids[len(item.token_ids) - k :]
        first = item.start_pos + len(item.token_ids) - k  # the position of the first token produced
        inputs = item.token_ids[len(item.token_ids) - k - 1 :]  # the input before each produced token
        targets = [self._token_at(item.request, first + i, 0, inputs[i]) for i in range(k + 1)]
        n = 0
        while n < k and drafts[n] == targets[n]:
            n += 1
        return DraftOutcome([*drafts[:n], targets[n]], k, n)

    def _token(self, item: WorkItem, beam: int = 0) -> int:
        return self._token_at(item.request, item.start_pos + len(item.token_ids), beam, item.token_ids[-1])

    def _token_at(self, req: LlmRequest, position: int, beam: int = 0, previous: int = 0) -> int:
        num_output = position - req.num_prompt_tokens
        if self.end_at.get(req.request_id) == num_output + 1 and req.sampling.end_id >= 0:
            return req.sampling.end_id
        vocab = self._limits.vocab_size
        token = fake_token(req.request_id, position, beam, vocab)
        if self.chain:
            token = 3 + (token + 7919 * previous) % (vocab - 3)
        return token

    def _beam_step(self, items: list[WorkItem]) -> BeamStep:
        """Beams never reorder here: beam i continues beam i (the first step fans the prompt out)."""
        req = items[0].request
        width = req.beam_width
        previous = req.beam_tokens or [[] for _ in range(width)]
        parents = [0] * width if len(items) == 1 else list(range(width))
        tokens = [[*previous[p], self._token(items[0], b)] for b, p in enumerate(parents)]
        done = len(tokens[0]) >= req.max_new_tokens
        return BeamStep(parents, tokens, done)

    def _check_blocks(self, item: WorkItem) -> None:
        assert self.layout is not None, "bind() the executor before executing"
        assert PENDING_TOKEN not in item.token_ids, (
            f"request {item.request.request_id}: a placeholder reached the executor unresolved"
        )
        bs = self.layout.tokens_per_block
        end = item.start_pos + len(item.token_ids)
        pools = self.layout.window_pools
        tables = [(item.block_ids, self.layout.num_blocks, None)]
        if pools:
            assert item.window_block_ids is not None, "windowed pools, but the item carries no tables"
            tables += [(item.window_block_ids[w], n, w) for w, n in pools.items()]
        for table, num_blocks, window in tables:
            for position in range(item.start_pos, end):
                index = position // bs
                if index >= len(table) or not 0 <= table[index] < num_blocks:
                    raise AssertionError(
                        f"request {item.request.request_id}: no KV block for position {position} "
                        f"(window {window}, table {table})"
                    )
            if window is not None:  # the keys the first query attends in its window must still be there
                first = max(0, item.start_pos - window + 1) // bs
                gone = [b for b in range(first, cdiv(end, bs)) if table[b] == NO_BLOCK]
                assert not gone, f"request {item.request.request_id}: window {window} lost blocks {gone}"
