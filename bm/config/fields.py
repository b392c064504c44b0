"""How a config knob is declared, and the small checks the sections share.

A knob is a dataclass field whose ``metadata`` carries its help text and its check, so the loader, the
``--set`` overrides, ``bm run --help`` and :func:`bm.config.config_reference` all read one declaration. A
check takes the dotted key and the raw value and returns the value to keep (canonical spelling, float
for a number) or raises :class:`ConfigError` naming the key and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, already phrased for the user (names the key and the fix)."""


def knob(default: Any, help: str, check: Callable[[str, Any], Any] | None = None) -> Any:
    """A dataclass field that declares one config key: its default, its help (what ``bm run --help`` and
    :func:`bm.config.config_reference` print) and its check (what the loader runs on the raw value)."""
    return field(default=default, metadata={"help": help, "check": check})


def int_at_least(minimum: int, optional: bool = False) -> Callable[[str, Any], Any]:
    """An integer no smaller than ``minimum`` (YAML's true/false refused); ``optional`` lets null through,
    for keys whose default is decided later (engine.defaults, the model)."""

    def check(key: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer >= {minimum}, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{key}: must be >= {minimum}, got {value}")
        return value

    return check


def fraction(key: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number in (0, 1], got {value!r}")
    if not 0 < value <= 1:
        raise ConfigError(f"{key}: must be in (0, 1], got {value}")
    return float(value)


def boolean(key: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def optional_bool(key: str, value: Any) -> Any:
    return None if value is None else boolean(key, value)


def optional_str(key: str, value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return str(value)


def choice(aliases: Mapping[str, str]) -> Callable[[str, Any], Any]:
    """Accept any alias (case-insensitive) and return the canonical spelling."""

    def check(key: str, value: Any) -> Any:
        canonical = aliases.get(str(value).lower()) if isinstance(value, str) else None
        if canonical is None:
            allowed = ", ".join(sorted(set(aliases.values())))
            raise ConfigError(f"{key}: unknown value {value!r}; allowed: {allowed}")
        return canonical

    return check


def on_off_auto(key: str, value: Any) -> str:
    """auto, on or off; YAML's true/false (and the strings) mean on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return choice({"auto": "auto", "on": "on", "off": "off", "true": "on", "false": "off"})(key, value)


def number_in(low: float, high: float | None, *, low_open: bool = True, optional: bool = False):
    """A float in (low, high] (or [low, high] with ``low_open=False``); ``None`` allowed when optional."""

    def check(key: str, value: Any) -> Any:
        if value is None and optional:
            return None
        upper = f"{high}]" if high is not None else "inf)"
        bound = f"{'(' if low_open else '['}{low}, {upper}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number in {bound}, got {value!r}")
        too_low = value <= low if low_open else value < low
        if too_low or (high is not None and value > high) or not math.isfinite(value):
            raise ConfigError(f"{key}: must be in {bound}, got {value}")
        return float(value)

    return check


def mapping(key: str, value: Any) -> Any:
    if value is None or isinstance(value, Mapping):
        return dict(value) if value is not None else None
    raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
