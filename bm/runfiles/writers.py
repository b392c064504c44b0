"""Line-oriented output files, written a whole line at a time so an interrupted run keeps everything it
finished, and a full disk leaves no torn line (:func:`bm.files.append_whole`).

The writers of one directory share their fate: once one of them could not write (the disk filled), every
later write into that directory while they are open raises the same error. ``stats.jsonl`` is written
from the engine's thread, whose caller cannot stop the run; the next record's write then stops it, so a
run never goes on with a stats file that lost rows."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, ClassVar

from bm.files import append_whole, trim_torn_tail


class JsonlWriter:
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()
    _directories: ClassVar[dict[Path, list[Any]]] = {}  # directory -> [its first write error, open writers]

    def __init__(self, path: Path, append: bool = False) -> None:
        self.path = path
        end = trim_torn_tail(path) if append else 0  # a resume appends after whole lines only
        self._file = path.open("ab" if append else "wb", buffering=0)
        self._end = end
        self._lock = threading.Lock()
        self.num_records = 0
        self._directory = path.parent.resolve()
        with self._shared_lock:
            self._directories.setdefault(self._directory, [None, 0])[1] += 1

    @property
    def error(self) -> OSError | None:
        """The error that stopped a writer of this directory (None while every write went through)."""
        with self._shared_lock:
            entry = self._directories.get(self._directory)
            return entry[0] if entry is not None else None

    def write(self, record: dict[str, Any] | str) -> None:
        line = record if isinstance(record, str) else json.dumps(record, ensure_ascii=False)
        data = (line + "\n").encode("utf-8")
        with self._lock:
            failed = self.error
            if failed is not None:
                raise failed
            try:
                self._end = append_whole(self._file, data, self._end, self.path)
            except OSError as exc:
                with self._shared_lock:
                    entry = self._directories[self._directory]
                    entry[0] = entry[0] or exc
                raise
            self.num_records += 1

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.close()
            with self._shared_lock:
                entry = self._directories[self._directory]
                entry[1] -= 1
                if entry[1] == 0:
                    del self._directories[self._directory]

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
