"""Mutation testing for bm's decision code: does a small wrong change make some test fail?

Usage (from the repository root; ``make mutate`` runs the first form)::

    python tools/mutate.py                 # every mutant in tools/mutants.py
    python tools/mutate.py -k sampler      # mutants whose id or file contains "sampler"
    python tools/mutate.py --check         # only check that every snippet is still found, run nothing
    python tools/mutate.py --list

Each mutant (see tools/mutants.py) names a file, an exact source snippet that must occur exactly once
in it, its replacement, and the tests that should catch it. Mutants are matched by content, not line
number, so they survive edits elsewhere in a file; a snippet that is no longer found (or found twice) is
reported as STALE, never as killed, so it can be updated.

One mutant at a time: the file is rewritten, the mutant's tests run with ``-x -q``, the file is put back.
The original is restored in a ``finally`` (Ctrl-C and SIGTERM included) and also saved beside a marker
in the temp directory first, so even a killed run is repaired by the next one.

Speed: importing torch and transformers costs seconds, more than most mutants' tests. So the third-party
modules the tests import are loaded once in this process, and each mutant's tests run in a forked child
that imports bm (the mutated copy) fresh. ``--no-fork`` runs each in a plain subprocess instead.

A test run that exceeds ``--timeout`` seconds counts as killed (the mutant made something hang, and the
suite's bounded waits are what notice that) and is reported as TIMEOUT.

This is a developer tool, not part of CI: it rewrites source files while it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from mutants import MUTANTS, Mutant  # noqa: E402

BACKUP = Path(tempfile.gettempdir()) / f"bm-mutate-{hashlib.sha1(str(REPO).encode()).hexdigest()[:12]}.json"


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # KILLED, TIMEOUT, SURVIVED, STALE
    seconds: float = 0.0
    detail: str = ""

    @property
    def killed(self) -> bool:
        return self.status in ("KILLED", "TIMEOUT")


# -- the source file, mutated and always restored -------------------------------------------------------


def locate(mutant: Mutant) -> tuple[str | None, str]:
    """The mutated text of the mutant's file, or None and why it cannot be applied."""
    path = REPO / mutant.file
    if not path.exists():
        return None, f"{mutant.file} does not exist"
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.find)
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times"
        return None, f"snippet {where} in {mutant.file}: {mutant.find!r}"
    if mutant.find == mutant.replace:
        return None, "the replacement equals the snippet"
    return text.replace(mutant.find, mutant.replace), ""


def restore_leftover() -> None:
    """Put back a file a previous run left mutated (it was killed before its ``finally`` ran)."""
    if not BACKUP.exists():
        return
    saved = json.loads(BACKUP.read_text(encoding="utf-8"))
    path = REPO / saved["file"]
    path.write_text(saved["text"], encoding="utf-8")
    os.utime(path, ns=(saved["mtime_ns"], saved["mtime_ns"]))
    BACKUP.unlink()
    print(f"restored {saved['file']}, left mutated by an interrupted run", file=sys.stderr)


class Applied:
    """Context manager: the mutant is in the file inside the block, the original after it, always."""

    def __init__(self, mutant: Mutant, mutated: str) -> None:
        self.path = REPO / mutant.file
        self.file = mutant.file
        self.mutated = mutated

    def __enter__(self) -> None:
        self.original = self.path.read_text(encoding="utf-8")
        self.mtime_ns = self.path.stat().st_mtime_ns
        BACKUP.write_text(
            json.dumps({"file": self.file, "text": self.original, "mtime_ns": self.mtime_ns}),
            encoding="utf-8",
        )
        self.path.write_text(self.mutated, encoding="utf-8")

    def __exit__(self, *exc: object) -> None:
        self.path.write_text(self.original, encoding="utf-8")
        # The original timestamp back, so a cached .pyc of the original is valid again and no .pyc of
        # the mutant (same size, same second) can ever be taken for it.
        os.utime(self.path, ns=(self.mtime_ns, self.mtime_ns))
        BACKUP.unlink(missing_ok=True)


# -- running the tests ----------------------------------------------------------------------------------


