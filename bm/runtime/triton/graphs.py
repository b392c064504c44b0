"""CUDA graphs for decode-only steps, one per batch-size bucket, over static input buffers.

A decode step of ``B`` requests runs as the smallest bucket ``>= B``: the static buffers (token ids,
positions, ``cu_seqlens``, sequence lengths, the int32 block table, slot mapping) are overwritten in
place, the rows past ``B`` padded (slot -1: nothing is stored; one key: finite garbage, never returned),
and the graph captured for that bucket is replayed. The kernels read every per-sequence value from
those buffers, and their grid depends only on the bucket, so one capture serves every later step. (A
bucket's split-KV choice is made for the static table's capacity, fixed at capture; how many splits
each sequence then uses, the kernel decides from the sequence's length: bm/runtime/triton/ops.py.)

Without CUDA (``model.cuda_graphs: on`` under Triton's interpreter) the same static buffers are used and
the model runs eagerly over them: that is what the CPU tests compare with the dynamic path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from bm.engine.execution.protocol import WorkItem
from bm.runtime.triton.batch import Inputs, PagedBatch, StagingBuffer, cdiv

if TYPE_CHECKING:
    from bm.runtime.backends.base import InputFill

log = logging.getLogger("bm")

# Decode batch sizes with a graph of their own; a larger decode step runs without a graph.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graphs_enabled(setting: str, device: torch.device) -> bool:
    """``auto``: on CUDA only; ``on``: also the static buffers alone where nothing can be captured."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def bucket_for(batch_size: int) -> int | None:
    return next((b for b in BUCKETS if b >= batch_size), None)


class DecodeGraphs:
    """The static buffers and the graph of each bucket, for one runner's Triton backend.

    ``run``: the model over a forward's inputs (the backend's, with its metadata current): logits of the
    kept rows in the model's dtype; ``pools``: the windows keeping blocks in a pool of their own."""

    def __init__(
        self,
        run: Callable[[Inputs], torch.Tensor],
        pools: list[int],
        device: torch.device,
        tokens_per_block: int,
        max_seq_len: int,
    ) -> None:
        self._run = run
        self.device = device
        self.capture = device.type == "cuda"
        self.tokens_per_block = tokens_per_block
        self.width = cdiv(max_seq_len, tokens_per_block)  # the block table's columns
        n = BUCKETS[-1]
        pools = [None, *pools]  # the main tables, then each pool's
        with torch.inference_mode():
            self._longs = torch.zeros(3, n, dtype=torch.long, device=device)  # ids, positions, kept rows
            self._longs[2] = torch.arange(n, device=device)
            self._cu = torch.arange(n + 1, dtype=torch.int32, device=device)
            self._lens = torch.ones(n, dtype=torch.int32, device=device)
            self._tables = torch.zeros(len(pools), n, self.width, dtype=torch.int32, device=device)
            self._slots = torch.full((len(pools), n), -1, dtype=torch.int32, device=device)
        self._pools = pools
        self._stage_longs = StagingBuffer(device, torch.long)
        self._stage_ints = StagingBuffer(device, torch.int32)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._pool_handle: Any = None
        self.failure: str | None = None  # why capturing was given up (the steps then run eagerly)

    def serves(self, items: Sequence[WorkItem]) -> bool:
        """A decode-only step that fits a bucket and the static block table."""
        return (
            bucket_for(len(items)) is not None
            and all(len(s.token_ids) == 1 and s.sample and not s.keep_all and not s.num_draft for s in items)
            and max(s.start_pos for s in items) < self.width * self.tokens_per_block
        )

    def run(self, items: Sequence[WorkItem], fill: InputFill | None = None) -> torch.Tensor:
        """Logits ``[len(items), vocab]`` of one decode step in the model's dtype: a view of the static
        output, valid until the next run (work queued on the stream before it reads it safely); ``fill``:
        input tokens still on the device, written into the static ids after the host's (a placeholder's
        row is overwritten)."""
        size = len(items)
        bucket = bucket_for(size)
        self._fill(items, bucket)
        if fill is not None:
            fill.apply(self._longs[0])
        if not self.capture or self.failure is not None:
            logits = self._forward(bucket)
        else:
            logits = self._replay(bucket)
        return logits[:size]

    def _fill(self, items: Sequence[WorkItem], bucket: int) -> None:
        """Write this step's inputs into the static buffers (one non-blocking copy per dtype)."""
        bs = self.tokens_per_block
        size = len(items)
        pad = bucket - size
        ids = [s.token_ids[0] for s in items]
        positions = [s.start_pos for s in items]
        used = max(positions) // bs + 1  # the widest row's blocks: cdiv(position + 1, bs)
        ints = [p + 1 for p in positions]
        ints += [1] * pad
        zeros = [0] * used
        # one list, extended in place (a 256-row step writes ~9,000 ints: the host's share of a decode
        # step that overlap cannot hide once the host is what sets the pace)
        for pool in self._pools:
            tables = (
                [s.block_ids for s in items] if pool is None else [s.window_block_ids[pool] for s in items]
            )
            for table, p in zip(tables, positions, strict=True):
                n = p // bs + 1
                ints += table[:n]
                if n < used:
                    ints += zeros[n:]
            ints += [0] * (pad * used)
            ints += [table[p // bs] * bs + p % bs for table, p in zip(tables, positions, strict=True)]
            ints += [-1] * pad
        longs = self._stage_longs.send([*ids, *[0] * pad, *positions, *[0] * pad])
        flat = self._stage_ints.send(ints)
        self._longs[:2, :bucket].copy_(longs.view(2, bucket))
        self._lens[:bucket].copy_(flat[:bucket])
        offset = bucket
        for i in range(len(self._pools)):
            self._tables[i, :bucket, :used].copy_(flat[offset : offset + bucket * used].view(bucket, used))
            offset += bucket * used
            self._slots[i, :bucket].copy_(flat[offset : offset + bucket])
            offset += bucket

    def _inputs(self, bucket: int) -> Inputs:
        batches = [
            PagedBatch(self._cu[: bucket + 1], self._lens[:bucket], self._tables[i, :bucket],
                       self._slots[i, :bucket], bucket, 1, self.width * self.tokens_per_block)
            for i in range(len(self._pools))
        ]  # fmt: skip
        longs = self._longs[:, :bucket]
        return Inputs(
            longs[0:1], longs[1:2], longs[2], batches[0], dict(zip(self._pools[1:], batches[1:], strict=True))
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        return self._run(self._inputs(bucket))

    def _replay(self, bucket: int) -> torch.Tensor:
        entry = self._graphs.get(bucket)
        if entry is None:
            try:
                entry = self._graphs[bucket] = self._capture(bucket)
            except RuntimeError as exc:  # run eagerly rather than fail the run
                self.failure = f"{type(exc).__name__}: {exc}"
                log.warning("bm: CUDA graph capture failed, decode steps run without graphs: %s", exc)
                return self._forward(bucket)
        graph, logits = entry
        graph.replay()
        return logits

    def _capture(self, bucket: int) -> tuple[Any, torch.Tensor]:
        """Warm up on a side stream (Triton compiles there), then capture one decode forward."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool_handle):
            logits = self._forward(bucket)
        return graph, logits
