"""The one signal policy (bm.cli.interrupts): start-up stops where it is, a running command cancels and
writes its records, a run never waits for a request the stopped engine will not run, and every command
ends by itself within the bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console

from bm.cli.interrupts import Interrupted, Interrupts
from bm.cli.run import RunOptions, run_prompts
from bm.llm import Session
from bm.workloads.jsonl import iter_request_file
from tests.conftest import REPO, make_config
from tests.hang import HANG_S


def test_the_first_signal_during_start_up_raises_interrupted():
    interrupts = Interrupts(bound_s=None)
    with pytest.raises(Interrupted) as raised:
        interrupts._handle(signal.SIGTERM, None)
    assert raised.value.signal_name == "SIGTERM" and interrupts.stop.is_set()


def test_once_running_the_first_signal_calls_back_and_does_not_raise():
    interrupts = Interrupts(bound_s=None)
    calls: list[str] = []
    interrupts.running(lambda: calls.append("cancel"))
    interrupts._handle(signal.SIGINT, None)
    assert calls == ["cancel"] and interrupts.signal_name == "SIGINT"


def test_a_callback_registered_after_the_signal_is_called_at_once():
    interrupts = Interrupts(bound_s=None)
    interrupts.running()
    interrupts._handle(signal.SIGINT, None)
    calls: list[str] = []
    interrupts.running(lambda: calls.append("cancel"))
    assert calls == ["cancel"]


def test_reinstall_takes_the_handlers_back_from_a_library():
    with Interrupts(bound_s=None) as interrupts:
        signal.signal(signal.SIGTERM, lambda *_: None)  # what ray.init does
        interrupts.reinstall()
        assert signal.getsignal(signal.SIGTERM) == interrupts._handle
    assert signal.getsignal(signal.SIGTERM) != interrupts._handle  # put back on the way out


def policy_process(bound_s: float | None) -> subprocess.Popen:
    """A process running forever under the policy (a stop that never comes), once it says it is ready;
    its first signal's callback prints "stopping"."""
    code = (
        "import time\n"
        "from bm.cli.interrupts import Interrupts\n"
        f"with Interrupts(bound_s={bound_s}) as i:\n"
        "    i.running(lambda: print('stopping', flush=True))\n"
        "    print('ready', flush=True)\n"
        "    while True: time.sleep(0.05)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_the_watchdog_fires_a_little_before_the_bound_so_a_late_timer_still_ends_within_it():
    from bm.cli.interrupts import watchdog_delay

    assert watchdog_delay(60.0) == 57.0  # 5%, at most 3 s
    assert watchdog_delay(0.5) == 0.475
    assert watchdog_delay(600.0) == 597.0


def test_the_watchdog_ends_a_process_that_does_not_stop_within_the_bound():
    proc = policy_process(0.5)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=HANG_S)
    assert (
        proc.returncode == 130 and "still stopping 0.475 s after the interrupt, near the 0.5 s bound" in err
    )


def test_a_second_signal_exits_at_once_while_the_first_is_still_being_handled():
    proc = policy_process(None)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "stopping"  # the first was handled: the second is another
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130 and "interrupted again: exiting now" in err


def write_ids(path: Path, n: int, max_tokens: int) -> Path:
    path.write_text("".join(json.dumps({"input_ids": [5 + i % 50, 7, 9], "max_tokens": max_tokens}) + "\n" for i in range(n)))  # fmt: skip
    return path


def run_in_thread(prompts: Path, out: Path, interrupts: Interrupts, limit: int, monkeypatch) -> dict:
    """run_prompts on the embedded tiny model with ``limit`` requests in flight, on a thread that a
    hang cannot take the test down with; the summary it wrote."""
    import bm.cli.run as run_module

    monkeypatch.setattr(run_module, "in_flight_limit", lambda config: limit)
    config = make_config(engine={"max_batch_size": 2})
    options = RunOptions(default_max_tokens=4, ignore_eos=True, show_progress=False)
    console = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    ended = threading.Event()

    def target() -> None:
        try:
            run_prompts(iter_request_file(prompts), config, out, options, console, interrupts)
        finally:
            ended.set()

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    # Not a timing assertion: a hung run never sets the event, and the generous wait only keeps a
    # regression from blocking the suite for ever.
    assert ended.wait(HANG_S), "bm run hung after the interrupt"
    return json.loads((out / "summary.json").read_text())


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]


