"""Reading saved bench and compare directories back: what ``bm report`` and ``--plot`` draw from.

Kept apart from the plotting so that writing results (``bm compare``) needs neither matplotlib nor
this module's readers, and reading them back needs neither torch nor the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd


@dataclass
class VariantData:
    """What one variant's plots need: its requests, its per-iteration stats, its throughput per repeat."""

    name: str
    requests: pd.DataFrame
    stats: pd.DataFrame
    output_throughputs: list[float] = field(default_factory=list)


def read_variant_dir(name: str, directory: Path, output_throughputs: list[float]) -> VariantData:
    """Load a variant's requests.jsonl and stats.jsonl as written by bench and compare."""
    requests = _read_jsonl(directory / "requests.jsonl")
    stats = _read_jsonl(directory / "stats.jsonl")
    return VariantData(name, requests, stats, output_throughputs)


def _read_jsonl(path: Path) -> pd.DataFrame:
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame()
    return pd.read_json(path, lines=True)


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
                data.append(read_variant_dir(name, directory, throughputs))
            else:
                data.append(VariantData(name, pd.DataFrame(), pd.DataFrame(), throughputs))
        return data
    results_json = out_dir / "results.json"
    if results_json.exists():
        document = json.loads(results_json.read_text(encoding="utf-8"))
        name = document.get("batching_scheme") or "bm"
        throughput = document.get("output_throughput")
        return [read_variant_dir(name, out_dir, [throughput] if throughput is not None else [])]
    raise FileNotFoundError(
        f"{out_dir}: holds neither compare.json nor results.json; point bm report at a bench or compare output directory"
    )
