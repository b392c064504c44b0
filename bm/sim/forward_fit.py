"""cpu-local, per model: the forward's cost measured on bm's own engine, fitted to the cost model's terms.

A datasheet roofline is the right model for an accelerator running tuned kernels. On this CPU the
model's small GEMMs reach far less than a micro-benchmark's peak, and every layer pays elementwise ops,
Python and attention bookkeeping per token that no FLOP count sees. So, as profiling simulators do
(Vidur profiles each operator at the model's own shapes), ``cpu-local`` times bm's real torch executor on
the simulated model (random weights) over a short synthetic run whose batches vary in size and shape,
and fits the seconds of one forward to the same totals the roofline prices:

    seconds = per_forward + per_token * tokens + per_row * logit_rows + per_pair * pairs + per_key * keys

(``pairs``: query-key pairs attended, ``keys``: KV history read; see :mod:`bm.sim.cost`) by non-negative
least squares. The fit is cached beside the cpu-local row under the model's shape, and redone by
``bm sim calibrate`` or when the model is new. The engine's own per-iteration cost (scheduling, Python)
stays the row's measured ``iteration_overhead_s``. Nothing here is tuned to a benchmark's answer: the
synthetic run shares no request with any workload, and every coefficient is measured at run time.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

TERMS = ("per_forward", "per_token", "per_row", "per_pair", "per_key")


def model_key(shape_dict: dict[str, Any], dtype: str) -> str:
    """A stable name for a model's shape and dtype (what the fit depends on)."""
    text = json.dumps(shape_dict, sort_keys=True) + dtype
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _calibration_requests(vocab: int) -> list[tuple[int, int, int]]:
    """(prompt tokens, output tokens, arrival group) of the synthetic run: long and short prompts and
    small and large decode batches, so every term of the fit varies independently."""
    rows = []
    for prompt, output, count in ((1024, 2, 1), (384, 8, 3), (96, 24, 12), (24, 32, 32), (8, 16, 4)):
        rows += [(prompt, output, 0)] * count
    return rows


def measure_forward_fit(model_config: Any, *, repeats: int = 1) -> dict[str, Any]:
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
    requests = _calibration_requests(vocab)
    for attempt in range(repeats + 1):  # a short first pass warms torch up and is thrown away
        samples.clear()
        core = EngineCore(config, Timed())  # type: ignore[arg-type]
        for i, (prompt, output, _group) in enumerate(requests if attempt else requests[::8]):
            ids = [3 + (i * 131 + j * 7) % (vocab - 3) for j in range(prompt)]
            refused = core.add_request(Request(i, ids, output))
            if refused is not None:
                raise RuntimeError(f"calibration request refused: {refused.error}")
        while core.num_active:
            core.step()
    x = np.array([s[0] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    coef = _nnls(x, y)
    predicted = x @ coef
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
