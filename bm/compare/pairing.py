"""The baseline's side of a paired gate: the baseline's own bm, in a worker process, run on request.

``bm compare --baseline PREV/compare.json --baseline-cmd CMD`` starts ``CMD compare --pair-worker -c
CONFIG --schemes ... --policies ... --baselines ...`` once, with the config and the variants recorded in
PREV/compare.json (so the baseline's bm reads a config of its own schema). The worker loads its model
and the workload, prints one line, then runs one variant per line it reads and answers with that run's
metrics, until its input closes. Start-up is paid once, outside every clock, as on this run's side.

Why a command, and not the saved config run again in this process: in CI the baseline was produced by
an older commit. Re-running "the baseline" here would run this commit's code with the baseline's config,
so the pairs would compare a config with itself and pass any slowdown in the code. The code under test
is only paired with the baseline's code when the baseline's code runs: an older installation, a
checkout on ``PYTHONPATH``, or a git worktree of the base commit (docs/compare.md).

The protocol, one JSON object a line on the worker's stdout (anything else there is skipped):
``{"pair_worker": 1, "variants": [...], "bm_version": ...}`` once ready, then
``{"variant": NAME, "metrics": {...}}`` per run, or ``{"variant": NAME, "error": "..."}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from bm.bench.results import json_safe
from bm.compare.variants import Variant

PROTOCOL = 1
READY_KEY = "pair_worker"
CLOSE_WAIT_S = 30.0  # how long a worker may take to end once its input closes
POLL_S = 0.25  # how often a wait on the worker looks at the stop event


class PairingError(RuntimeError):
    """The baseline's command could not run a round; the gate falls back to the saved timings."""


def worker_config(config: Mapping[str, Any], cwd: Path) -> dict[str, Any]:
    """The baseline's recorded config with its file paths made absolute (against this run's working
    directory, where the worker runs), so the worker reads the files this run reads however its
    config file's folder is named."""
    data = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    for section, keys in (("model", ("path", "config", "tokenizer")), ("bench", ("dataset",))):
        values = data.get(section)
        if not isinstance(values, dict):
            continue
        for key in keys:
            value = values.get(key)
            if isinstance(value, str) and value and not Path(value).is_absolute() and (cwd / value).exists():
                values[key] = str(cwd / value)
    return data


def worker_argv(command: str, config_path: Path, variants: Sequence[Mapping[str, Any]]) -> list[str]:
    """The worker's command line: ``command`` (split as a shell would) and ``compare --pair-worker``
    with the baseline's variants (each ``{"name", "kind", "batching_scheme", "scheduler_policy"}``)."""
    schemes = [v["batching_scheme"] for v in variants if v.get("kind", "bm") == "bm"]
    policies = [v["scheduler_policy"] for v in variants if v.get("kind", "bm") == "bm"]
    baselines = [v["name"] for v in variants if v.get("kind") == "baseline"]
    argv = [*shlex.split(command), "compare", "--pair-worker", "--quiet", "-c", str(config_path)]
    argv += ["--schemes", ",".join(dict.fromkeys(schemes)), "--policies", ",".join(dict.fromkeys(policies))]
    if baselines:
        argv += ["--baselines", ",".join(baselines)]
    return argv


