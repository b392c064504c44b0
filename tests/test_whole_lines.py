"""Line files keep only whole lines, and files rewritten in one piece are written whole (issue 53, item
5). A full disk takes part of a write and refuses the rest: the part is taken back, so a file never
ends in a torn line, and a resume that appends to it never leaves one in its middle. The disk is faked:
a file object that takes a set number of bytes and then refuses with ENOSPC, and ``/dev/full``, which
refuses every write with a real one."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import bm.cli.journal as journal_module
import bm.runfiles.writers as writers_module
from bm.cli.journal import FileJournal
from bm.files import append_whole, trim_torn_tail, write_whole
from bm.runfiles.writers import JsonlWriter
from bm.sweep.runner import PointStore

DEV_FULL = Path("/dev/full")


class Disk:
    """Room for ``room`` more bytes, shared by every file written through :meth:`patch` (only the file
    named ``only`` fills, when given; the others find room)."""

    def __init__(self, room: int, only: str | None = None) -> None:
        self.room, self.only = room, only

    def patch(self, monkeypatch, module) -> None:
        """``module``'s ``append_whole`` writes through this disk (the real function, a fake file)."""

        def append(f, data, end, path):
            on_disk = f if self.only not in (None, path.name) else _OnDisk(f, self)
            return append_whole(on_disk, data, end, path)

        monkeypatch.setattr(module, "append_whole", append)


class _OnDisk:
    def __init__(self, f, disk: Disk) -> None:
        self.f, self.disk = f, disk

    def write(self, data) -> int:
        if self.disk.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self.f.write(data[: self.disk.room])
        self.disk.room -= written
        return written

    def fileno(self) -> int:
        return self.f.fileno()


def whole_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"{path.name} ends in a torn line: {text[-40:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def test_a_write_the_disk_cuts_short_is_taken_back_whole(tmp_path, monkeypatch):
    Disk(100).patch(monkeypatch, writers_module)
    path = tmp_path / "outputs.jsonl"
    with JsonlWriter(path) as writer:
        writer.write({"index": 0, "text": "a" * 40})  # 55 bytes: fits
        with pytest.raises(OSError) as failed:
            writer.write({"index": 1, "text": "b" * 40})  # 45 of its 55 bytes fit: taken back
        assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(path)
        assert writer.num_records == 1
    assert [r["index"] for r in whole_lines(path)] == [0]


def test_once_a_writer_of_a_directory_failed_every_write_there_raises_it(tmp_path, monkeypatch):
    """stats.jsonl is written on the engine's thread, which cannot stop the run; the next record's write
    into the same directory raises its error, so a run never goes on with a stats file that lost rows."""
    with JsonlWriter(tmp_path / "outputs.jsonl") as outputs, JsonlWriter(tmp_path / "stats.jsonl") as stats:
        Disk(10).patch(monkeypatch, writers_module)
        with pytest.raises(OSError):
            stats.write({"Iteration Counter": 1, "padding": "x" * 20})
        monkeypatch.undo()  # room again: the error still stands for this run
        with pytest.raises(OSError) as failed:
            outputs.write({"index": 0})
        assert failed.value.filename == str(tmp_path / "stats.jsonl")
    with JsonlWriter(tmp_path / "outputs.jsonl", append=True) as later:  # a later run (the resume) writes
        later.write({"index": 0})
    assert whole_lines(tmp_path / "outputs.jsonl") == [{"index": 0}]


def test_a_resume_appends_after_the_last_whole_line(tmp_path):
    stats = tmp_path / "stats.jsonl"
    stats.write_text(
        '{"Iteration Counter": 1}\n{"Iteration Counter": 2}\n{"Iteration Cou'
    )  # killed mid-write
    with JsonlWriter(stats, append=True) as writer:
        writer.write({"Iteration Counter": 1, "Run Id": "resumed"})
    assert [r["Iteration Counter"] for r in whole_lines(stats)] == [1, 2, 1]
    assert trim_torn_tail(tmp_path / "missing.jsonl") == 0


def test_a_bench_journal_takes_a_cut_short_batch_back(tmp_path, monkeypatch):
    Disk(150).patch(monkeypatch, journal_module)
    with FileJournal(tmp_path) as journal:
        journal.add_stats([{"Iteration Counter": 1}, {"Iteration Counter": 2}])
        with pytest.raises(OSError) as failed:
            journal.add_stats([{"Iteration Counter": i, "padding": "x" * 40} for i in range(3, 6)])
    assert failed.value.filename == str(tmp_path / "stats.jsonl")
    assert [r["Iteration Counter"] for r in whole_lines(tmp_path / "stats.jsonl")] == [1, 2]


def test_a_sweep_killed_mid_point_resumes_without_the_torn_line(tmp_path):
    points = tmp_path / "points.jsonl"
    points.write_text('{"config": "inflight", "load')  # once a ConfigError: "line 1 is not a sweep point"
    assert PointStore(tmp_path).points == {}
    assert points.read_text() == ""


def test_a_file_written_whole_keeps_its_old_contents_when_the_disk_refuses(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"the": "previous run"}\n')
    (tmp_path / f".summary.json.{os.getpid()}.tmp").symlink_to(DEV_FULL)  # its temporary file: a full disk
    with pytest.raises(OSError) as failed:
        write_whole(path, '{"the": "new run"}\n')
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(path)
    assert json.loads(path.read_text()) == {"the": "previous run"}  # never empty, never half
