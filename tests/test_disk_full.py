"""A full disk stops a run cleanly (issue 53, item 5). It used to give seven chained ``OSError: [Errno 28]``
tracebacks and exit 1, after the model had loaded (the ``-o`` check wrote a 0-byte probe, which a full
file system takes), leaving an empty ``run.json`` and a torn line in the middle of ``stats.jsonl`` once
a resume appended to it. Now the free space is checked before the model loads; a disk that fills
during the run is one error line naming the file and the resume command (exit 1); every line file keeps
only whole lines; and ``run.json`` is written whole.

The disk is faked: a file object that takes a set number of bytes and then refuses with ENOSPC (what a
full disk does: part of a write, then the error; tests/test_whole_lines.py pins the writers on it), a
patched ``os.statvfs``, and ``/dev/full``, which refuses every write with a real ENOSPC."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import bm.cli.main as main_module
import bm.runfiles.diskspace as diskspace
import bm.runfiles.writers as writers_module
from bm.cli.main import app
from bm.runfiles.identity import write_run_identity
from tests.test_whole_lines import DEV_FULL, Disk, whole_lines

runner = CliRunner()


def test_run_json_is_written_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text('{"the": "previous run"}\n')
    (out / f".run.json.{os.getpid()}.tmp").symlink_to(DEV_FULL)  # its temporary file lands on a full disk
    with pytest.raises(OSError) as failed:
        write_run_identity(out, {"seed": 1}, "tiny")
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(out / "run.json")
    assert json.loads((out / "run.json").read_text()) == {"the": "previous run"}  # never empty


def prompts_file(tmp_path: Path, n: int) -> Path:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [5 + i % 50, 6, 7]}) + "\n" for i in range(n)))
    return prompts


def bm_run(prompts, out, *extra):
    args = ["run", str(prompts), "-o", str(out), "-q", "--max-tokens", "4", "--ignore-eos"]
    return runner.invoke(
        app, [*args, "--set", "model.device=cpu", "--set", "engine.max_batch_size=4", *extra]
    )


@pytest.mark.parametrize("fills", ["outputs.jsonl", "stats.jsonl"])
def test_a_disk_that_fills_mid_run_is_one_error_naming_the_file_and_the_resume(tmp_path, monkeypatch, fills):
    """outputs.jsonl fills on the main thread; stats.jsonl on the engine's, whose failure the next record's
    write raises (its first stats row comes before any request can finish its 4 tokens)."""
    n = 40
    prompts, out = prompts_file(tmp_path, n), tmp_path / "out"
    Disk(1000, only=fills).patch(monkeypatch, writers_module)
    full = bm_run(prompts, out)
    assert full.exit_code == 1, full.output
    assert isinstance(full.exception, SystemExit)  # no traceback: bm ended it
    errors = [line for line in full.output.splitlines() if line.startswith("error:")]
    message = " ".join(full.output[full.output.index("error:") :].split())
    assert len(errors) == 1 and f"error: {out / fills}: no space left on device" in message
    assert f"finish the run with: bm run {prompts} " in message and f"-o {out} --resume" in message
    kept = whole_lines(out / "outputs.jsonl")
    assert len(kept) < n and (fills == "stats.jsonl" or kept)  # 1000 bytes hold a few records
    whole_lines(out / "stats.jsonl")
    assert json.loads((out / "run.json").read_text())["seed"] is not None
    monkeypatch.undo()  # space freed
    resumed = bm_run(prompts, out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    records = whole_lines(out / "outputs.jsonl")
    assert sorted(r["index"] for r in records) == list(range(n))  # each line once
    assert all(r["finish_reason"] == "length" for r in records)
    assert {r["Run Id"] for r in whole_lines(out / "stats.jsonl")} >= {
        json.loads((out / "summary.json").read_text())["run_id"]
    }


class _Statvfs:
    def __init__(self, free: int) -> None:
        self.f_frsize, self.f_bavail = 4096, free // 4096


def test_a_file_system_without_room_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    prompts, out = prompts_file(tmp_path, 2000), tmp_path / "out"
    monkeypatch.setattr(diskspace.os, "statvfs", lambda path: _Statvfs(12 << 20))
    result = bm_run(prompts, out, "--max-tokens", "4096")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert f"-o '{out}': 12.6 MB free on its file system, but the run needs about 131.6 MB" in message
    assert "2,000 line(s) x ~65.8 kB a record at --max-tokens 4096" in message
    assert "free some space there, or give -o a directory on another file system" in message
    assert "loading model" not in result.output
    small = bm_run(prompts_file(tmp_path, 2), tmp_path / "small")  # even a small run wants 16 MB
    message = " ".join(small.output.split())
    assert small.exit_code == 2 and "needs at least 16.8 MB, bm's floor for any run" in message
    assert "(its records: about 640 bytes, 2 line(s) x ~320 bytes a record at --max-tokens 4)" in message
    assert not (tmp_path / "small").exists()  # a refused run leaves no directory behind


def test_a_resume_needs_room_for_a_second_copy_of_the_kept_records(tmp_path, monkeypatch):
    prompts, out = prompts_file(tmp_path, 3), tmp_path / "out"
    assert bm_run(prompts, out).exit_code == 0
    kept = (out / "outputs.jsonl").stat().st_size
    needed, how = diskspace.run_output_bytes(prompts, 4, out, resume=True)
    assert needed == 3 * (diskspace.RECORD_BYTES + 4 * diskspace.TOKEN_BYTES) + kept
    assert "plus a copy of the kept records" in how


def test_any_command_s_full_disk_is_one_line_not_a_traceback(monkeypatch, capsys):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "bm-out/bench-1/requests.jsonl")

    from bm.cli import entry

    monkeypatch.setattr(main_module, "app", full)  # what the console script (bm.cli.entry) runs
    monkeypatch.setattr(entry, "exit_process", sys.exit)  # not this pytest process's teardown
    monkeypatch.setattr(sys, "argv", ["bm", "bench"])
    with pytest.raises(SystemExit) as ended:
        entry.main()
    assert ended.value.code == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: bm-out/bench-1/requests.jsonl: no space left on device;")
    assert "Traceback" not in err
