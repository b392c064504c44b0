"""Reference peers run on the same model and workload as bm, for honest same-process comparisons.

- ``hf-generate``: ``model.generate()`` over left-padded static batches, each run to its longest request
  (what a user without a batching engine does).
- ``hf-cb``: transformers' own continuous batching (``init_continuous_batching``), per-request
  ``max_new_tokens``.

Both ignore end tokens, like the benchmark's bm runs, so every request produces exactly its requested
length and output token counts are comparable. Each peer runs on its own copy of the model with
transformers' stock attention, so bm's attention takeover never leaks into them.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

_POLL_S = 0.1  # how often hf-cb's wait for results looks at ``stop``
_STALL_S = 600.0  # no result for this long: transformers' manager has stopped


@dataclass
class PeerResult:
    name: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    wall_s: float

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        tokens = self.num_prompt_tokens + self.num_output_tokens
        return tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "requests": self.num_requests,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tok_s": round(self.output_tok_s, 1),
            "total_tok_s": round(self.total_tok_s, 1),
        }


def stock_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with transformers' own attention and no end token."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ref.generation_config.eos_token_id = None
    return ref


@torch.inference_mode()
def run_hf_generate(
    model: torch.nn.Module,
    workload: Sequence[tuple[list[int], int]],
    batch_size: int = 16,
    pad_id: int = 0,
    stop: threading.Event | None = None,
) -> PeerResult:
    """Left-padded batches in workload order; each batch generates until its longest request is done.
    ``stop``: when set, no further batch starts (an interrupted comparison; the result is partial)."""
    ref = stock_copy(model)
    device = next(ref.parameters()).device
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        if stop is not None and stop.is_set():
            break
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(n for _, n in batch)
        ref.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=longest,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    return PeerResult("hf-generate", len(workload), *_token_counts(workload), time.perf_counter() - start)


@torch.inference_mode()
def run_hf_continuous_batching(
    model: torch.nn.Module, workload: Sequence[tuple[list[int], int]], stop: threading.Event | None = None
) -> PeerResult:
    """transformers' continuous batching manager with every request queued at once. ``stop``: when
    set, the wait for results ends (an interrupted comparison; the result is partial)."""
    ref = stock_copy(model)
    # it logs an ERROR line on every CPU run (no psutil) that says nothing about the results
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    config = GenerationConfig(
        max_new_tokens=max(n for _, n in workload), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    start = time.perf_counter()
    manager = ref.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        for i, (prompt, n) in enumerate(workload):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        done: set[str] = set()
        generated = 0
        waited = 0.0
        while len(done) < len(workload) and not (stop is not None and stop.is_set()):
            result = manager.get_result(timeout=_POLL_S)
            if result is None:
                waited += _POLL_S
                if waited < _STALL_S:
                    continue
                raise RuntimeError("transformers' continuous batching stopped before finishing the workload")
            waited = 0.0
            if result.is_finished() and result.request_id not in done:
                done.add(result.request_id)
                generated += len(result.generated_tokens)
    finally:
        manager.stop(block=True)
    elapsed = time.perf_counter() - start
    prompt_tokens, _ = _token_counts(workload)
    return PeerResult("hf-cb", len(workload), prompt_tokens, generated, elapsed)


def _token_counts(workload: Sequence[tuple[list[int], int]]) -> tuple[int, int]:
    return sum(len(p) for p, _ in workload), sum(n for _, n in workload)
