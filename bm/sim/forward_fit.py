"""A local row, per model: the forward's cost measured on bm's own engine, fitted to the cost model's terms.

A datasheet roofline is the right model for a well-tuned engine at the datasheet's peaks, which bm is
not. On a CPU the model's small GEMMs reach far less than a micro-benchmark's peak and every layer pays
elementwise ops and Python per token that no FLOP count sees; on a GPU a decode step pays host time
(metadata, sampling, the token copy) and a forward that carries prompt tokens runs eagerly, paying a
launch per kernel, where a decode-only step replays a CUDA graph. So, as profiling simulators do (Vidur
profiles each operator at the model's own shapes), a local row times bm's real torch executor on the
simulated model (random weights, on the row's device) over a short synthetic run whose batches vary in
size and shape, and fits the seconds of one forward to the totals the roofline prices:

    seconds = per_forward + per_context_forward * eager + per_token * tokens + per_row * logit_rows
              + per_pair * pairs + per_key * keys

(``eager``: 1 for a forward that carries prompt tokens, which no decode graph serves; ``pairs``:
query-key pairs attended; ``keys``: KV history read; see :mod:`bm.sim.cost`) by non-negative least
squares. Which terms are fitted depends on the device:

- CPU (cpu-local): per_forward, per_token, per_row, per_pair. A decode's keys read are its pairs, so
  per_key stays 0, and no graph sets decode forwards apart (docs/sim.md has the measurements).
- CUDA (cuda-local): all six. A decode step reads its KV history from HBM, and prompt-carrying forwards
  cost a fixed eager overhead that graph-replayed decode steps do not.

The designed batches differ too (:func:`cpu_design`, :func:`cuda_design`). The fit is cached beside the
row under the model's shape and dtype, and redone by ``bm sim calibrate`` or when the model is new.
The engine's own per-iteration cost (scheduling, Python) stays the row's ``iteration_overhead_s``.
Nothing here is tuned to a benchmark's answer: the synthetic run shares no request with any workload,
and every coefficient is measured at run time.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import itertools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bm.sim.work import work_totals

TERMS = ("per_forward", "per_context_forward", "per_token", "per_row", "per_pair", "per_key")
CPU_TERMS = ("per_forward", "per_token", "per_row", "per_pair")


def model_key(shape_dict: dict[str, Any], dtype: str) -> str:
    """A stable name for a model's shape and dtype (what the fit depends on)."""
    text = json.dumps(shape_dict, sort_keys=True) + dtype
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fit_key(shape: Any, dtype: str, weights: Any = None) -> str:
    """:func:`model_key` of ``shape`` (a ModelShape) in ``dtype``, its linears held as ``weights`` (a
    quantized WeightFormat is part of the key; full width keeps the key fits were cached under before)."""
    shape_dict = shape.shape_dict()
    if weights is not None and weights.quantized:
        shape_dict = shape_dict | {"weights": dataclasses.asdict(weights)}
    return model_key(shape_dict, dtype)


@dataclass(frozen=True)
class Design:
    """The synthetic engine runs of a fit, the engine limits they run under, and which terms are fitted.

    ``runs``: each a list of (prompt tokens, output tokens) requests added at once; ``repeats``: passes
    over every run, each forward's time its best over the passes."""

    runs: list[list[tuple[int, int]]]
    terms: tuple[str, ...]
    max_batch_size: int
    max_num_tokens: int
    max_tokens: int
    repeats: int


def cpu_design() -> Design:
    """One long prompt at a time (many pairs per token), many short prompts (many tokens, few pairs),
    decode batches of 1 to 64 at short and long contexts (rows and pairs apart); sized for a CPU."""
    runs: list[list[tuple[int, int]]] = [[(prompt, 4)] for prompt in (64, 256, 1024)]
    runs += [[(128, 4)] * 8, [(32, 4)] * 64, [(512, 4)] * 24]
    return Design(runs, CPU_TERMS, max_batch_size=64, max_num_tokens=2048, max_tokens=1 << 16, repeats=3)


