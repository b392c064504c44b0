"""``stats.jsonl`` and ``requests.jsonl`` written as a benchmark runs, so a killed run leaves its trace.

A user's first realistic ``bm bench`` on a GPU was killed after 170 s and its output directory held
nothing. :class:`FileJournal` is the :class:`~bm.bench.journal.BenchJournal` of ``bm bench`` and
``bm compare``: it appends each stats row and each finished request's record as the run hands them over
(from the caller's thread, about ten times a second) straight to the operating system, one write per
batch, so even SIGKILL loses at most the last fraction of a second. The lines are written by the same
functions as the final files. When the run ends, :func:`bm.bench.write_results` replaces both files
with the complete ones (every request once, in workload order) by renaming a finished file over each,
so a finished run's files are as they always were; a ``stats.jsonl`` the journal already wrote whole
is the final one, and is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from bm.bench.results import request_line, stats_line
from bm.files import append_whole
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
    first line comes, so a run that stops before it starts leaves nothing new behind.

    ``rows``: the workload's rows, to name engine errors by their line as ``bm bench``'s final records
    do (:func:`named_error`); None writes records as they come (``bm compare``'s variant files)."""

    def __init__(self, out_dir: Path, rows: Sequence[Row] | None = None) -> None:
        self.out_dir = out_dir
        self._rows = rows
        self._files: dict[str, BinaryIO] = {}
        self._ends: dict[str, int] = {}  # where each file's whole lines end
        self.num_stats = 0  # rows written to stats.jsonl
        self._request_lines: dict[int, str] = {}  # index -> the line written, for the final file

    def add_stats(self, rows: Sequence[dict[str, Any]]) -> None:
        self._append("stats.jsonl", "".join(stats_line(row) for row in rows))
        self.num_stats += len(rows)

    def holds_stats(self, rows: Sequence[dict[str, Any]]) -> bool:
        """Whether ``stats.jsonl`` already holds exactly ``rows``, the run's stats: the run hands each
        row once, in order, so the count tells (see ``write_results(stats_written=...)``)."""
        return 0 < self.num_stats == len(rows)  # none written: no file yet, write_results makes it

    def add_requests(self, records: Sequence[dict[str, Any]]) -> None:
        if self._rows is not None:
            rows = self._rows
            records = [{**r, "error": named_error(r["error"], rows[r["index"]])} for r in records]
        lines = [request_line(record) for record in records]
        self._request_lines.update(zip((r["index"] for r in records), lines, strict=True))
        self._append("requests.jsonl", "".join(lines))

    def request_lines(self, num_requests: int) -> list[str] | None:
        """The lines written, in workload order, when every one of ``num_requests`` records was written
        once (the final ``requests.jsonl``, without serializing each record a second time); else None."""
        lines = self._request_lines
        if len(lines) != num_requests or any(i not in lines for i in range(num_requests)):
            return None
        return [lines[i] for i in range(num_requests)]

    def _append(self, name: str, text: str) -> None:
        """The batch in one unbuffered write: nothing waits in a buffer for a flush, and a kill lands
        between writes, leaving whole lines (bar a write the kernel itself cuts short). A full disk that
        takes part of the batch has it taken back (:func:`bm.files.append_whole`)."""
        f = self._files.get(name)
        if f is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            f = self._files[name] = (self.out_dir / name).open("wb", buffering=0)
            self._ends[name] = 0
        self._ends[name] = append_whole(f, text.encode("utf-8"), self._ends[name], self.out_dir / name)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> FileJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