def test_a_signal_while_the_reader_waits_for_room_does_not_hang_the_run(tmp_path, monkeypatch):
    """Issue 53: the signal came while the reader waited for room, and no request finished within the
    next poll (0.1 s). The reader then submitted the request it had built to the stopped engine, and
    the final wait polled for it for ever. Here the first poll of the wait delivers the signal and
    reports nothing finished, the moment the hang needed, every time."""
    interrupts = Interrupts(bound_s=None)
    real_next_final = Session.next_final
    polls: list[int] = []

    def next_final(self: Session, timeout: float = 0.1):
        polls.append(1)
        if len(polls) == 1:  # the reader has filled the in-flight limit and waits for room
            interrupts._handle(signal.SIGINT, None)
            return None
        return real_next_final(self, timeout)

    monkeypatch.setattr(Session, "next_final", next_final)
    n = 12
    summary = run_in_thread(write_ids(tmp_path / "p.jsonl", n, 4), tmp_path / "out", interrupts, 2, monkeypatch)  # fmt: skip
    written = records(tmp_path / "out")
    assert sorted(r["index"] for r in written) == list(range(n))  # one record per line
    assert summary["interrupted"] and summary["num_requests"] == n
    assert summary["num_cancelled"] >= n - 2


def test_a_signal_between_the_readers_check_and_its_submit_does_not_hang_the_run(tmp_path, monkeypatch):
    """The narrower window: the signal lands as the reader submits, after it checked for one. The
    request is queued where the stopped engine never takes it; the wait takes it back as cancelled."""
    interrupts = Interrupts(bound_s=None)
    real_submit = Session.submit
    submits: list[int] = []

    def submit(self: Session, request) -> None:
        submits.append(request.request_id)
        if len(submits) == 3:
            interrupts._handle(signal.SIGINT, None)
        real_submit(self, request)

    monkeypatch.setattr(Session, "submit", submit)
    n = 12
    summary = run_in_thread(write_ids(tmp_path / "p.jsonl", n, 4), tmp_path / "out", interrupts, 4, monkeypatch)  # fmt: skip
    written = records(tmp_path / "out")
    assert sorted(r["index"] for r in written) == list(range(n))
    assert summary["interrupted"] and len(submits) == 3  # nothing was submitted after the signal
    third = next(r for r in written if r["index"] == 2)
    assert third["finish_reason"] in ("cancelled", "length")


def test_a_signal_during_the_model_load_cancels_every_line_without_the_model(tmp_path, monkeypatch):
    """The load is cut short (Interrupted, raised where it is) instead of running to the end first
    (SIGTERM 1.5 s into a run took 20.9 s to exit); every line still gets its record, and run.json is
    written so --resume can finish the run."""
    import bm.cli.run as run_module

    interrupts = Interrupts(bound_s=None)

    def interrupted_load(config):
        interrupts._handle(signal.SIGTERM, None)  # raises Interrupted: start-up has not ended

    monkeypatch.setattr(run_module, "LLM", interrupted_load)
    prompts = write_ids(tmp_path / "p.jsonl", 5, 4)
    out = tmp_path / "out"
    options = RunOptions(default_max_tokens=4, prompts=prompts, run_seed=3)
    console = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    summary = run_prompts(iter_request_file(prompts), make_config(), out, options, console, interrupts)
    assert summary.interrupted and summary.num_cancelled == 5
    assert [r["finish_reason"] for r in records(out)] == ["cancelled"] * 5
    assert json.loads((out / "run.json").read_text())["seed"] == 3
    assert json.loads((out / "summary.json").read_text())["runtime"] is None  # nothing loaded


