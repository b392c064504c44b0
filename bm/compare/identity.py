"""What a ``--baseline`` must share with the run gated on it, checked before anything runs.

A baseline measured on another workload, another configuration or another set of variants cannot judge
this run: its counters differ for reasons that are not a regression, and its timings measure something
else. Today's ``bm compare`` found that out only after the whole run (a wall of counter "regressions"
or a variant "missing"); now the three are compared from the files and flags alone, before the model
loads, and a mismatch is a usage error (exit 2) naming each difference.

``compare.json`` records the run's identity as the user asked for it (before the engine's budgets and
the KV cache are resolved for the device, which may differ between two machines that run the same
thing): ``identity.workload`` (the ``bench`` keys that make the requests and their arrivals, with the
dataset file's digest), ``identity.config`` with its digest ``config_sha256`` (the model, engine,
KV cache, adapter and simulator keys, less each variant's scheme and policy) and ``identity.variants``.
A baseline from an older bm has no identity: its recorded config is compared on the keys this run sets
(a key it left to be resolved at run time, such as the KV cache size, cannot be compared before the run).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from bm.compare.variants import Variant
from bm.config import BmConfig, config_from_dict

# Set per variant by ``--schemes`` and ``--policies``, so never part of the shared config.
PER_VARIANT = ("engine.batching_scheme", "engine.scheduler_policy")
# Where the results go and how they print: they change no figure.
OUTPUT_ONLY = ("bench.out_dir", "bench.json_output")
IGNORED_SECTIONS = ("sweep",)  # read by bm sweep only
WORKLOAD_SECTION = "bench"
MOST_NAMED = 6  # differences named in one refusal; the rest are counted


def flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """``{"engine": {"max_batch_size": 8}}`` -> ``{"engine.max_batch_size": 8}`` (one level of sections)."""
    flat: dict[str, Any] = {}
    for section, values in config.items():
        if section in IGNORED_SECTIONS or not isinstance(values, Mapping):
            continue
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in PER_VARIANT and name not in OUTPUT_ONLY:
                flat[name] = value
    return flat


def digest(values: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def gate_identity(
    config: BmConfig, variants: Sequence[Variant], dataset_sha256: str | None
) -> dict[str, Any]:
    """This run's identity as ``compare.json`` records it; ``config`` is the config as requested (before
    :func:`bm.config.resolve_engine` and the KV cache sizing fill in what the device decides)."""
    # as compare.json will hold it (a tuple reads back as a list), so a run equals its own baseline
    flat = _as_json(flatten(config.to_dict()))
    workload = {k: v for k, v in flat.items() if k.startswith(f"{WORKLOAD_SECTION}.")}
    settings = {k: v for k, v in flat.items() if not k.startswith(f"{WORKLOAD_SECTION}.")}
    return {
        "workload": workload,
        "dataset_sha256": dataset_sha256,
        "config": settings,
        "config_sha256": digest(settings),
        "variants": [v.name for v in variants],
    }


def identity_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Each way the baseline document ``saved`` differs from this run's identity ``current``, as a phrase
    naming the key and both values; empty when the baseline can judge this run."""
    found: list[str] = []
    names = [str(n) for n in saved.get("variants", {})]
    mine = list(current["variants"])
    missing, extra = [n for n in names if n not in mine], [n for n in mine if n not in names]
    if missing or extra:
        parts = [f"only the baseline has {', '.join(missing)}"] if missing else []
        parts += [f"only this run has {', '.join(extra)}"] if extra else []
        found.append(
            f"another set of variants: the baseline compared {', '.join(names) or 'none'}, this run "
            f"compares {', '.join(mine)} ({'; '.join(parts)})"
        )
    recorded = saved.get("identity")
    if isinstance(recorded, Mapping) and isinstance(recorded.get("config"), Mapping):
        theirs = {**recorded.get("workload", {}), **recorded["config"]}
        exact = True
        same_settings = recorded.get("config_sha256") == current["config_sha256"]
        a, b = recorded.get("dataset_sha256"), current.get("dataset_sha256")
        if a and b and a != b:
            found.append(
                f"another workload: the dataset file's contents differ (sha256 {a[:12]}... in the "
                f"baseline, {b[:12]}... here)"
            )
    else:  # an older bm's document: its config as the run resolved it
        theirs = _as_json(flatten(saved.get("config") or {}))
        exact, same_settings = False, False
    ours = dict(current["workload"]) | ({} if same_settings else dict(current["config"]))
    defaults = _as_json(flatten(config_from_dict({}).to_dict()))
    for key, value in ours.items():
        if key not in theirs:
            # a key the baseline's bm did not know yet: the same run when this one leaves it at its default
            if exact and value != defaults.get(key, value):
                found.append(f"{_what(key)}: {key} is {_show(value)} here, unknown to the baseline's bm")
            continue
        if not exact and value is None:
            continue  # resolved at run time; the old document holds the resolved value
        if theirs[key] != value:
            found.append(f"{_what(key)}: {key} is {_show(theirs[key])} in the baseline, {_show(value)} here")
    return found


def refusal(path: str, differences: Sequence[str]) -> str:
    """The one-line usage error for a baseline that cannot judge this run."""
    shown = "; ".join(differences[:MOST_NAMED])
    more = f"; and {len(differences) - MOST_NAMED} more" if len(differences) > MOST_NAMED else ""
    return (
        f"--baseline {path} cannot judge this run, it was measured on {shown}{more}; give this run the "
        "baseline's settings, or save a new baseline with this run's (bm compare ... -o DIR)"
    )


def _as_json(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as a compare.json holds them (a tuple reads back as a list)."""
    return json.loads(json.dumps(values, default=str))


def _what(key: str) -> str:
    return "another workload" if key.startswith(f"{WORKLOAD_SECTION}.") else "another config"


def _show(value: Any) -> str:
    return json.dumps(value, default=str)
