"""A benchmark journal for tests that keeps what a run hands it: the run itself keeps no row or record
(bm.bench.journal), so a test that looks at them records them."""

from __future__ import annotations


class Recorder:
    """A journal that keeps what it is given, in the order given."""

    def __init__(self) -> None:
        self.stats: list[dict] = []
        self.records: list[dict] = []

    def add_stats(self, rows):
        self.stats.extend(rows)

    def add_requests(self, records):
        self.records.extend(records)

    def in_order(self) -> list[dict]:
        """The records in workload order (they come in finishing order)."""
        return sorted(self.records, key=lambda r: r["index"])
