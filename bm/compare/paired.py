"""Timings judged on paired measurements: the baseline's code and this run's, alternated in one sitting.

A saved baseline's timings were measured at another time, under another load: on a shared runner no
margin separates a slower engine from a busier machine, and filtering for quiet repeats (bm.compare.load)
leaves nothing to judge where the machine is never quiet. Pairing takes the machine out instead: each
round runs a variant on the baseline's code (``--baseline-cmd``, a worker process) and on this run's
code back to back, the order alternating from round to round, so the load of that moment lands on both
halves of the pair. What is judged is the ratio within each pair.

For each variant and timing metric, round ``r`` gives ``d_r = ln(this run / baseline)``, signed so that a
positive ``d`` is worse (throughputs are inverted). The figure reported is the median ratio
``exp(median d) - 1``, and its one-sided bounds come from the sign test: the median lies above the
``k``-th smallest ``d`` with confidence ``c`` when at most ``1 - c`` of samples of ``n`` fair coin flips
give fewer than ``k`` heads (no assumption about how load is distributed, so a burst that hit one half of
one pair moves one ``d``, not the verdict). With ``t = ln(1 + tolerance)``:

- **regressed** when the lower bound at 99.9% is above ``t``;
- **held** when the upper bound at 95% is at most ``t``;
- **unsettled** otherwise: the gate runs more rounds, up to ``--max-repeat`` and ``--time-limit``, and a
  timing still unsettled then is *not judged*, which fails the gate with its own exit code unless
  ``--allow-unjudged``.

The two levels differ because the gate fails on *any* timing and passes only on *all*: a variant has
nine timings, so unchanged code must clear nine chances to fail. At 95% each, five pairs that all
happened to lean one way failed unchanged code once in three gated runs under load 15 on two cores (three
timings 13-44% "worse", every pair's load 82-90% others'); at 99.9% the nine together fail unchanged
code under 1% of the time, so ten runs in a row pass. A real slowdown moves every timing at once, so
95% on each is ample for a pass. Ten pairs are the fewest that can show a regression (all ten worse
than ``t``: 1/1024), five the fewest that can show a pass; more pairs narrow both bounds as the square
root of their number, whatever the load, as long as it hits both halves alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bm.compare.regress import HIGHER_IS_BETTER, TIMING_METRICS, BaselineVerdict, Regression, TimingCheck

HELD_CONFIDENCE = 0.95  # one-sided: a timing no worse than the tolerance (all must hold to pass)
REGRESSED_CONFIDENCE = 0.999  # one-sided: a timing worse than the tolerance (any one fails the gate)


def sign_test_rank(n: int, confidence: float) -> int:
    """The largest ``k`` (1-based) with P(Binomial(n, 1/2) < k) <= 1 - confidence: the median of the
    population lies above the ``k``-th smallest of ``n`` samples with that confidence; 0 when no
    ``k`` does (too few samples)."""
    k, below = 0, 0.0
    while k < n:
        below += math.comb(n, k) / 2**n  # P(X = k), added: P(X <= k) = P(X < k + 1)
        if below > 1 - confidence:
            break
        k += 1
    return k


def paired_check(
    variant: str, metric: str, baseline: Sequence[float], current: Sequence[float], tolerance: float
) -> TimingCheck | None:
    """One timing judged on its pairs (``baseline[r]`` and ``current[r]`` from round ``r``); None when
    the metric has no positive figure in every pair (a rate that can be 0, a metric the run lacks)."""
    if not baseline or len(baseline) != len(current):
        return None
    if not all(_positive(x) for x in (*baseline, *current)):
        return None
    sign = -1.0 if metric in HIGHER_IS_BETTER else 1.0
    worse = sorted(sign * math.log(c / b) for b, c in zip(baseline, current, strict=True))
    n = len(worse)
    k_low, k_high = sign_test_rank(n, REGRESSED_CONFIDENCE), sign_test_rank(n, HELD_CONFIDENCE)
    low = worse[k_low - 1] if k_low else -math.inf
    high = worse[n - k_high] if k_high else math.inf
    limit = math.log1p(tolerance)
    regressed, held = low > limit, high <= limit
    return TimingCheck(
        variant, metric, statistics.median(baseline), statistics.median(current),
        math.expm1(statistics.median(worse)), tolerance, 0.0, 0.0,
        pairs=n, low=_expm1(low), high=_expm1(high), unsettled=not (regressed or held),
    )  # fmt: skip


Repeats = Sequence[Mapping[str, Any]]


def paired_verdict(
    saved: BaselineVerdict, pairs: Mapping[str, tuple[Repeats, Repeats]], tolerance: float
) -> BaselineVerdict:
    """``saved`` (the counters, judged exactly against the saved baseline) with its timings judged on
    ``pairs`` instead: ``{variant: (baseline side's repeats, this run's repeats)}``, metrics per round."""
    regressions = [r for r in saved.regressions if r.kind != "timing"]
    checks: list[TimingCheck] = []
    for name, (theirs, ours) in pairs.items():
        rounds = min(len(theirs), len(ours))
        for metric in TIMING_METRICS:
            check = paired_check(
                name, metric, [r.get(metric) for r in theirs[:rounds]],
                [r.get(metric) for r in ours[:rounds]], tolerance,
            )  # fmt: skip
            if check is None:
                continue
            checks.append(check)
            if check.regressed:
                verb = "fell" if metric in HIGHER_IS_BETTER else "rose"
                regressions.append(
                    Regression(
                        name, metric, check.previous, check.current, "timing",
                        f"{verb} {check.previous:.4g} -> {check.current:.4g} over {rounds} paired rounds "
                        f"({check.worse_by:.1%} worse, at least {check.low:.1%} with 99.9% confidence; tolerance "
                        f"{tolerance:.0%})",
                    )
                )  # fmt: skip
    return BaselineVerdict(regressions, checks)


def paired_rounds_to_settle(verdict: BaselineVerdict, repeat: int, done: int, most: int) -> int:
    """More paired rounds while a timing is unsettled and none has regressed yet (a regression at
    99.9% is the answer already), up to ``most`` rounds in all."""
    if any(c.regressed for c in verdict.timing_checks):
        return 0
    if not any(c.unsettled for c in verdict.timing_checks):
        return 0
    return max(0, min(repeat, most - done))


def unsettled_note(checks: Sequence[TimingCheck], elapsed_s: float) -> str | None:
    """Timings whose pairs left the tolerance inside their bounds: said, with the widest, so a gate that
    could not decide is not read as a pass (the exit code says it too)."""
    open_ = [c for c in checks if c.unsettled]
    if not open_:
        return None
    widest = max(open_, key=lambda c: (c.high or 0.0) - (c.low or 0.0))
    return (
        f"note: {len(open_)} timing(s) not judged: after {widest.pairs} paired round(s) in {elapsed_s:.0f} s "
        f"the machine's noise still leaves the tolerance between their bounds (widest: "
        f"{widest.variant}.{widest.metric}, {_pct(widest.low)} to {_pct(widest.high)} worse); run the "
        "gate on a less busy machine, raise --time-limit or --max-repeat, or gate on the simulator "
        "(docs/compare.md)"
    )


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0 and math.isfinite(x)


def _expm1(x: float) -> float:
    return math.expm1(x) if math.isfinite(x) else x


def _pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "unbounded" if x is not None else "?"
    return f"{x:+.1%}"
