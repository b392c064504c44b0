"""The matmul roofline of a workload on this machine: FLOPs from the model config, peak measured now.

The peak is the best of a few large fp32 GEMMs with torch on the threads torch uses, measured in the same
run as the engine, because these machines differ by 2-3x and drift over minutes. FLOPs count the work a
dense decoder must do per token (every linear layer, the vocabulary projection for sampled positions
only, and attention scores and values over each token's context); elementwise work is not counted, so
the roofline is a floor no engine can beat.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Shortest of ``repeats`` timed calls of ``fn``, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_gemm_peak(size: int = 2048, repeats: int = 5) -> float:
    """Best observed FLOP/s of a ``size``-cubed fp32 matmul (after one warm-up)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    return 2 * size**3 / best_time(lambda: torch.mm(a, b), repeats)


def linear_params_per_token(config) -> int:
    """Weights every token multiplies through (attention projections and MLP, all layers)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = config.intermediate_size
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
    mlp = 3 * hidden * inter  # gate, up, down
    return config.num_hidden_layers * (attn + mlp)


def workload_flops(config, workload: Sequence[tuple[Sequence[int], int]]) -> float:
    """FLOPs to run every request (prompt, output length) to its end, each position computed once."""
    per_token = 2 * linear_params_per_token(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    vocab = 2 * config.hidden_size * config.vocab_size  # the LM head, for sampled positions only
    total = 0.0
    for prompt, out in workload:
        n = len(prompt) + out - 1  # positions that go through the model (the last token is never fed)
        total += n * per_token + out * vocab
        # scores and values: each position attends to every earlier one (and itself)
        total += 4 * layers * heads * head_dim * (n * (n + 1) / 2)
    return total
