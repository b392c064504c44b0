"""Regression checks of a comparison against a saved one (``bm compare --baseline PREV.json``).

Two kinds of figure, two rules.

**Counters** that a deterministic run reproduces exactly (tokens, completed requests, and, when every
request arrives at t=0, the engine's iterations, computed and padded token slots, empty generation slots,
pauses, batch shapes and KV blocks) must match exactly: a difference is a behaviour change, not noise,
whatever its size.

**Timings** are judged against the noise the two runs measured, on the repeats that had the machine to
themselves (bm.compare.load: other processes took at most 5% of the CPU). Other load only ever slows a
run down; the quiet filter takes it out, and what is left moves both ways (on a 2-core VM, undisturbed
repeats of one run spread from 14,000 to 23,000 tok/s, with stretches of 40 s or more 20-25% slow). So
each run's figure is its *median* quiet repeat, held against the baseline's: a typical repeat against
a typical repeat, whatever the number of repeats on each side. (Best against best failed unchanged code
whenever this run had fewer quiet repeats than the baseline; this run's best against the baseline's
median let a planted 30% slowdown through once 30 repeats gave it a lucky one.) A run's *spread* is how
far its median repeat is from its best: how much one repeat moves on this machine now. A timing
regressed only when the new median is worse than the saved median by more than
``max(tolerance, noise_factor x the larger of the two spreads)``: a quiet machine is held to the
tolerance, a noisy one to what its noise allows, and the margin used is reported
with every check, so a gate too noisy to see a slowdown says so instead of crying wolf. Before it reports
a timing regression, or when the noise left a margin wider than the tolerance, ``bm compare`` measures
more rounds (up to ``--max-repeat``) and judges again (:func:`rounds_to_settle`): load comes and goes, a
slowdown in the code stays. ``--repeat 1 --noise-factor 0 --max-repeat 1`` is the old rule (one figure
within a fixed tolerance).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bm.bench.tally import StatsTally
from bm.compare.load import QUIET_SHARE, is_quiet

# Always exact: they do not depend on timing.
EXACT_ALWAYS = ("num_requests", "completed", "failed", "total_input_tokens", "total_output_tokens")
# Exact when arrivals do not depend on the wall clock (all at t=0); otherwise timing shifts batches.
# Each is a pure function of the workload and the configuration under offline arrivals.
EXACT_IF_OFFLINE = (
    "num_iterations",
    "total_computed_tokens",
    "total_padded_context_tokens",
    "total_empty_generation_slots",
    "num_paused_requests",
    "total_pauses",
    "max_paused_per_iteration",
    "mean_requests_per_iteration",
    "mean_tokens_per_iteration",
    "mean_computed_tokens_per_iteration",
    "max_used_kv_blocks",
    "total_used_kv_block_iterations",
    "mean_kv_cache_utilization",
    "max_kv_cache_utilization",
    "total_draft_tokens",
    "total_accepted_draft_tokens",
)
HIGHER_IS_BETTER = ("output_throughput", "request_throughput", "total_token_throughput", "request_goodput")
LOWER_IS_BETTER = tuple(
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "e2el") for stat in ("median", "p99")
)
TIMING_METRICS = HIGHER_IS_BETTER + LOWER_IS_BETTER

# Repeats a comparison runs by default when it is judged against a baseline (one otherwise): enough for
# the best of them to dodge a burst of other load, and for the spread to mean something.
BASELINE_REPEATS = 5
# How many spreads of noise a timing may move before it is called a regression: one, as the spread is
# already a typical repeat's distance from the best (a planted 30% slowdown moves throughput 23%).
NOISE_FACTOR = 1.0


def kv_block_counters(iterations: StatsTally) -> dict[str, int]:
    """The KV blocks a run held, from its per-iteration stats: the peak, and the sum over iterations
    (block-iterations). Both are exact under offline arrivals, so ``--baseline`` catches a change in
    how many blocks the same workload needs."""
    return iterations.kv_block_counters()


class ToleranceError(ValueError):
    pass


def parse_tolerance(text: str) -> float:
    """``10%`` or ``0.1`` -> 0.1; anything else names the accepted forms. Large values are allowed: a
    gate on counters alone uses a huge timing tolerance."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*", text)
    if not m:
        raise ToleranceError(f"--tolerance {text!r}: write a percentage like 10% or a fraction like 0.1")
    return float(m.group(1)) / (100 if m.group(2) else 1)


