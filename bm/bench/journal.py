"""What a run hands out while it runs, so that a run killed part way leaves a trace of what it did.

A benchmark of thousands of requests on a GPU runs for minutes; killed (SIGKILL, a CI timeout, an
out-of-memory kill) it used to leave nothing, because ``stats.jsonl`` and ``requests.jsonl`` were only
written once the run ended. :func:`bm.bench.run_bench` now hands a :class:`BenchJournal` each
per-iteration stats row and each finished request's record as they come. It does so from the caller's
thread (the loop that waits on the replay, about ten times a second), never from the batch manager's
worker thread, so a slow disk can never stall an iteration. The journal decides what to do with them
(the CLI appends them to the files: :class:`bm.cli.journal.FileJournal`); the library touches no file.

A streamed record is built by the same :func:`~bm.bench.metrics.request_record` as the run's final
records, from the same timeline, so it equals the final one; the stream is in finishing order, the
final files in workload order.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from bm.bench.metrics import request_record
from bm.bench.replayer import Replayer
from bm.engine.request import Request
from bm.workloads import Workload


class BenchJournal(Protocol):
    """Receives a run's output as it is produced, each item once, from the caller's thread.

    Warm-up requests and their iterations are never given: only what the run's results will hold."""

    def add_stats(self, rows: Sequence[dict[str, Any]]) -> None:
        """Per-iteration stats rows (seed field names), in iteration order."""

    def add_requests(self, records: Sequence[dict[str, Any]]) -> None:
        """Final records of requests (``requests.jsonl`` rows), in the order the requests finished;
        rows refused at load come first, at the start of the measured replay."""


class JournalFeed:
    """Hands a :class:`BenchJournal` what it has not been given yet, each time :meth:`pump` is called.

    ``stats`` returns the run's stats rows so far (a list that only grows); finished requests are taken
    from the replayer's ``finished`` queue, which nothing else reads while a feed is attached."""

    def __init__(
        self,
        journal: BenchJournal,
        workload: Workload,
        built: Sequence[tuple[int, Request]],
        replayer: Replayer,
        stats: Callable[[], Sequence[dict[str, Any]]],
    ) -> None:
        self.journal = journal
        self._rows = workload.requests
        self._index_of = {request.request_id: index for index, request in built}
        self._replayer = replayer
        self._stats = stats
        self._num_stats = 0
        runnable = set(self._index_of.values())
        # every record given, by workload index: the run's results reuse them rather than build each twice
        self.records: dict[int, dict[str, Any]] = {
            i: request_record(i, row, None) for i, row in enumerate(self._rows) if i not in runnable
        }
        self._refused = list(self.records.values())

    def pump(self) -> None:
        """Give the journal the stats rows and finished requests that arrived since the last call."""
        rows = list(self._stats()[self._num_stats :])
        self._num_stats += len(rows)
        records, self._refused = self._refused, []
        while True:
            try:
                timeline = self._replayer.finished.get_nowait()
            except queue.Empty:
                break
            index = self._index_of[timeline.request_id]
            self.records[index] = request_record(index, self._rows[index], timeline)
            records.append(self.records[index])
        if rows:
            self.journal.add_stats(rows)
        if records:
            self.journal.add_requests(records)
