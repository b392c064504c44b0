"""The SLO a point must meet, and the search for the highest load that meets it.

**SLO.** Each limit (ttft, tpot, itl, e2el, in ms) applies at one percentile (p99 by default), computed
the way ``bm bench`` computes its own percentiles (linear interpolation over completed requests; ITL
pooled over every gap). A point is feasible when every request completed and every limit holds.

**Search.** From a start load, a bracket: double while feasible, halve while not, until one feasible
and one infeasible load are known; then bisect (geometric midpoint: load spans orders of magnitude)
until the infeasible one is within ``precision`` of the feasible one. The answer is the highest
feasible load seen. The search is a state machine fed point by point, so a driver can run many
configurations' points in parallel and a resumed sweep can replay finished points without running them.

**Early stop.** Under the simulator a point is stopped as soon as enough requests have missed a limit
that the percentile must miss it too (:meth:`Slo.allowed_misses`); it is infeasible either way, so the
search is unchanged and only wall time is saved. Its metrics are then those of a partial run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bm.bench.tally import RequestTally
from bm.config import ConfigError

SLO_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Slo:
    limits: dict[str, float]  # name -> ms
    percentile: float = 99.0

    @classmethod
    def parse(cls, texts: list[str], percentile: float, from_config: Mapping[str, Any] | None = None) -> Slo:
        """``ttft=2000,tpot=100`` (repeatable; ``:`` works for ``=``) over the config's ``sweep.slo``."""
        limits: dict[str, float] = {}
        for name, value in (from_config or {}).items():
            limits[_slo_name(str(name), f"sweep.slo.{name}")] = _ms(value, f"sweep.slo.{name}")
        for text in texts:
            for part in text.replace(" ", ",").split(","):
                if not part:
                    continue
                name, sep, value = part.replace(":", "=").partition("=")
                if not sep:
                    raise ConfigError(f"--slo {part!r}: expected METRIC=MS, e.g. ttft=2000")
                limits[_slo_name(name.strip().lower(), f"--slo {part!r}")] = _ms(value, f"--slo {part!r}")
        if not limits:
            raise ConfigError("bm sweep: no SLO given; add e.g. --slo ttft=2000,tpot=100 (ms)")
        if not 0 < percentile <= 100:
            raise ConfigError(f"--percentile {percentile}: must be in (0, 100]")
        return cls(limits, float(percentile))

    def describe(self) -> str:
        return ", ".join(f"p{self.percentile:g} {k} <= {v:g} ms" for k, v in self.limits.items())

    def values(self, requests: RequestTally) -> dict[str, float | None]:
        """Each limited metric at the percentile, over the completed requests (None: no value)."""
        out: dict[str, float | None] = {}
        for name in self.limits:
            column = requests.completed(name).dropna()
            out[name] = None if column.empty else float(column.quantile(self.percentile / 100))
        return out

    def feasible(self, values: Mapping[str, float | None], failed: int) -> bool:
        return failed == 0 and all(
            values.get(name) is None or values[name] <= limit for name, limit in self.limits.items()
        )

    def allowed_misses(self, num_values: int) -> int:
        """Most values above a limit that still leave the percentile within it: with ``k`` the index
        below the percentile's position (linear interpolation), more than ``n - k - 1`` values above
        the limit put ``sorted[k]`` above it, and the percentile with it."""
        k = math.floor(self.percentile / 100 * (num_values - 1))
        return num_values - k - 1


def _slo_name(name: str, where: str) -> str:
    if name not in SLO_NAMES:
        raise ConfigError(f"{where}: unknown SLO metric {name!r}; use {', '.join(SLO_NAMES)}")
    return name


def _ms(value: Any, where: str) -> float:
    try:
        ms = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a number of milliseconds") from None
    if not ms > 0 or not math.isfinite(ms):
        raise ConfigError(f"{where}: must be a positive number of milliseconds, got {value!r}")
    return ms


