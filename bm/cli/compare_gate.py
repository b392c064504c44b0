"""``bm compare --baseline``'s gate on the command line: what it checks before the run, how it decides
to measure more, how it judges and which code it exits with, and the worker side of a paired gate.

The rules themselves live in :mod:`bm.compare` (regress: counters and saved timings; paired: timings on
pairs; identity: what a baseline must share with the run); this module wires them to the flags, the
terminal and the exit codes (docs/compare.md, docs/exit-codes.md).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from bm.cli.exit_codes import FAILED, NOT_JUDGED, OK
from bm.compare.identity import gate_identity, identity_differences, refusal
from bm.config import BmConfig, ConfigError
from bm.stderr import print_error

if TYPE_CHECKING:
    from bm.compare.pairing import BaselineWorker
    from bm.compare.regress import BaselineVerdict
    from bm.compare.runner import CompareResult
    from bm.compare.variants import Variant

# --time-limit's default: five minutes of measuring, a CI step's budget for a gate. A workload whose
# rounds take longer needs a larger one (a round cut short by the limit is dropped).
TIME_LIMIT_S = 300.0


def dataset_sha256(cfg: BmConfig) -> str | None:
    """The digest of the dataset file the run reads (None for synthetic data, a directory or a pipe)."""
    from bm.runfiles.outdir import file_digest

    path = Path(cfg.bench.dataset) if cfg.bench.dataset else None
    if path is None or cfg.bench.dataset_kind == "synthetic" or not path.is_file():
        return None
    try:
        return file_digest(path)
    except OSError:
        return None


def check_gate_flags(
    cfg: BmConfig,
    previous: Mapping[str, Any] | None,
    baseline: Path | None,
    variants: Sequence[Variant],
    baseline_cmd: str | None,
    time_limit: float,
) -> dict[str, Any]:
    """The run's identity (recorded in compare.json); before it, every gate flag is checked and a
    baseline from another workload, config or set of variants is refused (ConfigError: exit 2)."""
    if not time_limit > 0:
        raise ConfigError(f"--time-limit {time_limit}: give the seconds of measuring, more than 0")
    if baseline_cmd is not None:
        if previous is None:
            raise ConfigError(
                "--baseline-cmd runs the baseline's code beside this run's: give --baseline too"
            )
        if cfg.engine.executor == "sim":
            raise ConfigError(
                "--baseline-cmd: not needed under --executor sim, whose timings are the same bits every "
                "run: the saved baseline's are gated exactly; drop --baseline-cmd"
            )
        if not baseline_cmd.strip():
            raise ConfigError("--baseline-cmd: empty; give the baseline's bm, e.g. ../base/.venv/bin/bm")
    identity = gate_identity(cfg, variants, dataset_sha256(cfg))
    if previous is not None:
        differences = identity_differences(previous, identity)
        if differences:
            raise ConfigError(refusal(str(baseline), differences))
    return identity


@dataclass
class Gate:
    """One ``--baseline`` gate: its settings, the worker of a paired gate, and the verdict so far."""

    previous: dict[str, Any]
    path: str
    tolerance: float
    noise_factor: float
    repeat: int
    most: int | None  # --max-repeat; None: the default of the timings judged (rounds_cap)
    time_limit: float
    simulated: bool
    worker: BaselineWorker | None = None
    deadline: float | None = None
    verdict: BaselineVerdict | None = field(default=None, repr=False)

    def start_clock(self) -> None:
        self.deadline = time.monotonic() + self.time_limit

    def paired(self, result: CompareResult) -> bool:
        return self.worker is not None and result.pairing_error is None

    def rounds_cap(self, result: CompareResult) -> int:
        """--max-repeat, else its default: none for pairs (every pair narrows the bounds, and
        --time-limit is the budget), 6 x --repeat for saved timings (more rounds only wait for a quiet
        spell)."""
        if self.most is not None:
            return self.most
        return sys.maxsize if self.paired(result) else 6 * self.repeat

    def judge(self, result: CompareResult) -> BaselineVerdict:
        """Counters exactly against the saved baseline; timings on the pairs, else the saved timings
        (exactly under the simulator)."""
        from bm.compare.paired import paired_verdict
        from bm.compare.regress import judge
        from bm.compare.runner import compare_document

        verdict = judge(self.previous, compare_document(result), self.tolerance, self.noise_factor)
        if self.paired(result):
            pairs = {o.variant.name: (o.paired, o.repeats) for o in result.variants}
            verdict = paired_verdict(verdict, pairs, self.tolerance)
        self.verdict = verdict
        return verdict

    def more_rounds(self, result: CompareResult, console: Console) -> int:
        """How many more rounds before the gate answers (none past the deadline or under the simulator)."""
        from bm.compare.paired import paired_rounds_to_settle
        from bm.compare.regress import rounds_to_settle

        if self.simulated:
            return 0
        if self.deadline is not None and time.monotonic() >= self.deadline:
            result.timed_out = True  # the limit came between rounds: said like one that cut a round
            return 0
        verdict = self.judge(result)
        if self.paired(result):
            more = paired_rounds_to_settle(verdict, self.repeat, result.repeat, self.rounds_cap(result))
            why = "the pairs left the tolerance between their bounds"
        else:
            more = rounds_to_settle(
                verdict,
                self.tolerance,
                self.noise_factor,
                self.repeat,
                result.repeat,
                self.rounds_cap(result),
            )
            suspect = sorted({f"{c.variant}.{c.metric}" for c in verdict.timing_checks if c.regressed})
            busy = any("this run" in (c.busy_side or "") for c in verdict.timing_checks)
            why = (
                f"{', '.join(suspect)} looked regressed" if suspect
                else "no repeat had the machine to itself" if busy
                else "the noise hid small changes"
            )  # fmt: skip
        if more:
            console.print(f"re-measuring: {why}; {more} more round(s)", highlight=False, soft_wrap=True)
        return more

    def apply(self, result: CompareResult) -> None:
        """The final verdict on the rounds as they ended, recorded on ``result`` for compare.json."""
        verdict = self.judge(result)
        result.baseline_path, result.tolerance = self.path, self.tolerance
        result.noise_factor = self.noise_factor
        result.regressions, result.timing_checks = verdict.regressions, verdict.timing_checks
        result.baseline_command = self.worker.command if self.worker is not None else None
        result.timings_from = "simulated" if self.simulated else "paired" if self.paired(result) else "saved"

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def start_worker(gate: Gate | None, command: str | None, console: Console) -> str | None:
    """Spawn the paired gate's worker (it loads while this process loads its model); on failure the gate
    goes on with the saved timings, said on the terminal, and the failure is returned for compare.json."""
    from bm.compare.pairing import BaselineWorker, PairingError

    if gate is None or command is None:
        return None
    try:
        gate.worker = BaselineWorker.spawn(command, gate.previous)
    except PairingError as exc:
        _no_pairing(console, str(exc))
        return str(exc)
    return None


def worker_ready(
    gate: Gate | None, variants: Sequence[Variant], console: Console, stop: threading.Event
) -> str | None:
    """Wait for the worker to load (at most --time-limit); on failure the gate goes on with the saved
    timings, said on the terminal, and the failure is returned for compare.json."""
    from bm.compare.pairing import PairingError

    if gate is None or gate.worker is None:
        return None
    try:
        gate.worker.ready(variants, stop, gate.time_limit)
    except PairingError as exc:
        gate.worker = None
        _no_pairing(console, str(exc))
        return str(exc)
    console.print(
        f"paired with the baseline's code: {gate.worker.command} (bm {gate.worker.bm_version}), "
        "alternated run by run",
        highlight=False,
        soft_wrap=True,
    )
    return None


def _no_pairing(console: Console, why: str) -> None:
    console.print(
        f"[yellow]note: timings will be judged against the saved baseline, not paired: {why}[/]",
        highlight=False,
        soft_wrap=True,
    )


def gate_exit_code(
    console: Console, result: CompareResult, failed_eval: Sequence[str], allow_unjudged: bool
) -> int:
    """Print the assertions' and the baseline gate's outcome; exit 1 when an assertion fails (or cannot
    be evaluated) or a regression is found, else 4 when a timing could not be judged (unless
    ``--allow-unjudged``), else 0."""
    from bm.compare.paired import unsettled_note
    from bm.compare.regress import busy_machine_note, slow_baseline_note
    from bm.compare.render import gate_rule

    bad = False
    for a in result.assertions:
        console.print(
            ("[green]" if a.passed else "[red]") + a.message + "[/]", highlight=False, soft_wrap=True
        )
        bad |= not a.passed
    for message in failed_eval:
        console.print(f"[red]FAILED: {message}[/]", highlight=False, soft_wrap=True)
        bad = True
    if result.baseline_path is None:
        return FAILED if bad else OK
    console.print(gate_rule(result), highlight=False, soft_wrap=True)
    notes = [
        busy_machine_note(result.timing_checks),
        unsettled_note(result.timing_checks, result.elapsed_s or 0),
    ]
    if result.timings_from == "saved":
        notes.append(slow_baseline_note(result.timing_checks))
    if result.timed_out:
        notes.append(f"note: --time-limit reached after {result.repeat} round(s); no run started after it")
    for note in notes:
        if note:
            console.print(f"[yellow]{note}[/]", highlight=False, soft_wrap=True)
    if result.regressions:
        for r in result.regressions:
            console.print(f"[red]regression: {r.message}[/]", highlight=False, soft_wrap=True)
        return FAILED
    unjudged = sum(not c.judged for c in result.timing_checks)
    if unjudged and not allow_unjudged:
        console.print(
            f"[red]not judged: {unjudged} timing(s) could not be judged against {result.baseline_path}; "
            f"the gate does not pass (exit {NOT_JUDGED}; --allow-unjudged passes it)[/]",
            highlight=False,
            soft_wrap=True,
        )
        return NOT_JUDGED if not bad else FAILED
    if bad:
        return FAILED
    passed = "no regressions" + (f" ({unjudged} timing(s) not judged, allowed)" if unjudged else "")
    console.print(f"[green]{passed} against {result.baseline_path}[/]", highlight=False)
    return OK


def serve_pairs(
    cfg: BmConfig,
    variants: Sequence[Variant],
    hf_batch_size: int,
    load: Callable[[BmConfig, Console], Any],
    interrupts: Any,
) -> int:
    """``bm compare --pair-worker``: the baseline's side of a paired gate (bm.compare.pairing). Loads the
    model and workload as ``bm compare`` does, then runs the variant named on each line of stdin and
    answers on stdout (the terminal output goes to stderr); ends when stdin closes."""
    import bm
    from bm.compare.pairing import serve
    from bm.compare.runner import run_variant
    from bm.compare.variants import variant_config

    err = Console(stderr=True)
    prepared = load_with_arrivals(load, cfg, err)
    if prepared is None:
        return 2
    cfg, loaded, workload, arrivals = prepared
    configs = {v.name: variant_config(cfg, v) for v in variants if v.kind == "bm"}
    interrupts.running()

    def run(variant: Variant) -> dict[str, Any]:
        config = configs.get(variant.name, cfg)
        return run_variant(config, loaded, workload, arrivals, variant, hf_batch_size=hf_batch_size,
                           stop=interrupts.stop)[0]  # fmt: skip

    serve(variants, run, sys.stdin, sys.stdout, bm.__version__, interrupts.stop)
    return 130 if interrupts.interrupted else 0


def load_with_arrivals(load: Callable[[BmConfig, Any], Any], cfg: BmConfig, console: Any) -> tuple | None:
    """``load(cfg, console)``'s (config, model, workload) and the workload's arrival times, or None once
    the reason is printed (exit 2): the gate's command and its pair worker load alike."""
    from bm.runtime import KVCacheSizeError
    from bm.workloads import DatasetError, arrival_times

    prepared = load(cfg, console)
    if prepared is None:
        return None
    cfg, loaded, workload = prepared
    try:
        return cfg, loaded, workload, arrival_times(workload, cfg.bench)
    except (DatasetError, ConfigError, KVCacheSizeError) as exc:
        print_error(str(exc))
        return None
