"""A roofline cost model of one engine iteration: how long the scheduled :class:`ExecutionBatch` takes.

Per forward, each operator group costs ``max(compute time, memory time)`` (it is bound by whichever is
slower), groups add up, then tensor-parallel communication and fixed overheads are added:

- linear (GEMMs): ``2 * tokens * weights`` FLOPs; reads every weight once per forward (in the bytes of
  ``model.quantization``'s format: bm.sim.model.WeightFormat), plus the activations in and out;
- LM head: only the rows that sample (or keep logits) are projected to the vocabulary;
- attention: ``4 * heads * head_dim`` FLOPs per (query, key) pair, summed from each item's context
  length (causal within the item); reads each item's KV history once (a fused, flash-style kernel);
- KV write: the new tokens' K and V;
- communication: two all-reduces of the hidden states per layer under tensor parallelism (ring:
  ``2 (tp - 1) / tp`` of the bytes over one direction of the link), not overlapped.

The row's ``iteration_overhead_s`` is the host's share of an iteration (scheduling, the step's
metadata, launches). In order it adds to the forwards; under overlap scheduling (``overlap``: the
engine's ``engine.overlap_scheduler`` as it resolves on the row's device, so ``auto`` on a GPU row) the
host prepares the next iteration while the device runs this one, and an iteration costs whichever is
longer.

Work is divided evenly over the tensor-parallel ranks. The model knows nothing of time; the hardware
row gives peak rates, derating efficiencies and overheads. On a local row (cpu-local, cuda-local) a
forward's seconds come instead from the terms fitted on bm's own engine there (:mod:`bm.sim.forward_fit`),
applied to the same totals, plus whether the forward runs eagerly (no decode CUDA graph serves it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bm.engine.execution.protocol import ExecutionBatch, WorkItem
from bm.sim.hardware import Hardware
from bm.sim.model import DTYPE_BYTES, FULL_WIDTH, ModelShape, WeightFormat
from bm.sim.work import work_totals


@dataclass
class ForwardCost:
    """Totals of one forward, over all ranks (before dividing by the tensor-parallel degree)."""

    tokens: int = 0
    logit_rows: int = 0
    eager: bool = False  # runs without a decode graph (a local GPU row's fit prices it apart)
    linear_flops: float = 0.0
    linear_bytes: float = 0.0
    attention_flops: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    allreduce_bytes: float = 0.0  # per rank, summed over the forward's all-reduces


@dataclass
class IterationCost:
    forwards: list[ForwardCost] = field(default_factory=list)
    seconds: float = 0.0
    compute_s: float = 0.0  # sum of the compute-side times of every group (for reports)
    memory_s: float = 0.0
    comm_s: float = 0.0
    overhead_s: float = 0.0


class CostModel:
    """Times batches of ``model`` in ``dtype`` on ``tensor_parallel`` devices of ``hardware``."""

    def __init__(
        self,
        model: ModelShape,
        hardware: Hardware,
        dtype: str = "bfloat16",
        tensor_parallel: int = 1,
        decode_graphs: bool = True,
        overlap: bool = False,
        kv_cache_dtype: str = "auto",
        weights: WeightFormat = FULL_WIDTH,
    ):
        """``decode_graphs``: the engine replays CUDA graphs for decode-only steps (``model.cuda_graphs``
        not off); it matters only on a row measured with graphs (cuda-local), whose decode steps larger
        than its largest graph, or all of them without graphs, are then priced as eager forwards.
        ``overlap``: the host's per-iteration time hides behind the device's (see the module's doc).
        ``kv_cache_dtype``: ``kv_cache.dtype`` (int8 and fp8_e4m3: about a quarter of the KV bytes of float32, read and
        held). ``weights``: how the decoder's linears are held (``model.quantization``): their bytes, read
        once per forward and held, are the format's; their FLOPs are the same products."""
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        self.model = model
        self.hardware = hardware
        self.dtype = dtype
        self.tp = tensor_parallel
        self.overlap = overlap
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.peak_flops = hardware.peak_flops(dtype) * hardware.compute_efficiency
        self.bandwidth = hardware.memory_bw * hardware.memory_efficiency
        self.kv_bytes_per_token = model.kv_bytes_per_token(self.dtype_bytes, kv_cache_dtype)
        m = model
        self.weights = weights
        self._linear_weights = m.num_layers * m.layer_linear_params
        self._linear_weight_bytes = weights.linear_bytes(m, self.dtype_bytes)
        # per token: attention FLOPs per key, summed over layers
        self._attn_flops_per_pair = 4.0 * m.num_heads * m.head_dim * m.num_layers
        self._hidden_bytes = m.hidden_size * self.dtype_bytes
        # a local row: a forward's seconds fitted on bm's real engine for this model, when measured
        self.fit: dict[str, float] | None = hardware.forward_fit(model, dtype, weights)
        graph_max = hardware.extra.get("graph_max_batch_size")
        # decode steps of more rows than this run eagerly (0: every one does; None: the row has no graphs)
        self._graph_max: int | None = None if graph_max is None else (int(graph_max) if decode_graphs else 0)

    # -- accounting -----------------------------------------------------------------------------------

    def forward_cost(self, items: list[WorkItem]) -> ForwardCost:
        t = work_totals(items)
        return self.cost_of(
            t.tokens, t.rows, t.pairs, t.history, t.eager or self._too_many_for_graphs(len(items))
        )

    def _too_many_for_graphs(self, num_items: int) -> bool:
        """A decode step of ``num_items`` rows runs eagerly on the row's device (no graph of its size)."""
        return self._graph_max is not None and num_items > self._graph_max

    def cost_of(self, tokens: int, rows: int, pairs: int, history: int, eager: bool = False) -> ForwardCost:
        """A forward's cost from its totals: tokens computed, logit rows, (query, key) pairs attended, KV
        history read, and whether it runs eagerly. The totals are all the model needs, so a decode run
        can be priced without building its work items."""
        m, b = self.model, self.dtype_bytes
        cost = ForwardCost()
        cost.tokens, cost.logit_rows, cost.eager = tokens, rows, eager
        cost.linear_flops = 2.0 * tokens * self._linear_weights + 2.0 * rows * m.lm_head_params
        activations = tokens * (4 * m.hidden_size + 2 * m.intermediate_size) * m.num_layers * b
        cost.linear_bytes = self._linear_weight_bytes + (m.lm_head_params if rows else 0) * b + activations
        cost.attention_flops = self._attn_flops_per_pair * pairs
        cost.kv_read_bytes = float(history * self.kv_bytes_per_token)
        cost.kv_write_bytes = float(tokens * self.kv_bytes_per_token)
        if self.tp > 1:
            per_allreduce = tokens * self._hidden_bytes
            cost.allreduce_bytes = 2 * m.num_layers * per_allreduce * 2 * (self.tp - 1) / self.tp
        return cost

    def time_forward(self, cost: ForwardCost, out: IterationCost) -> float:
        if self.fit is not None:  # measured on bm's own engine (a local row, bm.sim.forward_fit)
            f = self.fit
            seconds = (
                f["per_forward"]
                + f["per_context_forward"] * cost.eager
                + f["per_token"] * cost.tokens
                + f["per_row"] * cost.logit_rows
                + f["per_pair"] * cost.attention_flops / self._attn_flops_per_pair
                + f["per_key"] * cost.kv_read_bytes / self.kv_bytes_per_token
            )
            out.compute_s += seconds
            return seconds
        tp, flops, bw = self.tp, self.peak_flops, self.bandwidth
        hw = self.hardware
        ramp = cost.tokens / (cost.tokens + hw.gemm_half_tokens) if cost.tokens else 1.0
        linear_c, linear_m = cost.linear_flops / tp / (flops * ramp), cost.linear_bytes / tp / bw
        attn_c, attn_m = cost.attention_flops / tp / flops, cost.kv_read_bytes / tp / bw
        write_m = cost.kv_write_bytes / tp / bw
        comm = 0.0
        if tp > 1:
            comm = (
                cost.allreduce_bytes / (hw.interconnect_bw / 2)
                + 2 * self.model.num_layers * hw.allreduce_latency_s
            )
        overhead = hw.layer_overhead_s * self.model.num_layers
        out.compute_s += linear_c + attn_c
        out.memory_s += linear_m + attn_m + write_m
        out.comm_s += comm
        out.overhead_s += overhead
        return max(linear_c, linear_m) + max(attn_c, attn_m) + write_m + comm + overhead

    def iteration(self, batch: ExecutionBatch) -> IterationCost:
        """The cost of one iteration: its forwards one after another, plus the fixed per-iteration cost."""
        out = IterationCost()
        total = 0.0
        for forward in batch.forwards:
            cost = self.forward_cost(forward)
            out.forwards.append(cost)
            total += self.time_forward(cost, out)
        if batch.forwards:
            out.overhead_s += self.hardware.iteration_overhead_s
            total = self._with_host(total)
        out.seconds = total
        return out

    def _with_host(self, device_s: float) -> float:
        """An iteration's seconds from its forwards' and the host's: in turn, or overlapped."""
        host_s = self.hardware.iteration_overhead_s
        return max(device_s, host_s) if self.overlap else device_s + host_s

    def decode_seconds(self, num_requests: int, sum_positions: int) -> float:
        """:meth:`iteration`'s seconds for one forward of ``num_requests`` generation items (one token
        each, sampled) whose positions add up to ``sum_positions``: the same arithmetic, no items."""
        pairs = sum_positions + num_requests
        cost = self.cost_of(num_requests, num_requests, pairs, pairs, self._too_many_for_graphs(num_requests))
        return self._with_host(self.time_forward(cost, IterationCost()))

    def weight_bytes_per_rank(self) -> float:
        rest = self.model.num_params - self._linear_weights  # the head and embeddings, full width
        return (self._linear_weight_bytes + rest * self.dtype_bytes) / self.tp