# Decode cells (requests, context) on a GPU: batch sizes against KV history read, at most ~131k KV tokens
# each, so a 1B model's prefill of them all takes seconds
CUDA_DECODE_CELLS = ((1, 128), (1, 2048), (8, 1024), (32, 256), (64, 2048), (128, 128), (256, 512))
CUDA_BUDGET = 8192


def cuda_design() -> Design:
    """Decode batches of 1 to 256 at contexts of 128 to 2048, and prompts up to the token budget.

    Every request of a decode cell arrives at once and its prompts are prefilled budget by budget
    (forwards that mix prompt chunks with the earlier requests' decodes); each request then decodes long
    enough that the whole cell decodes together for four steps, graph-replayed, before the earliest
    finish and the batch tapers: decode-only forwards of many sizes at one context. Prompt cells add
    forwards of one 8192-token prompt, two of 4096 and one of 512 (pairs against tokens)."""
    runs: list[list[tuple[int, int]]] = [[(512, 2)], [(8192, 2)], [(4096, 2)] * 2]
    for requests, context in CUDA_DECODE_CELLS:
        # the earlier requests' decodes share each step's budget with the prompt chunks
        prefill_steps = math.ceil(requests * context / (CUDA_BUDGET - requests))
        runs.append([(context, prefill_steps + 4)] * requests)
    # KV for a whole cell at once, each request rounded up to whole blocks (of up to 64 tokens)
    peak = max(sum((p + o) // 64 * 64 + 64 for p, o in run) for run in runs)
    return Design(runs, TERMS, max_batch_size=256, max_num_tokens=CUDA_BUDGET, max_tokens=peak, repeats=2)


def measure_forward_fit(model_config: Any, *, design: Design | None = None) -> dict[str, Any]:
    """Run bm's engine with its torch executor on ``model_config`` (a ``ModelConfig``, on its device)
    over ``design`` (default: the device's) and fit the design's terms.

    Returns ``{"terms": {name: seconds}, "fitted": [names], "samples": n, "r2": ..., "device": ...}``.
    """
    from bm.runtime import load_model

    loaded = load_model(model_config)
    device = loaded.device
    design = design or (cuda_design() if device.type == "cuda" else cpu_design())
    samples = time_design(loaded, model_config, design)
    del loaded
    if device.type == "cuda":  # the model, its KV cache and graphs are garbage now: give the memory back
        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return fit_samples(samples, design.terms) | {"device": str(device)}


def fit_samples(samples: list[tuple[list[float], float]], terms: tuple[str, ...]) -> dict[str, Any]:
    """The non-negative fit of ``terms`` (the rest 0) to timed forwards ``(totals in TERMS order,
    seconds)``; one set of samples can be fitted with several sets of terms (benchmarks/sim_fit_terms.py)."""
    import numpy as np

    columns = [TERMS.index(t) for t in terms]
    x = np.array([s[0] for s in samples], dtype=float)[:, columns]
    y = np.array([s[1] for s in samples], dtype=float)
    fitted = nnls(x, y)
    predicted = x @ fitted
    residual = float(((y - predicted) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum()) or 1.0
    return {
        "terms": dict.fromkeys(TERMS, 0.0) | {t: float(c) for t, c in zip(terms, fitted, strict=True)},
        "fitted": list(terms),
        "samples": len(samples),
        "r2": 1.0 - residual / total,
        "measured_seconds": float(y.sum()),
    }


def time_design(loaded: Any, model_config: Any, design: Design) -> list[tuple[list[float], float]]:
    """Every forward of the design's runs on ``loaded`` (a ``LoadedModel`` built from ``model_config``)
    as (totals in TERMS order, seconds): its best over the passes.

    One engine core serves every run and pass, so the KV cache is allocated and each CUDA graph captured
    once (in the first pass, which the best over passes then leaves out), and every forward is timed
    between two device synchronizations."""
    import torch

    from bm.engine.step.core import EngineCore
    from bm.runtime.executor import TorchExecutor

    device = loaded.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    inner = TorchExecutor(loaded)
    samples: list[tuple[list[float], float]] = []

    class Timed:
        """The torch executor, timed per execute and described by the cost model's totals."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def execute(self, batch: Any) -> Any:
            totals = [0.0] * len(TERMS)
            for forward in batch.forwards:
                t = work_totals(forward)
                for i, value in enumerate((1, t.eager, t.tokens, t.rows, t.pairs, t.history)):
                    totals[i] += value
            sync()
            started = time.perf_counter()
            result = inner.execute(batch)
            sync()  # execute copies sampled tokens to the host (a sync), unless nothing was sampled
            samples.append((totals, time.perf_counter() - started))
            return result

    core = EngineCore(design_config(design, model_config), Timed())  # type: ignore[arg-type]
    request_ids = itertools.count()
    passes: list[list[tuple[list[float], float]]] = []
    for attempt in range(design.repeats + 1):  # a short first pass warms torch up and is thrown away
        samples.clear()
        runs = design.runs if attempt else design.runs[:1]
        drive(core, runs, loaded.max_position_embeddings, request_ids)
        if attempt:
            passes.append(list(samples))
    # Every pass schedules the same batches (scheduling does not depend on time); each forward's time is
    # its best over the passes, seconds apart, as every local micro-benchmark takes its best: other
    # load on a shared machine only ever adds time, and a burst of it rarely spans all passes.
    return [(first[0], min(p[i][1] for p in passes)) for i, first in enumerate(passes[0])]


def design_config(design: Design, model_config: Any) -> Any:
    """The engine config a design runs under (a ``BmConfig``)."""
    from bm.config import BmConfig

    config = BmConfig()
    config.model = model_config
    config.engine.max_batch_size = design.max_batch_size
    config.engine.max_num_tokens = design.max_num_tokens
    config.engine.enable_chunked_context = True
    config.kv_cache.max_tokens = design.max_tokens
    config.kv_cache.enable_block_reuse = False  # every pass computes the same prompts again
    return config


def drive(
    core: Any, runs: list[list[tuple[int, int]]], longest: int | None, request_ids: Iterator[int]
) -> None:
    """Each run's requests added to ``core`` at once (ids from ``request_ids``: one core serves every
    run), then stepped until all finish; prompts cut to fit ``longest`` positions (the model's limit)."""
    from bm.engine.requests.request import Request

    vocab = core.executor.limits.vocab_size
    for run in runs:
        for i, (prompt, output) in enumerate(run):
            length = min(prompt, longest - output) if longest else prompt
            ids = [3 + (i * 131 + j * 7) % (vocab - 3) for j in range(length)]
            refused = core.add_request(Request(next(request_ids), ids, output))
            if refused is not None:
                raise RuntimeError(f"calibration request refused: {refused.error}")
        while core.num_active:
            core.step()


def nnls(x: Any, y: Any) -> Any:
    """Coefficients ``c >= 0`` (a cost cannot be negative) minimising the relative error of ``x @ c``
    against ``y``: Lawson and Hanson's active-set method on rows weighted by ``1 / y`` (a short forward
    matters as much as a long one: the error is per iteration) and columns scaled to unit norm (the
    totals span ten orders of magnitude, pairs against a 0/1 flag)."""
    import numpy as np

    w = 1.0 / np.maximum(y, 1e-9)
    a, b = x * w[:, None], y * w
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    coef = np.zeros(n)
    tol = 1e-10 * max(1.0, float(np.abs(a.T @ b).max()))

    def solve(mask: Any) -> Any:
        z = np.zeros(n)
        z[mask] = np.linalg.lstsq(a[:, mask], b, rcond=None)[0]
        return z

    for _ in range(3 * n):
        gradient = a.T @ (b - a @ coef)
        free = ~passive & (gradient > tol)
        if not free.any():
            break
        passive[np.argmax(np.where(free, gradient, -np.inf))] = True
        z = solve(passive)
        while (z[passive] <= 0).any():  # step back to the boundary, drop the terms that reach it
            blocked = passive & (z <= 0)
            gap = coef[blocked] - z[blocked]  # > 0 unless both are 0 (then that term just leaves)
            ratios = coef[blocked][gap > 0] / gap[gap > 0]
            step = float(ratios.min()) if ratios.size else 0.0
            coef = coef + step * (z - coef)
            passive &= coef > 1e-15
            z = solve(passive)
        coef = z
    return np.maximum(coef, 0.0) / scale