def parse_noise_factor(value: float) -> float:
    """``--noise-factor``: a finite number at least 0 (0 judges timings by the tolerance alone)."""
    if not value >= 0 or value == float("inf"):
        raise ToleranceError(
            f"--noise-factor {value}: give a number at least 0 (2 is the default; 0 judges timings "
            "by --tolerance alone)"
        )
    return float(value)


@dataclass(frozen=True)
class TimingSummary:
    """One timing metric over a run's repeats: the figure judged (``best``) and the noise around it."""

    best: float
    median: float
    low: float
    high: float
    spread: float  # |median - best| / best: how far a typical repeat is from the best; 0 for one repeat
    repeats: int
    # Of the repeats, those that ran alone (bm.compare.load): the figures above are theirs when there
    # are any, else every repeat's, and the timing is then not judged.
    quiet: int | None = None
    busiest: float | None = None  # the largest share of the CPU other processes took during a repeat

    @property
    def judgeable(self) -> bool:
        return self.quiet is None or self.quiet > 0

    @property
    def quiet_count(self) -> int:
        """The repeats the figures come from (every repeat when none was quiet or load is unknown)."""
        return self.quiet or self.repeats

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "spread": self.spread,
            "repeats": self.repeats,
            "quiet_repeats": self.quiet,
            "busiest_background_share": self.busiest,
        }


def summarize_timing(
    metric: str, values: Sequence[float | None], shares: Sequence[float | None] | None = None
) -> TimingSummary | None:
    """The best repeat, the median, the range and the relative spread (median against best) of
    ``values``, one per repeat; None when any repeat has no figure (a metric the run does not measure).

    ``shares``: the CPU share other processes took during each repeat (None: unknown). The figures are
    then those of the quiet repeats (:func:`bm.compare.load.is_quiet`), or of every repeat, marked not
    judgeable, when none was quiet."""
    numbers = [v for v in values if _num(v)]
    if not numbers or len(numbers) != len(values):
        return None
    quiet: int | None = None
    busiest: float | None = None
    if shares is not None:
        known = [s for s in shares if s is not None]
        busiest = max(known, default=None)
        calm = [v for v, s in zip(numbers, shares, strict=True) if is_quiet(s)]
        quiet = len(calm)
        numbers = calm or numbers
    higher = metric in HIGHER_IS_BETTER
    ranked = sorted(numbers, reverse=higher)  # best first
    best = ranked[0]
    median = statistics.median(numbers)
    spread = abs(median - best) / abs(best) if best else 0.0
    return TimingSummary(best, median, min(numbers), max(numbers), spread, len(values), quiet, busiest)


def timing_margin(tolerance: float, noise_factor: float, spreads: Sequence[float]) -> float:
    """The relative change a timing may show before it counts: the tolerance, or the measured noise
    times ``noise_factor`` when that is larger."""
    return max(tolerance, noise_factor * max(spreads, default=0.0))


@dataclass(frozen=True)
class Regression:
    variant: str
    metric: str
    previous: Any
    current: Any
    kind: str  # "counter" | "timing" | "missing"
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def message(self) -> str:
        return f"{self.variant}.{self.metric}: {self.detail}"


@dataclass(frozen=True)
class TimingCheck:
    """One timing judged against the baseline, passed or not: what the gate could and could not see."""

    variant: str
    metric: str
    previous: float
    current: float
    worse_by: float  # relative change in the direction that is worse (negative: better)
    margin: float
    previous_spread: float
    current_spread: float
    # Not judged: every repeat of one run shared the machine with other work (which side says why).
    busy_side: str | None = None
    busy_share: float | None = None
    # Judged on pairs (bm.compare.paired): how many, the one-sided bounds of worse_by (low at 99.9%,
    # high at 95%), and whether they still straddle the tolerance (not judged, like a busy side).
    pairs: int | None = None
    low: float | None = None
    high: float | None = None
    unsettled: bool = False
    # The simulator's timings: the same bits every run, so any change either way is one (like a counter).
    exact: bool = False

    @property
    def judged(self) -> bool:
        return self.busy_side is None and not self.unsettled

    @property
    def regressed(self) -> bool:
        if self.exact:
            return self.previous != self.current
        return self.judged and self.worse_by > self.margin

    @property
    def improved(self) -> bool:
        """Better than the baseline beyond the margin: a speed-up, or a baseline measured under load."""
        return self.judged and not self.exact and -self.worse_by > self.margin

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"regressed": self.regressed, "improved": self.improved, "judged": self.judged}


