"""One writer per output directory (issue 53, item 4): two ``bm run``s into one empty ``-o`` both exited 0
and one run's records were lost. Every command that writes into ``-o`` locks it first (``flock`` on
``OUT/.bm.lock``, held while the process lives), and a second process is refused up front (exit 2),
naming the process that holds it. A process that dies, even by SIGKILL, frees the directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.cli.sweep import SWEEP_FILES
from bm.runfiles import outlock
from bm.runfiles.outdir import BENCH_FILES, COMPARE_FILES, RUN_FILES, OutDirError, prepare_out_dir
from tests.conftest import REPO
from tests.hang import HANG_S

runner = CliRunner()
HOLD = (
    "import sys; from pathlib import Path; from bm.runfiles.outlock import acquire\n"
    "acquire(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read()\n"
)


def prompts_file(tmp_path, n=3):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [5 + i, 6, 7]}) + "\n" for i in range(n)))
    return prompts


def bm_run(prompts, out, *extra):
    args = ["run", str(prompts), "-o", str(out), "-q", "--max-tokens", "2", "--set", "model.device=cpu"]
    return runner.invoke(app, [*args, *extra])


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path/out``'s lock until the test lets it go."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "locked"  # waits on the event, not on a clock
    yield out, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_run_into_a_directory_another_process_writes_is_refused_naming_it(tmp_path, holder):
    out, proc = holder
    result = bm_run(prompts_file(tmp_path), out)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert f"-o '{out}' is being written by another process (pid {proc.pid}, " in message
    assert "since " in message and "give another -o directory" in message
    assert "loading model" not in result.output  # refused before anything loaded or was written
    assert sorted(p.name for p in out.iterdir()) == [outlock.LOCK_NAME]
    proc.stdin.close()  # the other process ends: the directory is free
    proc.wait()
    done = bm_run(prompts_file(tmp_path), out)
    assert done.exit_code == 0, done.output


@pytest.mark.parametrize("files", [RUN_FILES, BENCH_FILES, COMPARE_FILES, SWEEP_FILES])
def test_every_command_s_output_directory_takes_the_lock(holder, files):
    out, _proc = holder
    with pytest.raises(OutDirError, match="is being written by another process"):
        prepare_out_dir(out, resume=False, overwrite=True, files=files)


def test_a_killed_holder_frees_the_directory(tmp_path, holder):
    out, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert prepare_out_dir(out, resume=False, overwrite=False) is None
    assert outlock.holds(out)
    about = json.loads((out / outlock.LOCK_NAME).read_text())
    assert about["pid"] == os.getpid()


def test_the_lock_file_neither_makes_a_directory_non_empty_nor_goes_with_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / outlock.LOCK_NAME).write_text("left by a process that ended\n")
    prompts = prompts_file(tmp_path)
    assert bm_run(prompts, out).exit_code == 0  # only a stale lock file there: empty for bm
    lock = (out / outlock.LOCK_NAME).stat()
    assert bm_run(prompts, out, "--overwrite").exit_code == 0
    assert (out / outlock.LOCK_NAME).stat().st_ino == lock.st_ino  # the same lock file, still held


def test_a_refused_directory_gets_no_lock_file_left_in_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    with pytest.raises(OutDirError, match="is not empty"):
        prepare_out_dir(out, resume=False, overwrite=False)
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    assert not outlock.holds(out)


def test_two_concurrent_runs_into_one_directory_one_is_refused_naming_the_other(tmp_path):
    prompts = prompts_file(tmp_path, n=64)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "bm.cli.main", "run", str(prompts), "-o", str(out), "-q"]
    command += ["--max-tokens", "32", "--ignore-eos", "--set", "model.device=cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lock = out / outlock.LOCK_NAME
    while not (lock.exists() and f'"pid": {first.pid}' in lock.read_text()):  # its -o is checked first
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # held where it is, however fast this machine runs it
    try:
        second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2, second.stderr
    message = " ".join(second.stderr.split())
    assert f"is being written by another process (pid {first.pid}, `bm run {prompts} -o {out} -q" in message
    _stdout, stderr = first.communicate(timeout=HANG_S)
    assert first.returncode == 0, stderr
    records = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in records) == list(range(64))
    identity = json.loads((out / "run.json").read_text())
    assert identity["prompts"] == str(prompts) and Path(identity["prompts"]).exists()


FORK = (
    "import os, sys; from pathlib import Path; from bm.runfiles.outlock import acquire\n"
    "acquire(Path(sys.argv[1]))\n"
    "if os.fork() == 0:\n"  # a worker that outlives its parent; it says so once its fork has returned
    "    os.write(1, b'child\\n'); sys.stdin.read(); os._exit(0)\n"
    "os.write(1, b'forked\\n'); sys.stdin.read()\n"
)
# os.write: one write(2) per line, so the two processes' lines never interleave (print writes the
# text and its newline separately where stdout is unbuffered, as with PYTHONUNBUFFERED=1 in CI)


def test_a_forked_worker_outliving_its_killed_parent_does_not_keep_the_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", FORK, str(out)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # both lines: the child's comes after its at-fork handler closed its copy of the lock (the
        # parent's alone let the test kill the parent before a loaded machine had run the child at all)
        assert {proc.stdout.readline().strip() for _ in range(2)} == {"forked", "child"}
        with pytest.raises(OutDirError, match=f"pid {proc.pid}"):  # the parent holds it
            prepare_out_dir(out, resume=False, overwrite=False)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert prepare_out_dir(out, resume=False, overwrite=False) is None  # the worker lives on: free
    finally:
        proc.stdin.close()  # the worker reads end-of-file and exits
        if proc.poll() is None:
            proc.kill()
        proc.wait()
