"""How busy the machine was with other work while a run was timed: the baseline gate's load meter.

A timing gate cannot tell a slower engine from a machine that other processes slowed: both give a lower
throughput, and on a shared 2-core machine one busy process elsewhere made bm's repeats up to 3.5x slower
(its OpenMP team waits on a thread that shares a core). What it can tell is whether the machine was
shared at all: the kernel counts every CPU tick, and the ticks this process did not spend went to others.
:func:`bm.cpu_load.background_share` is that fraction over a run; the gate judges timings on the repeats that ran
alone (:data:`QUIET_SHARE`) and says when none did, instead of calling the load a regression.

Linux only (``/proc``); elsewhere the share is unknown (None) and every repeat counts as quiet.
"""

from __future__ import annotations

# Repeats during which other processes used at most this fraction of the machine's CPU time are quiet:
# 5% of a 2-core machine is a tenth of a core, what a CI runner's agent and the kernel use at rest.
QUIET_SHARE = 0.05
# The key of a repeat's metrics that holds its share (None: unknown).
BACKGROUND_SHARE = "background_cpu_share"


def is_quiet(share: float | None) -> bool:
    """Whether a repeat ran alone enough for its timings to be judged (unknown counts as quiet)."""
    return share is None or share <= QUIET_SHARE
