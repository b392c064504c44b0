"""Reading saved bench and compare directories back: what ``bm report`` and ``--plot`` draw from.

Kept apart from the plotting so that writing results (``bm compare``) needs neither matplotlib nor
this module's readers, and reading them back needs neither torch nor the engine.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd


@dataclass
class VariantData:
    """What one variant's plots need: its requests, its per-iteration stats, its throughput per repeat."""

    name: str
    requests: pd.DataFrame
    stats: pd.DataFrame
    output_throughputs: list[float] = field(default_factory=list)


# The fields the plots draw (bm/report/plots.py; a test holds the two to each other). A long run's files
# are hundreds of MB (the whole Azure conversation trace through the simulator: 518 MB of stats rows),
# and read whole into frames they took 4.2 GB; read for these fields alone, a few numbers per row.
PLOT_REQUEST_FIELDS = ("ttft_ms", "tpot_ms", "e2el_ms")
PLOT_STATS_FIELDS = (
    "Iteration Counter",
    "Elapsed Time (s)",
    "Total Context Tokens",
    "Total Generation Tokens",
    "Generation Requests",
    "Empty Generation Slots",
    "Used KV cache blocks",
    "Max KV cache blocks",
    "Paused Requests",
)


def read_variant_dir(
    name: str, directory: Path, output_throughputs: list[float], *, plotted: bool = False
) -> VariantData:
    """Load a variant's requests.jsonl and stats.jsonl as written by bench and compare; ``plotted``:
    only the fields the plots draw (:data:`PLOT_REQUEST_FIELDS`, :data:`PLOT_STATS_FIELDS`)."""
    if plotted:
        requests = read_fields(directory / "requests.jsonl", PLOT_REQUEST_FIELDS)
        stats = read_fields(directory / "stats.jsonl", PLOT_STATS_FIELDS)
    else:
        requests = _read_jsonl(directory / "requests.jsonl")
        stats = _read_jsonl(directory / "stats.jsonl")
    return VariantData(name, requests, stats, output_throughputs)


def _read_jsonl(path: Path) -> pd.DataFrame:
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame()
    return pd.read_json(path, lines=True)


def read_fields(path: Path, fields: Sequence[str]) -> pd.DataFrame:
    """The numeric ``fields`` of a JSONL file, a line at a time, 8 bytes per field and row (NaN where a
    row has no number); a field no row has is left out, as a whole-file read leaves it out."""
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame()
    columns = {name: array("d") for name in fields}
    absent = set(fields)
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if absent:
                absent -= row.keys()
            for name, values in columns.items():
                value = row.get(name)
                values.append(value if isinstance(value, int | float) else math.nan)
    return pd.DataFrame({name: np.array(values) for name, values in columns.items() if name not in absent})


def variant_dir(out_dir: Path, name: str) -> Path:
    return out_dir / "variants" / name.replace(":", "__")


def load_plot_data(out_dir: Path) -> list[VariantData]:
    """The plots' inputs from a saved bench or compare directory (for ``bm report``)."""
    compare_json = out_dir / "compare.json"
    if compare_json.exists():
        document = json.loads(compare_json.read_text(encoding="utf-8"))
        data = []
        for name, info in document.get("variants", {}).items():
            throughputs = [t for t in info.get("output_throughput_per_repeat", []) if t is not None]
            directory = variant_dir(out_dir, name)
            if directory.exists():
                data.append(read_variant_dir(name, directory, throughputs, plotted=True))
            else:
                data.append(VariantData(name, pd.DataFrame(), pd.DataFrame(), throughputs))
        return data
    results_json = out_dir / "results.json"
    if results_json.exists():
        document = json.loads(results_json.read_text(encoding="utf-8"))
        name = document.get("batching_scheme") or "bm"
        throughput = document.get("output_throughput")
        return [read_variant_dir(name, out_dir, [throughput] if throughput is not None else [], plotted=True)]
    raise FileNotFoundError(
        f"{out_dir}: holds neither compare.json nor results.json; point bm report at a bench or compare output directory"
    )
