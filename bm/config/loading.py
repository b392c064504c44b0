"""Reading a config: a YAML file (paths in it relative to the file), ``--set SECTION.KEY=VALUE`` overrides on
top, everything validated at once; a custom scheduler class it names must be findable before anything loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from bm.config.classpath import check_class_paths
from bm.config.fields import ConfigError
from bm.config.sections import SECTIONS, BmConfig, config_from_dict
from bm.suggest import did_you_mean


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value is read as YAML so numbers, booleans and null work."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. engine.max_batch_size=64")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.count(".") != 1:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. engine.max_batch_size=64")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError) as exc:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML ({exc})") from None
    return key, value


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> BmConfig:
    """Read a YAML file (optional), apply dotted overrides, validate everything at once."""
    data: dict[str, Any] = {}
    folders = [Path.cwd()]  # where a custom scheduler's module is looked for: the file's folder, then here
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a directory; give a YAML file")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {str(p)!r} is not a YAML text file (not UTF-8: byte "
                f"0x{exc.object[exc.start]:02x} at offset {exc.start})"
            ) from None
        except OSError as exc:
            raise ConfigError(f"config file {str(p)!r} cannot be read ({exc.strerror})") from None
        except (yaml.YAMLError, RecursionError, ValueError) as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(p)!r}: expected a mapping with sections {', '.join(SECTIONS)}"
            )
        data = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (loaded or {}).items()}
        _resolve_relative_paths(data, p.parent)
        folders.insert(0, p.parent)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS:
            hint = did_you_mean(section, SECTIONS)
            raise ConfigError(f"{dotted}: unknown section{hint}; allowed sections: {', '.join(SECTIONS)}")
        current = data.get(section)
        if current is None:
            current = data[section] = {}
        elif not isinstance(current, dict):
            raise ConfigError(f"{section}: expected a mapping of keys")
        current[key] = value
    cfg = config_from_dict(data)
    check_class_paths(cfg.engine, folders)
    return cfg


def _resolve_relative_paths(data: dict[str, Any], base: Path) -> None:
    """Paths inside a config file are relative to that file, as a user editing it would expect."""
    for section, keys in (
        ("model", ("path", "config", "tokenizer", "generation_config")),
        ("bench", ("dataset", "chat_template")),
    ):
        values = data.get(section)
        if not isinstance(values, dict):
            continue
        for key in keys:
            value = values.get(key)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                candidate = base / value
                if candidate.exists():
                    values[key] = str(candidate)
    modules = data.get("model", {}).get("lora_modules") if isinstance(data.get("model"), dict) else None
    if isinstance(modules, dict):  # adapter directories too
        for name, value in modules.items():
            relative = isinstance(value, str) and value and not Path(value).is_absolute()
            if relative and (base / value).exists():
                modules[name] = str(base / value)
