"""Run a bm command with every engine iteration made slower by a known fraction: a planted regression.

    python benchmarks/planted_slowdown.py 0.3 compare DATASET --baseline PREV/compare.json ...

is ``bm compare ...`` with each engine step (and each fast-forwarded stretch of decode steps) followed by
a sleep of 0.3 x the time it just took, so the engine's wall time, and every throughput and latency
measured from it, is 1.3x what the same code measures (throughput 1/1.3, about 23% lower). The sleep
scales with the work rather than adding a constant, so the planted slowdown stays 30% on a fast or a
loaded machine, and it changes no decision: the scheduler, the KV cache and the tokens are untouched, so
the deterministic counters match the unslowed run exactly. It is how ``bm compare --baseline`` is shown to
catch a real 30% slowdown (``benchmarks/compare_gate.sh``); nothing in ``bm`` knows about it. The patch
lives in this process only: a paired gate's baseline worker (``--baseline-cmd``) is a process of its own
and runs unslowed, so the slowdown lands on one side of every pair, as a slower commit's would.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

from bm.engine.step.core import EngineCore


def _slowed(method: Callable[..., Any], factor: float, extra_s: float) -> Callable[..., Any]:
    @wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = method(*args, **kwargs)
        time.sleep(factor * (time.perf_counter() - started) + extra_s)
        return out

    return run


@contextmanager
def planted_slowdown(factor: float, extra_s: float = 0.0) -> Iterator[None]:
    """Within the block every :class:`EngineCore` step and fast-forward takes ``1 + factor`` times as
    long as it measured, plus ``extra_s`` seconds; the class is restored on leaving. ``extra_s`` is for
    tests on a few tiny requests, whose wall time is mostly outside the engine's steps."""
    if not factor >= 0 or not extra_s >= 0:
        raise ValueError(f"slowdown {factor} (+{extra_s} s): give values at least 0, e.g. 0.3 for 30% slower")
    saved = {name: getattr(EngineCore, name) for name in ("step", "fast_forward")}
    try:
        for name, method in saved.items():
            setattr(EngineCore, name, _slowed(method, factor, extra_s))
        yield
    finally:
        for name, method in saved.items():
            setattr(EngineCore, name, method)


def main(argv: list[str]) -> int:
    """``FRACTION BM-ARGS...``: run ``bm BM-ARGS`` with the slowdown planted; returns bm's exit code."""
    if len(argv) < 2:
        print(
            "usage: planted_slowdown.py FRACTION BM-COMMAND [ARGS...]  (e.g. 0.3 compare ...)",
            file=sys.stderr,
        )
        return 2
    from bm.cli.main import app

    with planted_slowdown(float(argv[0])):
        try:
            app(argv[1:], prog_name="bm")
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
