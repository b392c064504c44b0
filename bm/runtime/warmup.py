"""Start-up work done before the clock: every shape class a run will meet, run once at engine build.

On a GPU the first steps of a run pay for work that has nothing to do with its requests: Triton compiles
a kernel variant the first time it meets a new specialisation (a prefill tile instead of a decode one, an
integer argument of 1 or a multiple of 16: about half a second each; the attention kernel's sequence
count and block-table width, which change with every mix, are not specialised), a CUDA graph is
captured the first time a decode step's batch lands in a new bucket, and cuBLAS and the caching
allocator settle. Measured on an H100, gpu_check's first run in a process was 2.7x slower than its
second. Here the engine does that work once, when it is built: a decode step at every CUDA-graph bucket
up to ``max_batch_size`` (each captured), and prefill-carrying forwards of the token counts and
sequence counts that pick the kernels' variants (one token, a multiple of 16, neither; one sequence or
several; a chunk after a cached prefix; prompts beside decode rows; the full token budget). vLLM and
TensorRT-LLM capture their graphs at start-up too.

The forwards write keys and values into blocks no request holds yet (every block is free while the
engine is being built), whose contents are never read: a request's attention reads only positions it
wrote itself. Nothing is registered in the prefix cache, which the KV manager alone owns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bm.engine.executor import WorkItem
from bm.kv import cdiv
from bm.runtime.model_runner import ModelRunner, work_item

MODES = ("auto", "on", "off")


@dataclass
class WarmupReport:
    """What the warm-up ran, and how long it took (for the start-up line and results.json)."""

    seconds: float = 0.0
    graph_buckets: list[int] = field(default_factory=list)  # decode batch sizes run (captured on CUDA)
    forwards: list[tuple[int, int]] = field(default_factory=list)  # (sequences, tokens) run eagerly

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "graph_buckets": list(self.graph_buckets),
            "forwards": [list(s) for s in self.forwards],
        }


def warmup_enabled(mode: str, device: torch.device) -> bool:
    """``auto``: on CUDA, where compiles and graph captures would otherwise land in the first steps;
    on the CPU nothing is compiled per shape (bm's C kernels are built when the model loads)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class _Blocks:
    """Hands out block tables over the free pool, wrapping around: a warm-up forward's sequences each
    get blocks of their own while the pool lasts (and share them past that, which is harmless here)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.num_blocks = runner.num_blocks
        self.tokens_per_block = runner.tokens_per_block
        self.pools = dict(runner.window_pools)
        self._next = 0

    def item(self, num_tokens: int, start: int, sample: bool = True) -> WorkItem:
        blocks = cdiv(start + num_tokens, self.tokens_per_block)
        ids = [(self._next + i) % self.num_blocks for i in range(blocks)]
        self._next = (self._next + blocks) % self.num_blocks
        pooled = {w: [b % size for b in ids] for w, size in self.pools.items()} or None
        # token 1: any id inside every vocabulary; the values computed are never read
        return work_item([1] * num_tokens, start, ids, sample, window_block_ids=pooled)


def prefill_shapes(max_batch_size: int, max_num_tokens: int, max_seq_len: int) -> list[list[tuple[int, int]]]:
    """The prompt-carrying forwards to run, each a list of (tokens, cached prefix) per sequence; a
    sequence of one token with a prefix is a decode row beside the prompts."""
    budget = max(1, min(max_num_tokens, max_seq_len))
    seqs = max(2, min(max_batch_size, 8))
    forwards = [
        [(min(17, budget), 0)],  # one sequence, a token count neither 1 nor a multiple of 16
        [(min(16, budget), 0)] * 2,  # several sequences, multiples of 16
        [(min(16, budget), min(16, max_seq_len - 16))],  # a chunk after a cached prefix
        # prompts beside decode rows (chunked context's usual iteration)
        [(min(24, budget), 0)] + [(1, min(40, max_seq_len - 1))] * (seqs - 1),
        [(budget, 0)],  # the whole budget in one prompt: the largest activations a run allocates
    ]
    return [[(n, max(0, p)) for n, p in f if n > 0 and n + max(0, p) <= max_seq_len] for f in forwards]


@torch.inference_mode()
def warm_up(runner: ModelRunner, max_batch_size: int, max_num_tokens: int, max_seq_len: int) -> WarmupReport:
    """Run the shape classes a run of these budgets meets (see the module docstring); returns the report.

    ``max_seq_len``: the longest sequence the cache holds (positions stay below it)."""
    started = time.perf_counter()
    report = WarmupReport()
    blocks = _Blocks(runner)
    for forward in prefill_shapes(max_batch_size, max_num_tokens, max_seq_len):
        if not forward:
            continue
        runner.forward([blocks.item(n, p) for n, p in forward])
        report.forwards.append((len(forward), sum(n for n, _ in forward)))
    sizes = runner.backend.static_decode_sizes(max_batch_size)
    position = min(33, max_seq_len - 1)  # a context past a block boundary
    for size in sizes:  # decode steps over static buffers: each size run (captured on CUDA) once
        runner.forward([blocks.item(1, position) for _ in range(size)])
        report.graph_buckets.append(size)
    if not sizes:  # decode steps run eagerly: the decode tile's variants, one sequence and several
        for size in sorted({1, min(16, max_batch_size), min(17, max_batch_size)}):
            runner.forward([blocks.item(1, position) for _ in range(size)])
            report.forwards.append((size, size))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    report.seconds = time.perf_counter() - started
    return report
