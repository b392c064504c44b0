"""How busy the machine was with other work while a run was timed: the baseline gate's load meter.

A timing gate cannot tell a slower engine from a machine that other processes slowed: both give a lower
throughput, and on a shared 2-core machine one busy process elsewhere made bm's repeats up to 3.5x slower
(its OpenMP team waits on a thread that shares a core). What it can tell is whether the machine was
shared at all: the kernel counts every CPU tick, and the ticks this process did not spend went to others.
:func:`background_share` is that fraction over a run; the gate judges timings on the repeats that ran
alone (:data:`QUIET_SHARE`) and says when none did, instead of calling the load a regression.

Linux only (``/proc``); elsewhere the share is unknown (None) and every repeat counts as quiet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Repeats during which other processes used at most this fraction of the machine's CPU time are quiet:
# 5% of a 2-core machine is a tenth of a core, what a CI runner's agent and the kernel use at rest.
QUIET_SHARE = 0.05
# The key of a repeat's metrics that holds its share (None: unknown).
BACKGROUND_SHARE = "background_cpu_share"


@dataclass(frozen=True)
class CpuTicks:
    """The machine's busy and total CPU ticks since boot, and this process's own (all threads)."""

    busy: int
    total: int
    own: int


def read_ticks(proc: Path = Path("/proc")) -> CpuTicks | None:
    """Now's tick counts from ``/proc/stat`` and ``/proc/self/stat``; None where they cannot be read."""
    try:
        fields = (proc / "stat").read_text().split("\n", 1)[0].split()
        own = (proc / "self" / "stat").read_text()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    # user nice system idle iowait irq softirq steal: steal (a hypervisor's other guests) is others' too
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    busy = user + nice + system + irq + softirq + steal
    # the command name may hold spaces: the fields after its closing parenthesis are fixed
    after = own[own.rindex(")") + 2 :].split()
    utime, stime = int(after[11]), int(after[12])  # fields 14 and 15 of proc(5), counted from 1
    return CpuTicks(busy, busy + idle + iowait, utime + stime)


def background_share(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """The fraction of the machine's CPU time between two readings that went to other processes (0 to
    1); None when unknown or too short to count (under one tick of the machine)."""
    if before is None or after is None:
        return None
    total = after.total - before.total
    if total <= 0:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return min(1.0, max(0.0, others / total))


def is_quiet(share: float | None) -> bool:
    """Whether a repeat ran alone enough for its timings to be judged (unknown counts as quiet)."""
    return share is None or share <= QUIET_SHARE