def pytest_args(mutant: Mutant) -> list[str]:
    args = ["-x", "-q", "-p", "no:cacheprovider", *mutant.tests]
    if mutant.k:
        args += ["-k", mutant.k]
    return args


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def preload(test_files: Sequence[str]) -> None:
    """Import, here, every third-party module the tests import, so forked children start warm.

    The list is asked of a throwaway interpreter that imports the test modules; bm and the tests
    themselves are never imported here, so every child imports the (mutated) bm from source.
    """
    modules = [f"tests.{Path(f).stem}" for f in sorted(set(test_files))]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] not in ('bm', 'tests', '__main__'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        print(f"preloading failed, running without it:\n{out.stderr[-2000:]}", file=sys.stderr)
        return
    for name in json.loads(out.stdout.splitlines()[-1]):
        # Some modules import only in a particular context (a platform, an optional backend): skip them.
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def run_forked(args: list[str], timeout: float, log: Path) -> tuple[str, str]:
    """Run pytest in a forked child; returns (status, last lines of its output)."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 3
        try:
            os.chdir(REPO)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            sys.dont_write_bytecode = True
            sys.path.insert(0, str(REPO))
            import pytest

            code = int(pytest.main(args))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pid = 0
                break
            if time.monotonic() > deadline:
                return "TIMEOUT", tail(log)
            time.sleep(0.05)
    finally:
        if pid:  # timed out or interrupted: the child must not outlive this run (or the restored file)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return ("SURVIVED" if os.waitstatus_to_exitcode(status) == 0 else "KILLED"), tail(log)


def run_subprocess(args: list[str], timeout: float, log: Path) -> tuple[str, str]:
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", *args],
                cwd=REPO,
                env=child_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return "TIMEOUT", tail(log)
    return ("SURVIVED" if proc.returncode == 0 else "KILLED"), tail(log)


def tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return (failed or lines[-1:] or [""])[0][:160]


# -- the driver -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="select", help="only mutants whose id or file contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="check every snippet is found once; run nothing")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per mutant's tests [60]")
    parser.add_argument("--no-fork", action="store_true", help="a fresh interpreter per mutant (slower)")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the tests unmutated first")
    parser.add_argument(
        "--min-score", type=float, default=90.0, help="exit 1 below this score in percent [90]"
    )
    opts = parser.parse_args(argv)

    restore_leftover()
    chosen = [m for m in MUTANTS if not opts.select or opts.select in m.id or opts.select in m.file]
    ids = [m.id for m in MUTANTS]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        print(f"duplicate mutant ids: {sorted(duplicates)}", file=sys.stderr)
        return 2
    if opts.list:
        for m in chosen:
            print(f"{m.id:28} {m.file:32} {m.find.strip()!r} -> {m.replace.strip()!r}")
        return 0

    applicable: list[tuple[Mutant, str]] = []
    outcomes: list[Outcome] = []
    for m in chosen:
        mutated, why = locate(m)
        if mutated is None:
            outcomes.append(Outcome(m, "STALE", detail=why))
        else:
            applicable.append((m, mutated))
    if opts.check:
        for o in outcomes:
            print(f"STALE    {o.mutant.id}: {o.detail}")
        print(f"{len(applicable)} of {len(chosen)} mutants apply")
        return 1 if outcomes else 0

    fork = hasattr(os, "fork") and not opts.no_fork
    run = run_forked if fork else run_subprocess
    if fork:
        preload([t.split("::")[0] for m, _ in applicable for t in m.tests])
    log = Path(tempfile.mkstemp(prefix="bm-mutate-", suffix=".log")[1])

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        if not opts.no_baseline:
            # A mutant is only "killed" if its tests pass without it.
            for args in {tuple(pytest_args(m)) for m, _ in applicable}:
                status, detail = run(list(args), opts.timeout, log)
                if status != "SURVIVED":
                    print(f"the unmutated tests fail, fix them first: pytest {' '.join(args)}\n  {detail}")
                    return 2
            print(f"baseline: the tests of {len(applicable)} mutants pass unmutated")
        for n, (m, mutated) in enumerate(applicable, 1):
            start = time.monotonic()
            with Applied(m, mutated):
                status, detail = run(pytest_args(m), opts.timeout, log)
            outcome = Outcome(m, status, time.monotonic() - start, detail if status != "SURVIVED" else "")
            outcomes.append(outcome)
            print(
                f"[{n:3}/{len(applicable)}] {status:8} {m.id:28} {outcome.seconds:5.1f} s  {outcome.detail}"
            )
            sys.stdout.flush()
    except KeyboardInterrupt:
        print("\ninterrupted: the mutated file was restored", file=sys.stderr)
        return 130
    finally:
        log.unlink(missing_ok=True)

    return report(outcomes, opts.min_score)


def report(outcomes: list[Outcome], min_score: float) -> int:
    ran = [o for o in outcomes if o.status != "STALE"]
    killed = [o for o in ran if o.killed]
    survivors = [o for o in ran if not o.killed]
    stale = [o for o in outcomes if o.status == "STALE"]
    score = 100.0 * len(killed) / len(ran) if ran else 0.0
    print(f"\nscore: {len(killed)}/{len(ran)} mutants killed ({score:.1f}%), {len(stale)} stale")
    for o in survivors:
        m = o.mutant
        print(f"  SURVIVED {m.id} ({m.file}): {m.find.strip()!r} -> {m.replace.strip()!r}")
        print(f"           {m.why}")
    for o in stale:
        print(f"  STALE    {o.mutant.id}: {o.detail}")
    return 0 if ran and score >= min_score else 1


if __name__ == "__main__":
    sys.exit(main())
