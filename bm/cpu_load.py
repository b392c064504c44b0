"""How much of the machine's CPU other processes are using, from the kernel's tick counts (no torch).

The kernel counts every CPU tick since boot (``/proc/stat``) and this process's own (``/proc/self/stat``,
all threads): between two readings, the busy ticks that were not this process's went to others. Two
users: ``bm compare --baseline`` judges timings only on repeats that had the machine to themselves
(bm.compare.load), and the CPU engine computes on fewer threads while other processes hold cores
(bm.runtime.threads.ThreadGovernor). Linux only; elsewhere every reading is None (unknown).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
