"""Regression checks of a comparison against a saved one (``bm compare --baseline PREV.json``).

Two kinds of figure, two rules. Counters that a deterministic run reproduces exactly (tokens, completed
requests, and, when every request arrives at t=0, the engine's iterations, computed token slots, empty
generation slots and pauses) must match exactly: a difference is a behaviour change, not noise. Timings
must stay within a relative tolerance, in the direction that matters (throughput may not fall, latency may
not rise, by more than the tolerance).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.config import ConfigError

# Always exact: they do not depend on timing.
EXACT_ALWAYS = ("num_requests", "completed", "failed", "total_input_tokens", "total_output_tokens")
# Exact when arrivals do not depend on the wall clock (all at t=0); otherwise timing shifts batches.
EXACT_IF_OFFLINE = (
    "num_iterations",
    "total_computed_tokens",
    "total_empty_generation_slots",
    "num_paused_requests",
)
HIGHER_IS_BETTER = ("output_throughput", "request_throughput", "total_token_throughput", "request_goodput")
LOWER_IS_BETTER = tuple(
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "e2el") for stat in ("median", "p99")
)


class ToleranceError(ValueError):
    pass


def parse_tolerance(text: str) -> float:
    """``10%`` or ``0.1`` -> 0.1; anything else names the accepted forms. Large values are allowed: a
    gate on counters alone uses a huge timing tolerance."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*", text)
    if not m:
        raise ToleranceError(f"--tolerance {text!r}: write a percentage like 10% or a fraction like 0.1")
    return float(m.group(1)) / (100 if m.group(2) else 1)


@dataclass(frozen=True)
class Regression:
    variant: str
    metric: str
    previous: Any
    current: Any
    kind: str  # "counter" | "timing" | "missing"
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "metric": self.metric,
            "previous": self.previous,
            "current": self.current,
            "kind": self.kind,
            "detail": self.detail,
        }

    @property
    def message(self) -> str:
        return f"{self.variant}.{self.metric}: {self.detail}"


def find_regressions(
    previous: Mapping[str, Any], current: Mapping[str, Any], tolerance: float
) -> list[Regression]:
    """Compare two ``compare.json`` documents variant by variant.

    A variant of the saved run that is missing now is a regression (the gate would silently stop
    checking it); a new variant is not.
    """
    found: list[Regression] = []
    prev_variants = previous.get("variants", {})
    cur_variants = current.get("variants", {})
    offline = bool(previous.get("offline_arrivals")) and bool(current.get("offline_arrivals"))
    for name, prev in prev_variants.items():
        if name not in cur_variants:
            found.append(
                Regression(name, "*", "present", "absent", "missing", "variant missing from this run")
            )
            continue
        pm, cm = prev.get("metrics", {}), cur_variants[name].get("metrics", {})
        exact = EXACT_ALWAYS + (EXACT_IF_OFFLINE if offline else ())
        for metric in exact:
            if metric in pm and pm[metric] is not None and cm.get(metric) != pm[metric]:
                found.append(
                    Regression(
                        name, metric, pm[metric], cm.get(metric), "counter",
                        f"counter changed {pm[metric]} -> {cm.get(metric)} (must match exactly)",
                    )
                )  # fmt: skip
        for metric in HIGHER_IS_BETTER:
            p, c = pm.get(metric), cm.get(metric)
            if _num(p) and _num(c) and p > 0 and c < p * (1 - tolerance):
                found.append(
                    Regression(
                        name, metric, p, c, "timing",
                        f"fell {p:.4g} -> {c:.4g} ({(p - c) / p:.1%} worse, tolerance {tolerance:.0%})",
                    )
                )  # fmt: skip
        for metric in LOWER_IS_BETTER:
            p, c = pm.get(metric), cm.get(metric)
            if _num(p) and _num(c) and p > 0 and c > p * (1 + tolerance):
                found.append(
                    Regression(
                        name, metric, p, c, "timing",
                        f"rose {p:.4g} -> {c:.4g} ({(c - p) / p:.1%} worse, tolerance {tolerance:.0%})",
                    )
                )  # fmt: skip
    return found


def _num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def read_baseline_document(path: Path, command: str, section: str) -> dict[str, Any]:
    """A saved ``compare.json`` or ``sweep.json`` given as ``--baseline``, read before anything runs, so a
    bad path or file costs nothing; one definition for both commands. ``section`` is the mapping the
    document must hold (``variants`` or ``configs``)."""
    name = f"{command}.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"--baseline {path}: no such file; save one with bm {command} -o DIR (DIR/{name})"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"--baseline {path}: is a directory; give DIR/{name}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--baseline {path}: not a {name} (not UTF-8 text: byte 0x{exc.object[exc.start]:02x} "
            f"at offset {exc.start})"
        ) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"--baseline {path}: not a readable {name} ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get(section), dict):
        raise ConfigError(f"--baseline {path}: not a {name} (no '{section}' mapping)")
    return document
