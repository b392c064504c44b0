"""The ``--baseline`` file of ``bm compare`` and ``bm sweep``, read before anything runs.

One reader for both commands, so a bad path or file is refused with the same words and costs nothing:
no model is loaded and no round is measured before the file is known to be a saved result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bm.config import ConfigError


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