@dataclass
class BaselineVerdict:
    regressions: list[Regression]
    timing_checks: list[TimingCheck]

    def widest_margin(self) -> float | None:
        return max((c.margin for c in self.timing_checks if c.judged), default=None)


def busy_machine_note(checks: Sequence[TimingCheck]) -> str | None:
    """Timings a gate could not judge because no repeat of one run had the machine to itself: said,
    so a pass is not read as timings that held (the counters were still compared exactly)."""
    busy = [c for c in checks if not c.judged]
    if not busy:
        return None
    sides = sorted({side for c in busy for side in (c.busy_side or "").split(" and ") if side})
    share = max((c.busy_share for c in busy if c.busy_share is not None), default=None)
    took = f" (other processes took up to {share:.0%} of the CPU)" if share is not None else ""
    fix = (
        "save the baseline again on a quiet machine"
        if sides == ["baseline"]
        else "run the gate when nothing else runs, or raise --max-repeat to wait for a quiet spell"
    )
    who = " or ".join("the baseline" if side == "baseline" else side for side in sides)
    return (
        f"note: {len(busy)} timing(s) not judged: no repeat of {who} ran alone "
        f"(others at most {QUIET_SHARE:.0%} of the CPU){took}; counters were compared; {fix}"
    )


def slow_baseline_note(checks: Sequence[TimingCheck]) -> str | None:
    """A gate is one-sided: a baseline measured while other load slowed it passes any run, a slowed one
    included. When timings beat the baseline beyond their margins, say so, so a stale or loaded
    baseline is re-saved instead of trusted."""
    better = [c for c in checks if c.improved]
    if not better:
        return None
    most = max(better, key=lambda c: -c.worse_by)
    return (
        f"note: {len(better)} timing(s) beat the baseline beyond their margins "
        f"(most: {most.variant}.{most.metric} {most.previous:.4g} -> {most.current:.4g}); unless the code "
        "got faster, the baseline was measured on a loaded machine and would let a slowdown through: "
        "save it again (bm compare --repeat 5 -o DIR)"
    )


def find_regressions(
    previous: Mapping[str, Any],
    current: Mapping[str, Any],
    tolerance: float,
    noise_factor: float = NOISE_FACTOR,
) -> list[Regression]:
    """The regressions of ``current`` against ``previous`` (see :func:`judge`)."""
    return judge(previous, current, tolerance, noise_factor).regressions


def judge(
    previous: Mapping[str, Any],
    current: Mapping[str, Any],
    tolerance: float,
    noise_factor: float = NOISE_FACTOR,
) -> BaselineVerdict:
    """Compare two ``compare.json`` documents variant by variant: counters exactly, timings against
    the larger of the two runs' measured noise (module docstring).

    A variant of the saved run that is missing now is a regression (the gate would silently stop
    checking it); a new variant is not. A saved document without per-repeat timings (an older bm) is
    read as one repeat of its medians."""
    found: list[Regression] = []
    checks: list[TimingCheck] = []
    prev_variants = previous.get("variants", {})
    cur_variants = current.get("variants", {})
    offline = bool(previous.get("offline_arrivals")) and bool(current.get("offline_arrivals"))
    simulated = is_simulated(previous) and is_simulated(current)
    for name, prev in prev_variants.items():
        if name not in cur_variants:
            found.append(
                Regression(name, "*", "present", "absent", "missing", "variant missing from this run")
            )
            continue
        cur = cur_variants[name]
        pm, cm = prev.get("metrics", {}), cur.get("metrics", {})
        exact = EXACT_ALWAYS + (EXACT_IF_OFFLINE if offline else ())
        for metric in exact:
            if metric in pm and pm[metric] is not None and cm.get(metric) != pm[metric]:
                found.append(
                    Regression(
                        name, metric, pm[metric], cm.get(metric), "counter",
                        f"counter changed {pm[metric]} -> {cm.get(metric)} (must match exactly)",
                    )
                )  # fmt: skip
        for metric in TIMING_METRICS:
            p, c = _timing(prev, metric), _timing(cur, metric)
            if p is None or c is None or p.best <= 0:
                continue
            if simulated:
                check, regression = _simulated_timing(name, metric, p.median, c.median)
                checks.append(check)
                found += [regression] if regression is not None else []
                continue
            higher = metric in HIGHER_IS_BETTER
            # typical quiet repeat against typical quiet repeat (module docstring)
            ref, now = p.median, c.median
            worse_by = (ref - now) / ref if higher else (now - ref) / ref
            margin = timing_margin(tolerance, noise_factor, (p.spread, c.spread))
            busy = [(side, t) for side, t in (("baseline", p), ("this run", c)) if not t.judgeable]
            check = TimingCheck(
                name, metric, ref, now, worse_by, margin, p.spread, c.spread,
                busy_side=" and ".join(side for side, _ in busy) or None,
                busy_share=max((t.busiest for _, t in busy if t.busiest is not None), default=None),
            )  # fmt: skip
            checks.append(check)
            if check.regressed:
                verb = "fell" if higher else "rose"
                found.append(
                    Regression(
                        name, metric, ref, now, "timing",
                        f"{verb} {ref:.4g} -> {now:.4g} (median of {p.quiet_count} -> median of {c.quiet_count}; "
                        f"{worse_by:.1%} worse, margin {_margin_text(margin, tolerance, noise_factor, p, c)})",
                    )
                )  # fmt: skip
    return BaselineVerdict(found, checks)


