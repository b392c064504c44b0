"""What a run hands out while it runs: its per-iteration stats rows and its requests' records, streamed
so that a run killed part way leaves a trace, and so that a run's memory does not grow with its length.

A benchmark of thousands of requests on a GPU runs for minutes; killed (SIGKILL, a CI timeout, an
out-of-memory kill) it used to leave nothing, because ``stats.jsonl`` and ``requests.jsonl`` were only
written once the run ended. :func:`bm.bench.run_bench` now hands a :class:`BenchJournal` each
per-iteration stats row and each finished request's record as they come. It does so from the caller's
thread (the loop that waits on the replay, about ten times a second), never from the batch manager's
worker thread, so a slow disk can never stall an iteration. The journal decides what to do with them
(the CLI appends them to the files: :class:`bm.cli.journal.FileJournal`); the library touches no file.

The run itself keeps none of them: :class:`RunFeed` tallies each one (:mod:`bm.bench.tally`, a few
bytes per request and per iteration, from which the metrics are computed exactly) before it hands it on
and lets it go. The journal is the only place a run's records and stats rows go; a run without one
keeps its metrics and tallies only. The stream is in finishing order; ``FileJournal`` puts
``requests.jsonl`` in workload order when the run ends.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from bm.bench.metrics import request_record
from bm.bench.replayer import Replayer, Timeline
from bm.bench.tally import RequestTally, StatsTally
from bm.engine.requests.request import Request
from bm.workloads import Workload


class BenchJournal(Protocol):
    """Receives a run's output as it is produced, each item once, from the caller's thread.

    Warm-up requests and their iterations are never given: only what the run's results will hold."""

    def add_stats(self, rows: Sequence[dict[str, Any]]) -> None:
        """Per-iteration stats rows (seed field names), in iteration order."""

    def add_requests(self, records: Sequence[dict[str, Any]]) -> None:
        """Final records of requests (``requests.jsonl`` rows), in the order the requests finished;
        rows refused at load come first, at the start of the measured replay."""


class RunFeed:
    """Takes a measured replay's output as it comes, each item once, on the caller's thread: tallies it
    (:mod:`bm.bench.tally`, what the run's metrics are computed from) and hands it to the journal, if
    any, then lets it go, so the run's memory does not grow with its length.

    ``take_stats`` returns the stats rows that came since it was last called; finished requests are
    taken from the replayer's ``finished`` queue, which nothing else reads. ``watch``, if given, sees
    each finished request's timeline before its token times are let go (``bm sweep``'s early stop)."""

    def __init__(
        self,
        workload: Workload,
        built: Sequence[tuple[int, Request]],
        replayer: Replayer,
        take_stats: Callable[[], Sequence[dict[str, Any]]],
        journal: BenchJournal | None = None,
        watch: Callable[[Timeline], None] | None = None,
    ) -> None:
        self.journal = journal
        self._rows = workload.requests
        self._index_of = {request.request_id: index for index, request in built}
        self._replayer = replayer
        self._take_stats = take_stats
        self.watch = watch
        self.requests = RequestTally(len(self._rows))
        self.stats = StatsTally()
        runnable = set(self._index_of.values())
        self._refused = [
            request_record(i, row, None) for i, row in enumerate(self._rows) if i not in runnable
        ]

    def pump(self) -> None:
        """Tally, then give the journal, the stats rows and finished requests that came since the last
        call."""
        rows = self._take_stats()
        for row in rows:
            self.stats.add(row)
        records, self._refused = self._refused, []
        while True:
            try:
                timeline = self._replayer.finished.get_nowait()
            except queue.Empty:
                break
            if self.watch is not None:
                self.watch(timeline)
            index = self._index_of[timeline.request_id]
            records.append(request_record(index, self._rows[index], timeline))
            timeline.token_s = []  # its record holds what the metrics need of them
        for record in records:
            self.requests.add(record)
        if self.journal is not None:
            if rows:
                self.journal.add_stats(rows)
            if records:
                self.journal.add_requests(records)

    def finish(self) -> None:
        """The last :meth:`pump`, then a record for any request that has none yet (never, when every
        request ended through the replayer): every request ends with exactly one."""
        self.pump()
        timelines = self._replayer.timelines
        request_ids = {index: rid for rid, index in self._index_of.items()}
        missing = [
            request_record(i, row, timelines[request_ids[i]] if i in request_ids else None)
            for i, row in enumerate(self._rows)
            if not self.requests.given(i)
        ]
        for record in missing:
            self.requests.add(record)
        if missing and self.journal is not None:
            self.journal.add_requests(missing)
