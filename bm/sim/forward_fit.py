"""cpu-local, per model: the forward's cost measured on bm's own engine, fitted to the cost model's terms.

A datasheet roofline is the right model for an accelerator running tuned kernels. On this CPU the
model's small GEMMs reach far less than a micro-benchmark's peak, and every layer pays elementwise ops,
Python and attention bookkeeping per token that no FLOP count sees. So, as profiling simulators do
(Vidur profiles each operator at the model's own shapes), ``cpu-local`` times bm's real torch executor on
the simulated model (random weights) over a short synthetic run whose batches vary in size and shape,
and fits the seconds of one forward to the same totals the roofline prices:

    seconds = per_forward + per_token * tokens + per_row * logit_rows + per_pair * pairs

(``pairs``: query-key pairs attended, see :mod:`bm.sim.cost`; a decode's KV reads are its pairs, so
``per_key`` stays 0 here) by non-negative least squares on designed batches (one long prompt, many
short ones, decode batches of 1 to 64 at short and long contexts), each forward's time the best of three passes.
The fit is cached beside the cpu-local row under the model's shape, and redone by ``bm sim calibrate``
or when the model is new. The engine's own per-iteration cost (scheduling, Python)
stays the row's measured ``iteration_overhead_s``. Nothing here is tuned to a benchmark's answer: the
synthetic run shares no request with any workload, and every coefficient is measured at run time.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

TERMS = ("per_forward", "per_token", "per_row", "per_pair", "per_key")
# the terms fitted (a decode's keys read are its pairs, so per_key is left at 0 on this machine)
FITTED = 4


def model_key(shape_dict: dict[str, Any], dtype: str) -> str:
    """A stable name for a model's shape and dtype (what the fit depends on)."""
    text = json.dumps(shape_dict, sort_keys=True) + dtype
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _calibration_runs() -> list[list[tuple[int, int]]]:
    """Engine runs of (prompt tokens, output tokens) requests, all at once: each gives a prefill forward
    and decode forwards of a designed shape, so the terms vary apart (one long prompt: many pairs per
    token; many short prompts: many tokens, few pairs; decode batches of 1 to 64 at short and long
    contexts: rows and pairs apart)."""
    runs: list[list[tuple[int, int]]] = [[(prompt, 4)] for prompt in (64, 256, 1024)]
    runs += [[(128, 4)] * 8, [(32, 4)] * 64, [(512, 4)] * 24]
    return runs


def measure_forward_fit(model_config: Any, *, repeats: int = 3) -> dict[str, Any]:
    """Run bm's engine with its torch executor on ``model_config`` (a ``ModelConfig``) and fit the terms.

    Returns ``{"terms": {name: seconds}, "samples": n, "r2": ...}``.
    """
    import numpy as np

    from bm.config import BmConfig
    from bm.engine.core import EngineCore
    from bm.engine.request import Request
    from bm.runtime import load_model
    from bm.runtime.executor import TorchExecutor

    loaded = load_model(model_config)
    inner = TorchExecutor(loaded)
    samples: list[tuple[list[float], float]] = []

    class Timed:
        """The torch executor, timed per execute and described by the cost model's totals."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def execute(self, batch: Any) -> Any:
            totals = [0.0] * len(TERMS)
            for forward in batch.forwards:
                totals[0] += 1
                for item in forward:
                    n, p = len(item.token_ids), item.start_pos
                    totals[1] += n
                    totals[2] += 1 if item.sample else 0
                    totals[3] += n * p + n * (n + 1) // 2
                    totals[4] += p + n
            started = time.perf_counter()
            result = inner.execute(batch)
            samples.append((totals, time.perf_counter() - started))
            return result

    config = BmConfig()
    config.model = model_config
    config.engine.max_batch_size = 64
    config.engine.max_num_tokens = 2048
    config.engine.enable_chunked_context = True
    config.kv_cache.max_tokens = 1 << 16
    vocab = loaded.vocab_size
    runs = _calibration_runs()
    passes: list[list[tuple[list[float], float]]] = []
    for attempt in range(repeats + 1):  # a short first pass warms torch up and is thrown away
        samples.clear()
        for run in runs if attempt else runs[:1]:
            core = EngineCore(config, Timed())  # type: ignore[arg-type]
            for i, (prompt, output) in enumerate(run):
                ids = [3 + (i * 131 + j * 7) % (vocab - 3) for j in range(prompt)]
                refused = core.add_request(Request(i, ids, output))
                if refused is not None:
                    raise RuntimeError(f"calibration request refused: {refused.error}")
            while core.num_active:
                core.step()
        if attempt:
            passes.append(list(samples))
    # Every pass schedules the same batches (scheduling does not depend on time); each forward's time is
    # its best over the passes, seconds apart, as every cpu-local micro-benchmark takes its best: other
    # load on a shared machine only ever adds time, and a burst of it rarely spans all passes.
    samples = [(first[0], min(p[i][1] for p in passes)) for i, first in enumerate(passes[0])]
    x = np.array([s[0][:FITTED] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    coef = list(_nnls(x, y)) + [0.0] * (len(TERMS) - FITTED)
    predicted = x @ np.array(coef[:FITTED])
    residual = float(((y - predicted) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum()) or 1.0
    return {
        "terms": dict(zip(TERMS, (float(c) for c in coef), strict=True)),
        "samples": len(samples),
        "r2": 1.0 - residual / total,
        "measured_seconds": float(y.sum()),
    }


def _nnls(x: Any, y: Any) -> Any:
    """Least squares with every coefficient >= 0 (a cost cannot be negative): drop the most negative
    term and refit until none is (enough for five terms)."""
    import numpy as np

    active = list(range(x.shape[1]))
    while True:
        # relative weights: short forwards matter as much as long ones (per-iteration error)
        w = 1.0 / np.maximum(y, 1e-6)
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            coef = np.zeros(x.shape[1])
            coef[active] = np.maximum(sol, 0)
            return coef
        del active[int(np.argmin(sol))]