def is_simulated(document: Mapping[str, Any]) -> bool:
    """Whether a ``compare.json`` was measured by the simulator (virtual time: the same bits every run)."""
    config = document.get("config")
    engine = config.get("engine") if isinstance(config, Mapping) else None
    return isinstance(engine, Mapping) and engine.get("executor") == "sim"


def _simulated_timing(
    name: str, metric: str, ref: float, now: float
) -> tuple[TimingCheck, Regression | None]:
    """A simulated timing, held to the baseline's exactly: the simulator's clock is virtual, so the
    same code, config and workload give the same bits, and any change is the code's."""
    worse_by = (ref - now) / ref if metric in HIGHER_IS_BETTER else (now - ref) / ref
    check = TimingCheck(name, metric, ref, now, worse_by, 0.0, 0.0, 0.0, exact=True)
    if ref == now:
        return check, None
    detail = (
        f"simulated timing changed {ref!r} -> {now!r} ({worse_by:+.2%} worse; the simulator gives the "
        "same bits every run: must match exactly)"
    )
    return check, Regression(name, metric, ref, now, "timing", detail)


def rounds_to_settle(
    verdict: BaselineVerdict, tolerance: float, noise_factor: float, repeat: int, done: int, most: int
) -> int:
    """How many more rounds the gate runs before it answers: none when the verdict is settled (no timing
    regression, and this run's own noise small enough that the tolerance decides), else another
    ``repeat`` rounds, up to ``most`` in all. Only this run's noise counts here: more rounds cannot
    quiet the baseline's. A regression reported is one that survived re-measuring; a pass under heavy
    noise is reported with its margin."""
    unsettled = any(
        c.regressed or noise_factor * c.current_spread > tolerance or "this run" in (c.busy_side or "")
        for c in verdict.timing_checks
    )
    return max(0, min(repeat, most - done)) if unsettled else 0


def _timing(variant: Mapping[str, Any], metric: str) -> TimingSummary | None:
    """A variant's timing summary from its ``timings`` section, else its median as a single repeat."""
    saved = variant.get("timings", {}).get(metric)
    if isinstance(saved, Mapping) and all(_num(saved.get(k)) for k in ("best", "median", "spread")):
        quiet, busiest = saved.get("quiet_repeats"), saved.get("busiest_background_share")
        return TimingSummary(
            float(saved["best"]), float(saved["median"]), float(saved.get("min", saved["best"])),
            float(saved.get("max", saved["best"])), float(saved["spread"]), int(saved.get("repeats", 1)),
            int(quiet) if _num(quiet) else None, float(busiest) if _num(busiest) else None,
        )  # fmt: skip
    value = variant.get("metrics", {}).get(metric)
    return summarize_timing(metric, [value]) if _num(value) else None


def _margin_text(
    margin: float, tolerance: float, noise_factor: float, p: TimingSummary, c: TimingSummary
) -> str:
    noise = max(p.spread, c.spread)
    if margin > tolerance:
        return f"{margin:.1%} = {noise_factor:g} x measured noise {noise:.1%}"
    return f"{margin:.1%} = tolerance; measured noise {noise:.1%}"


def _num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
