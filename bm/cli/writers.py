"""Line-oriented output files, flushed per record so an interrupted run keeps everything it finished."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class JsonlWriter:
    def __init__(self, path: Path, append: bool = False) -> None:
        self.path = path
        self._file = path.open("a" if append else "w", encoding="utf-8")
        self._lock = threading.Lock()
        self.num_records = 0

    def write(self, record: dict[str, Any] | str) -> None:
        line = record if isinstance(record, str) else json.dumps(record, ensure_ascii=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            self.num_records += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
