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

On the CPU (``model.warmup: auto`` warms every device) the first steps paid for the C kernels that load
on first use (prefill attention: built on a machine's first run, loaded otherwise) and for each path's
first call, and above all for the thread count: the engine's first step computed on every thread
before the thread governor had read the machine's load once, which beside busy processes on a 2-core
machine made a 2,048-token first iteration 2-10x slower than the next (bm.runtime.threads; the executor
settles the count here, while the warm-up runs). The CPU leaves out the whole-budget prompt: on the
SmolLM2 shape under load (average 9-10) it made the warm-up 9.5-12.5 s longer, and the first
2,048-token step after it took the same CPU time (4.92 and 4.95 s with it, 4.87 and 4.93 s without);
it saved only the page faults of that step's activations, 30-60 ms of its system time.

The CPU's first run also paid for the KV pool's pages: the pool is mapped untouched
(bm.runtime.host_memory) and each page faults in, zeroed by the kernel, at its first write. Measured on
the reference workload's first 64 rows, the first run took 36,000 minor faults (15M model) and 161,000
(SmolLM2's shape) that the second run did not; the blocks a run uses are the lowest ids (bm.kv.block_pool
hands them out in ascending order), so where the pool's size was set for the run (``kv_cache.max_tokens``,
which ``bm bench``, ``bm compare`` and ``bm sweep`` set for their dataset) the warm-up writes its first
blocks, up to :data:`TOUCH_LIMIT_BYTES`. A pool sized from free memory alone (most of RAM on a CPU) is
left to be mapped as a run uses it.

The forwards write keys and values into blocks no request holds yet (every block is free while the
engine is being built), whose contents are never read: a request's attention reads only positions it
wrote itself. Nothing is registered in the prefix cache, which the KV manager alone owns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bm.engine.execution.protocol import WorkItem
from bm.kv import cdiv
from bm.runtime.model_runner import ModelRunner, work_item

MODES = ("auto", "on", "off")
# The most of a CPU KV pool the warm-up maps. The reference workload's first 64 rows size a 444 MB pool on the
# 15M model (all of it mapped) and 3.3 GB on SmolLM2's shape, whose run peaks near 630 MB (161k faults): the
# first 1 GiB covers it, at about half a second of start-up.
TOUCH_LIMIT_BYTES = 1 << 30


@dataclass
class WarmupReport:
    """What the warm-up ran, and how long it took (for the start-up line and results.json)."""

    seconds: float = 0.0
    graph_buckets: list[int] = field(default_factory=list)  # decode batch sizes run (captured on CUDA)
    forwards: list[tuple[int, int]] = field(default_factory=list)  # (sequences, tokens) run eagerly
    shapes: list[str] = field(default_factory=list)  # the shape class of each forward run, in order
    threads: int | None = None  # the CPU thread count the engine starts with (bm.runtime.threads)
    touched_bytes: int = 0  # KV pool bytes mapped before the first request (the CPU's pool)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "seconds": self.seconds,
            "graph_buckets": list(self.graph_buckets),
            "forwards": [list(s) for s in self.forwards],
            "shapes": list(self.shapes),
            "touched_bytes": self.touched_bytes,
        }
        return out if self.threads is None else out | {"threads": self.threads}


def warmup_enabled(mode: str, device: torch.device) -> bool:
    """``auto`` and ``on``: every device (see the module docstring for what the CPU's first steps paid)."""
    return mode != "off"


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


# The prompt-carrying shape classes, in the order they run (each a list of (tokens, cached prefix) per
# sequence; a sequence of one token after a prefix is a decode row beside the prompts).
PREFILL_CLASSES = ("prompt", "prompts", "chunk after a cached prefix", "prompts beside decode rows", "budget")
DECODE = "decode"


def prefill_shapes(
    max_batch_size: int, max_num_tokens: int, max_seq_len: int, whole_budget: bool = True
) -> list[tuple[str, list[tuple[int, int]]]]:
    """The prompt-carrying forwards to run, each named by its shape class (:data:`PREFILL_CLASSES`) and
    given as a list of (tokens, cached prefix) per sequence; a class that does not fit the budgets is
    left out, and so is the whole-budget prompt unless ``whole_budget``."""
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
    fitting = [[(n, max(0, p)) for n, p in f if n > 0 and n + max(0, p) <= max_seq_len] for f in forwards]
    if not whole_budget:
        fitting[-1] = []
    return [(name, f) for name, f in zip(PREFILL_CLASSES, fitting, strict=True) if f]


@torch.inference_mode()
def warm_up(
    runner: ModelRunner,
    max_batch_size: int,
    max_num_tokens: int,
    max_seq_len: int,
    touch_blocks: int = 0,
    before_each: Callable[[], Any] | None = None,
) -> WarmupReport:
    """Run the shape classes a run of these budgets meets (see the module docstring); returns the report.

    ``max_seq_len``: the longest sequence the cache holds (positions stay below it). ``touch_blocks``:
    the pool's lowest blocks to map first on a CPU (bm.engine.execution.protocol.WarmupShapes), at most
    :data:`TOUCH_LIMIT_BYTES`. ``before_each`` is called before every forward (the CPU's thread
    governor ticks there, bm.runtime.threads)."""
    started = time.perf_counter()
    report = WarmupReport()
    blocks = _Blocks(runner)

    def run(name: str, items: list[WorkItem]) -> None:
        if before_each is not None:
            before_each()
        runner.forward(items)
        report.shapes.append(name)

    # on the CPU the whole budget's forward costs seconds and buys nothing measurable (module docstring)
    whole = runner.device.type != "cpu"
    if (
        runner.device.type == "cpu" and touch_blocks
    ):  # the pool's lowest pages, mapped before the run writes them
        lowest = min(touch_blocks, runner.num_blocks, TOUCH_LIMIT_BYTES // max(1, runner.block_bytes))
        report.touched_bytes = runner.touch_blocks(lowest)
    for name, forward in prefill_shapes(max_batch_size, max_num_tokens, max_seq_len, whole):
        run(name, [blocks.item(n, p) for n, p in forward])
        report.forwards.append((len(forward), sum(n for n, _ in forward)))
    sizes = runner.backend.static_decode_sizes(max_batch_size)
    position = min(33, max_seq_len - 1)  # a context past a block boundary
    for size in sizes:  # decode steps over static buffers: each size run (captured on CUDA) once
        run(DECODE, [blocks.item(1, position) for _ in range(size)])
        report.graph_buckets.append(size)
    if not sizes:  # decode steps run eagerly: the decode tile's variants, one sequence and several
        for size in sorted({1, min(16, max_batch_size), min(17, max_batch_size)}):
            run(DECODE, [blocks.item(1, position) for _ in range(size)])
            report.forwards.append((size, size))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    report.seconds = time.perf_counter() - started
    return report
