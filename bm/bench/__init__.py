"""``bm bench``'s library side: the replay client, the benchmark runner and the metrics.

The CLI (``bm/cli/bench.py``) adds files and the terminal; a library user can call
:func:`run_benchmark` and :func:`summarize` directly.
"""

from bm.bench.metrics import engine_metrics, latency_stats, request_record, run_metrics
from bm.bench.replayer import Replayer, Timeline
from bm.bench.results import summarize
from bm.bench.runner import BenchRun, build_requests, run_benchmark

__all__ = [
    "BenchRun",
    "Replayer",
    "Timeline",
    "build_requests",
    "engine_metrics",
    "latency_stats",
    "request_record",
    "run_benchmark",
    "run_metrics",
    "summarize",
]