class BaselineWorker:
    """A running baseline worker: :meth:`start` it, :meth:`run` a variant on it, :meth:`close` it."""

    def __init__(self, command: str, process: subprocess.Popen[bytes], log: Path, workdir: Path) -> None:
        self.command = command
        self.process = process
        self.log = log
        self._workdir = workdir
        self._pending = b""  # what the worker wrote past the last whole line read
        self.variants: list[str] = []
        self.bm_version: str | None = None

    @classmethod
    def spawn(cls, command: str, baseline: Mapping[str, Any]) -> BaselineWorker:
        """Start the worker on the baseline document's config and variants; it loads its model while
        this process loads its own (:meth:`ready` waits for it). Raises :class:`PairingError` when the
        command cannot start."""
        workdir = Path(tempfile.mkdtemp(prefix="bm-pair-"))
        config_path = workdir / "baseline-config.json"
        config_path.write_text(json.dumps(worker_config(baseline.get("config") or {}, Path.cwd())))
        described = [{"name": n, **v} for n, v in baseline["variants"].items()]
        argv = worker_argv(command, config_path, described)
        log = workdir / "worker.log"
        try:
            with log.open("wb") as err:
                process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        except (OSError, ValueError) as exc:
            shutil.rmtree(workdir, ignore_errors=True)
            raise PairingError(f"--baseline-cmd {command!r} could not start: {exc}") from None
        return cls(command, process, log, workdir)

    def ready(
        self, expected: Sequence[Variant], stop: threading.Event | None = None, timeout_s: float | None = None
    ) -> None:
        """Wait, at most ``timeout_s``, until the worker has loaded and says which variants it runs.
        Raises :class:`PairingError`, naming the cause and the worker's last words, when it exits (an
        older bm without ``--pair-worker`` refuses the flag), speaks another protocol or names other
        variants; the worker is closed then."""
        try:
            ready = self._read(stop, timeout_s, "ready")
            if ready.get(READY_KEY) != PROTOCOL:
                raise PairingError(
                    f"--baseline-cmd {self.command!r} speaks another pairing protocol: {ready}"
                )
            self.variants = [str(v) for v in ready.get("variants", [])]
            self.bm_version = ready.get("bm_version")
            if sorted(self.variants) != sorted(v.name for v in expected):
                raise PairingError(
                    f"--baseline-cmd {self.command!r} runs {', '.join(self.variants)}, not this run's "
                    f"{', '.join(v.name for v in expected)}"
                )
        except PairingError:
            self.close()
            raise

    def run(self, variant: Variant, stop: threading.Event | None = None) -> dict[str, Any]:
        """One run of ``variant`` on the baseline's code; its metrics, as ``bm compare`` records them."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.write((json.dumps({"run": variant.name}) + "\n").encode())
            self.process.stdin.flush()
        except (OSError, ValueError):
            raise PairingError(
                f"the baseline's worker ended before running {variant.name}{self._last_words()}"
            ) from None
        answer = self._read(stop, None, f"done with {variant.name}")
        if "error" in answer:
            raise PairingError(f"the baseline's worker failed to run {variant.name}: {answer['error']}")
        metrics = answer.get("metrics")
        if answer.get("variant") != variant.name or not isinstance(metrics, dict):
            raise PairingError(f"the baseline's worker answered {str(answer)[:200]} for {variant.name}")
        return metrics

    def close(self) -> None:
        """Close its input (the worker ends at once), wait a bounded time, then end it by its id."""
        process = self.process
        with contextlib.suppress(OSError, ValueError):
            if process.stdin is not None:
                process.stdin.close()
        try:
            process.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _read(self, stop: threading.Event | None, timeout_s: float | None, what: str) -> dict[str, Any]:
        """The worker's next JSON line; lines that are not JSON objects are skipped. Read from the
        pipe's descriptor directly, so no line waits in a buffer that ``select`` cannot see."""
        out = self.process.stdout
        assert out is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            while b"\n" not in self._pending:
                if not _wait_readable(out.fileno(), stop, deadline):
                    why = "the gate was stopped" if stop is not None and stop.is_set() else "it took too long"
                    raise PairingError(f"the baseline's worker was not {what}: {why}")
                chunk = os.read(out.fileno(), 1 << 16)
                if not chunk:
                    words = self._last_words()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.process.wait(CLOSE_WAIT_S)
                    raise PairingError(
                        f"--baseline-cmd {self.command!r} exited (code {self.process.returncode}) before "
                        f"it was {what}{words}"
                    )
                self._pending += chunk
            line, _, self._pending = self._pending.partition(b"\n")
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict):
                return data

    def _last_words(self) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return f"; it said: {lines[-1][:300]}" if lines else ""


def _wait_readable(fd: int, stop: threading.Event | None, deadline: float | None) -> bool:
    """Until ``fd`` has data or its end (True), or ``stop`` is set or ``deadline`` passes (False)."""
    while True:
        if stop is not None and stop.is_set():
            return False
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        ready, _, _ = select.select([fd], [], [], POLL_S if left is None else min(POLL_S, left))
        if ready:
            return True


def serve(
    variants: Sequence[Variant],
    run: Any,
    stdin: IO[str],
    stdout: IO[str],
    version: str,
    stop: threading.Event | None = None,
) -> None:
    """The worker's loop (``bm compare --pair-worker``): announce itself, then for each ``{"run": NAME}``
    line run that variant (``run(variant) -> metrics``) and answer, until the input closes or ``stop``."""
    by_name = {v.name: v for v in variants}
    _send(stdout, {READY_KEY: PROTOCOL, "variants": list(by_name), "bm_version": version, "pid": os.getpid()})
    for line in stdin:
        if stop is not None and stop.is_set():
            return
        try:
            name = json.loads(line).get("run")
        except (ValueError, AttributeError):
            _send(stdout, {"variant": None, "error": f"not a request: {line.strip()[:80]}"})
            continue
        if name not in by_name:
            _send(stdout, {"variant": name, "error": f"no variant {name!r} here ({', '.join(by_name)})"})
            continue
        _send(stdout, {"variant": name, "metrics": json_safe(run(by_name[name]))})


def _send(stdout: IO[str], data: Mapping[str, Any]) -> None:
    stdout.write(json.dumps(data, allow_nan=False, default=str) + "\n")
    stdout.flush()
