"""``stats.jsonl`` and ``requests.jsonl`` written as a benchmark runs, so a killed run leaves its trace.

A user's first realistic ``bm bench`` on a GPU was killed after 170 s and its output directory held
nothing. :class:`FileJournal` is the :class:`~bm.bench.journal.BenchJournal` of ``bm bench`` and
``bm compare``: it appends each stats row and each finished request's record as the run hands them over
(from the caller's thread, about ten times a second) straight to the operating system, one write per
batch, so even SIGKILL loses at most the last fraction of a second. The run keeps none of these lines:
the files are the only copy. When the run ends, :meth:`FileJournal.finish` puts ``requests.jsonl`` in
workload order (every request once) by reading each line back where it was written, so a finished
run's files are as they always were; ``stats.jsonl`` is complete as streamed.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from bm.bench.results import request_line, stats_line
from bm.files import append_whole, replacing
from bm.workloads.request import Row


def named_error(error: Any, row: Row) -> Any:
    """``error`` prefixed with the row it came from ("line 12: ..."): the engine only knows request ids,
    the CLI knows which line of the dataset each one was. Anything but a new message is left as it is."""
    if not isinstance(error, str) or not error or error.startswith(f"{row.where}:"):
        return error
    return f"{row.where}: {error}"


class FileJournal:
    """Appends a run's stats rows to ``OUT/stats.jsonl`` and its finished requests' records to
    ``OUT/requests.jsonl``. A file is created (empty or not, it replaces what is there) only when its
    first line comes, so a run that stops before it starts leaves nothing new behind. Leaving the
    ``with`` block normally finishes the files (:meth:`finish`); an exception leaves them as streamed.

    ``rows``: the workload's rows, to name engine errors by their line as ``bm bench``'s final records
    do (:func:`named_error`); None writes records as they come (``bm compare``'s variant files).

    It keeps 24 bytes per record written (its index, where its line starts, its length), to put the
    file in workload order at the end without holding a line."""

    def __init__(self, out_dir: Path, rows: Sequence[Row] | None = None) -> None:
        self.out_dir = out_dir
        self._rows = rows
        self._files: dict[str, BinaryIO] = {}
        self._ends: dict[str, int] = {}  # where each file's whole lines end
        self.num_stats = 0  # rows written to stats.jsonl
        self._index = array("q")  # per line of requests.jsonl, in the order written
        self._start = array("q")
        self._length = array("q")
        self._size = 0  # bytes written to requests.jsonl

    def add_stats(self, rows: Sequence[dict[str, Any]]) -> None:
        self._append("stats.jsonl", "".join(stats_line(row) for row in rows).encode("utf-8"))
        self.num_stats += len(rows)

    def add_requests(self, records: Sequence[dict[str, Any]]) -> None:
        if self._rows is not None:
            rows = self._rows
            records = [{**r, "error": named_error(r["error"], rows[r["index"]])} for r in records]
        lines = [request_line(record).encode("utf-8") for record in records]
        self._append("requests.jsonl", b"".join(lines))
        for record, line in zip(records, lines, strict=True):
            self._index.append(record["index"])
            self._start.append(self._size)
            self._length.append(len(line))
            self._size += len(line)

    def finish(self) -> None:
        """The run ended: ``requests.jsonl`` rewritten in workload order (each record's index; written
        whole beside it, then renamed over the stream, so a kill leaves one or the other), and an empty
        ``stats.jsonl`` where no iteration ran. Nothing when no record was written."""
        if not self._index:
            return
        if "stats.jsonl" not in self._files:
            self._append("stats.jsonl", b"")
        order = np.argsort(np.array(self._index, dtype=np.int64), kind="stable")
        if (order == np.arange(len(order))).all():
            return  # already in order (every record came at once, or in order)
        path = self.out_dir / "requests.jsonl"
        with path.open("rb") as stream, replacing(path) as temp, temp.open("wb", buffering=1 << 20) as out:
            for k in order.tolist():
                out.write(os.pread(stream.fileno(), self._length[k], self._start[k]))

    def _append(self, name: str, data: bytes) -> None:
        """The batch in one unbuffered write: nothing waits in a buffer for a flush, and a kill lands
        between writes, leaving whole lines (bar a write the kernel itself cuts short). A full disk that
        takes part of the batch has it taken back (:func:`bm.files.append_whole`)."""
        f = self._files.get(name)
        if f is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            f = self._files[name] = (self.out_dir / name).open("wb", buffering=0)
            self._ends[name] = 0
        self._ends[name] = append_whole(f, data, self._ends[name], self.out_dir / name)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> FileJournal:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None:
                self.finish()
        finally:
            self.close()