class EarlyStop:
    """Watches a simulated replay's finished requests; says stop once the SLO is certainly missed.

    Only TTFT, TPOT and E2EL are watched (one value per request, so misses can be counted against
    :meth:`Slo.allowed_misses` over every request of the run); ITL is pooled and left to the end."""

    def __init__(self, slo: Slo, num_requests: int) -> None:
        self.limits = {k: v / 1e3 for k, v in slo.limits.items() if k != "itl"}  # seconds
        self.allowed = slo.allowed_misses(num_requests)
        self.misses: dict[str, set[int]] = {name: set() for name in self.limits}
        self.failed = 0

    def observe(self, timeline: Any) -> None:
        """A finished request (the replay shows each one once, before it next asks)."""
        self._count(timeline)

    def __call__(self, replayer: Any) -> bool:
        self._count_waiting(replayer)
        return self.failed > 0 or any(len(ids) > self.allowed for ids in self.misses.values())

    def reasons(self) -> list[str]:
        """Why the replay should stop: the SLO metrics already missed by more requests than the
        percentile allows, and ``failed`` when a request failed."""
        missed = [name for name, ids in self.misses.items() if len(ids) > self.allowed]
        return missed + (["failed"] if self.failed else [])

    def _count(self, timeline: Any) -> None:
        tokens, sent = timeline.token_s, timeline.send_s
        if timeline.error or sent is None or not tokens:
            self.failed += 1
            return
        figures = {"ttft": tokens[0] - sent, "e2el": tokens[-1] - sent}
        if len(tokens) > 1:
            figures["tpot"] = (tokens[-1] - tokens[0]) / (len(tokens) - 1)
        for name, limit in self.limits.items():
            if figures.get(name, 0.0) > limit:
                self.misses[name].add(timeline.request_id)

    def _count_waiting(self, replayer: Any) -> None:
        """A request sent longer ago than a TTFT (or E2EL) limit without its first (or last) token will
        miss it whatever happens next: counted now, under overload long before it finishes."""
        now = replayer.now()
        for name in ("ttft", "e2el"):
            limit = self.limits.get(name)
            if limit is None:
                continue
            late = now - limit
            for timeline in replayer.timelines.values():
                sent = timeline.send_s
                if sent is None or sent >= late or timeline.done_s is not None:
                    continue
                if name == "e2el" or not timeline.token_s:
                    self.misses[name].add(timeline.request_id)


@dataclass
class LoadSearch:
    """Bracket then bisect the highest feasible load (module docstring). ``integer``: concurrency."""

    start: float
    precision: float = 0.05
    integer: bool = False
    min_load: float = 1e-3
    max_load: float = 1e6
    feasible_at: float | None = None  # highest feasible load so far
    infeasible_at: float | None = None  # lowest infeasible load so far
    tried: list[tuple[float, bool]] = field(default_factory=list)

    def record(self, load: float, feasible: bool) -> None:
        self.tried.append((load, feasible))
        if feasible and (self.feasible_at is None or load > self.feasible_at):
            self.feasible_at = load
        if not feasible and (self.infeasible_at is None or load < self.infeasible_at):
            self.infeasible_at = load

    def next_load(self) -> float | None:
        """The next load to try; None when the search is done."""
        lo, hi = self.feasible_at, self.infeasible_at
        if lo is None and hi is None:
            return self._round(self.start)
        if hi is None:  # feasible so far: go up
            return None if lo >= self.max_load else self._round(min(lo * 2, self.max_load))
        if lo is None:  # infeasible so far: go down, not below min_load
            return None if hi / 2 < self.min_load else self._round(hi / 2)
        if self.integer:
            return None if hi - lo <= 1 else float((int(lo) + int(hi)) // 2)
        if hi <= lo * (1 + self.precision):
            return None
        mid = self._round(math.sqrt(lo * hi))
        return mid if lo < mid < hi else None

    def _round(self, load: float) -> float:
        """Loads rounded to 4 significant digits (integers for concurrency): readable, and the same
        float every time a resumed sweep asks for it."""
        if self.integer:
            return float(max(1, round(load)))
        return float(f"{load:.4g}")
