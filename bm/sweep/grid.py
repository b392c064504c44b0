"""The grid of a sweep: which config keys vary, with which values, and a short name per configuration.

Every axis is a dotted config key (``engine.max_batch_size``) with a list of values; the common ones
have flags of their own (``--schemes``, ``--policies``, ``--max-batch-sizes``, ...) and any key can be
given with ``--grid KEY=V1,V2`` or in the config's ``sweep.grid`` section. Each configuration is the
base config with one value per axis, validated by the same :func:`bm.config.config_from_dict` a run
uses, so a bad value fails before the first point runs and names the axis.

A configuration's name joins the labels of its values on the axes that vary (``inflight_fused``,
``v1:max_utilization:bs64``): the names ``--assert`` reads (``inflight_fused.max_load``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from bm.config import BmConfig, ConfigError, config_from_dict

# flag name -> config key, for the axes with flags of their own
AXIS_FLAGS = {
    "schemes": "engine.batching_scheme",
    "policies": "engine.scheduler_policy",
    "max_batch_sizes": "engine.max_batch_size",
    "max_num_tokens_values": "engine.max_num_tokens",
    "chunking": "engine.enable_chunked_context",
    "block_reuse": "kv_cache.enable_block_reuse",
    "tp_sizes": "sim.tensor_parallel",
}
# how a value is labelled in a configuration's name (schemes and policies by their value alone)
_PREFIX = {
    "engine.max_batch_size": "bs",
    "engine.max_num_tokens": "tok",
    "engine.enable_chunked_context": "chunk",
    "kv_cache.enable_block_reuse": "reuse",
    "sim.tensor_parallel": "tp",
}


@dataclass(frozen=True)
class Axis:
    key: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class GridConfig:
    """One configuration of the grid: its name, the values it sets, and the validated config."""

    name: str
    settings: dict[str, Any]
    config: BmConfig


def parse_values(key: str, text: str | Sequence[Any]) -> tuple[Any, ...]:
    """``"16,32,64"`` -> (16, 32, 64); ``on``/``off`` are booleans. Lists (from YAML) pass through."""
    if isinstance(text, str):
        items = [part.strip() for part in text.split(",") if part.strip()]
        values = tuple(_scalar(item) for item in items)
    else:
        values = tuple(text)
    if not values:
        raise ConfigError(f"sweep axis {key}: no values given; list them comma-separated, e.g. {key}=1,2")
    if len(set(map(repr, values))) != len(values):
        raise ConfigError(f"sweep axis {key}: a value is listed twice ({', '.join(map(str, values))})")
    return values


def _scalar(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("on", "true", "yes"):
        return True
    if lowered in ("off", "false", "no"):
        return False
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def plan_axes(from_config: Mapping[str, Any] | None, from_flags: Mapping[str, str]) -> list[Axis]:
    """The axes in order: the config's ``sweep.grid`` first, then flags (a flag replaces the config's
    values for its key). Keys must be SECTION.KEY."""
    axes: dict[str, tuple[Any, ...]] = {}
    for key, values in (from_config or {}).items():
        axes[_check_key(key)] = parse_values(key, values)
    for key, text in from_flags.items():
        axes[_check_key(key)] = parse_values(key, text)
    if not axes:
        raise ConfigError(
            "bm sweep: no axis to sweep; give e.g. --schemes v1,inflight_fused or --grid engine.max_batch_size=16,64"
        )
    return [Axis(key, values) for key, values in axes.items()]


def _check_key(key: str) -> str:
    section, dot, name = key.partition(".")
    if not dot or not name or section == "sweep":
        raise ConfigError(
            f"sweep axis {key!r}: expected a config key SECTION.KEY, e.g. engine.max_batch_size"
        )
    return key


def expand(base: BmConfig, axes: Sequence[Axis]) -> list[GridConfig]:
    """Every combination of the axes' values over ``base``, validated; names say what differs."""
    data = base.to_dict()
    out = []
    for combo in itertools.product(*(axis.values for axis in axes)):
        settings = {axis.key: value for axis, value in zip(axes, combo, strict=True)}
        merged = {section: dict(values) for section, values in data.items()}
        for key, value in settings.items():
            section, _, name = key.partition(".")
            if section not in merged:
                raise ConfigError(f"sweep axis {key}: unknown section {section!r}")
            merged[section][name] = value
        try:
            config = config_from_dict(merged)
        except ConfigError as exc:
            raise ConfigError(f"sweep configuration {_describe(settings)}: {exc}") from None
        out.append(GridConfig(config_name(axes, settings), settings, config))
    return out


def config_name(axes: Sequence[Axis], settings: Mapping[str, Any]) -> str:
    """Labels of the values on the axes that vary, joined by ``:`` (``all`` when none varies)."""
    labels = [_label(axis.key, settings[axis.key]) for axis in axes if len(axis.values) > 1]
    return ":".join(labels) or "all"


def _label(key: str, value: Any) -> str:
    prefix = _PREFIX.get(key, key.rpartition(".")[2] if key not in AXIS_FLAGS.values() else "")
    if isinstance(value, bool):
        return prefix if value else f"no{prefix}"
    text = str(value.value if hasattr(value, "value") else value)
    return f"{prefix}{text}" if prefix else text


def _describe(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())