def python_c(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` from the repository, its output captured."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=HANG_S
    )


def test_sigterm_during_the_command_lines_imports_exits_130_without_a_traceback(tmp_path):
    """The handlers are installed before typer, rich and the config load (bm.cli.entry); a signal in
    that second used to print a KeyboardInterrupt traceback (SIGINT) or kill the process (SIGTERM)."""
    code = (
        "import os, signal, sys, builtins\n"
        "real = builtins.__import__\n"
        "def slow(name, *a, **k):\n"
        "    if name == 'typer':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # the signal lands mid-import\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = slow\n"
        "sys.argv = ['bm', '--help']\n"
        "from bm.cli.entry import main\n"
        "main()\n"
    )
    done = python_c(code)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "SIGTERM: interrupted during start-up" in done.stderr


def test_a_signal_after_the_command_finished_keeps_its_exit_code(tmp_path):
    """After a finished command the exit callbacks run, then the process ends with the command's own
    code: a signal in that time (or in the interpreter's teardown it skips, a second or more with
    torch loaded) used to end a complete run with -2 or -15."""
    code = (
        "import atexit, os, signal, sys, time\n"
        "sys.argv = ['bm', '--help']\n"
        "from bm.cli.entry import main\n"
        "atexit.register(lambda: print('second callback ran', file=sys.stderr))\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(HANG)))\n"
        "main()\n"
    ).replace("HANG", str(HANG_S))
    done = python_c(code)
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout and "Traceback" not in done.stderr
    assert "second callback ran" not in done.stderr  # the signal ended it at once, with code 0


def test_the_exit_callbacks_run_and_a_message_exit_keeps_its_text(tmp_path):
    code = (
        "import atexit, sys\n"
        "sys.argv = ['bm', '--help']\n"
        "import bm.cli.main\n"
        "def app(): sys.exit('refused: a reason')\n"
        "bm.cli.main.app = app\n"
        "from bm.cli.entry import main\n"
        "atexit.register(lambda: print('callback ran', file=sys.stderr))\n"
        "main()\n"
    )
    done = python_c(code)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["refused: a reason", "callback ran"]


def command(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "bm", *args]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )


def wait_for(proc: subprocess.Popen, made) -> None:
    """Until ``made()`` holds: an event the command produces (a line written), never a clock."""
    import time

    while not made():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_during_a_compare_ends_it_with_130_and_never_a_gate_verdict(tmp_path):
    """A comparison cut short is no evidence: it exits 130, judges no --assert, and compare.json (when
    a round finished) says interrupted. It used to run every remaining variant after a Ctrl-C."""
    out = tmp_path / "out"
    proc = command(
        "compare", "--dataset-kind", "synthetic", "--num-requests", "60", "--input-len", "8",
        "--output-len", "48", "--schemes", "v1,inflight", "--set", "model.device=cpu",
        "--set", "engine.max_batch_size=2", "--assert", "inflight.output_throughput > 0", "-q", "-o", str(out),
    )  # fmt: skip
    wait_for(proc, lambda: any(lines(p) >= 2 for p in out.glob("variants/*/requests.jsonl")))
    proc.send_signal(signal.SIGTERM)
    _stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "passed:" not in stderr
    if (out / "compare.json").exists():
        assert json.loads((out / "compare.json").read_text())["interrupted"] is True
    else:
        assert "nothing to compare" in " ".join(stderr.split())


def test_sigterm_during_a_parallel_sweep_keeps_the_finished_points_and_leaves_no_worker(tmp_path):
    from tests.test_sweep import MODEL, SLO_FLAGS, base_overrides

    out = tmp_path / "out"
    sets = [f"--set={k}={v}" for k, v in base_overrides(**{"model.config": str(MODEL)}).items()]
    proc = command(
        "sweep", *sets, "--schemes", "v1,inflight,inflight_fused", "--slo", SLO_FLAGS, "--workers", "2",
        "--no-early-stop", "--precision", "0.001", "--no-plot", "-o", str(out),
    )  # fmt: skip
    wait_for(proc, lambda: lines(out / "points.jsonl") >= 1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "points saved; rerun with --resume" in " ".join(stdout.split())
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a sweep worker outlived the interrupted sweep"


def test_an_interrupted_simulated_bench_cancels_what_had_not_finished_and_says_so(monkeypatch):
    """The simulator runs on the main thread on a virtual clock: the first signal's event ends the
    replay at its next check (bm bench --executor sim ran to the end, or to the watchdog, before)."""
    import bm.bench.simulated as sim_run
    from bm.bench.simulated import load_sim_model, run_sim
    from bm.config import load_config
    from bm.workloads import load_workload
    from tests.test_sweep import base_overrides

    config = load_config(None, base_overrides(**{"bench.num_requests": 200}))
    model = load_sim_model(config)
    workload = load_workload(config.bench, vocab_size=model.vocab_size, encode=None)
    stop = threading.Event()
    monkeypatch.setattr(sim_run, "_PROGRESS_EVERY", 1)  # the signal lands after the first iteration
    result = run_sim(config, model, workload, progress=lambda _p: stop.set(), interrupt=stop)
    assert result.interrupted
    metrics = result.metrics
    assert metrics["cancelled"] > 0 and metrics["completed"] + metrics["cancelled"] == 200
    assert metrics["failed"] == 0
