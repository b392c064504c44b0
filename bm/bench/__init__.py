"""``bm bench``'s library side: the replay client, the benchmark runner, the metrics and the result files.

The CLI (``bm/cli/bench.py``) adds the terminal; ``bm compare`` calls :func:`run_bench` once per variant
on the same workload and arrival times::

    workload = load_workload(config.bench, vocab_size=model.vocab_size, encode=...)
    times = arrival_times(workload, config.bench)
    with FileJournal(out_dir) as journal:  # bm.cli.journal: requests.jsonl, stats.jsonl
        result = run_bench(config, model, workload, times, journal=journal)  # metrics and tallies
    write_results(out_dir, result)  # results.json

``run_bench(..., journal=...)`` hands a :class:`BenchJournal` the stats rows and records as they come
(the CLI streams them to the files, so a killed run leaves its trace); the run keeps only their tallies
(:mod:`bm.bench.tally`), so its memory does not grow with its length.
"""

from bm.bench.journal import BenchJournal
from bm.bench.metrics import engine_metrics, latency_stats, request_record, run_metrics
from bm.bench.replayer import Replayer, Timeline
from bm.bench.results import results_document, write_results
from bm.bench.runner import BenchResult, ReplayProgress, build_requests, records_frame, run_bench

__all__ = [
    "BenchJournal",
    "BenchResult",
    "ReplayProgress",
    "Replayer",
    "Timeline",
    "build_requests",
    "engine_metrics",
    "latency_stats",
    "records_frame",
    "request_record",
    "results_document",
    "run_bench",
    "run_metrics",
    "write_results",
]
