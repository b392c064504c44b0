"""Did you mean ...? for names a user typed: request fields, model presets, config keys.

A typo should cost one glance, not a scan of a 39-name list: the closest known names (difflib's ratio,
the measure ``git`` and ``pip`` users know from their own typos) are named first, and the full list is
left to the documentation the message points to. Plain Python, so any layer can use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

CUTOFF = 0.6  # difflib's default: 'promt' -> 'prompt' (0.91), 'smollm2' -> 'smollm2-135m' (0.74)


def closest(name: str, known: Iterable[str], count: int = 3) -> list[str]:
    """The known names closest to ``name``, best first; empty when nothing is close.

    Case is ignored for the comparison (``Prompt`` suggests ``prompt``) but the known spelling is
    returned. Known names that start with ``name`` (a truncated ``smollm2`` or ``max_batch``) are the
    answer when there are any: a truncation is likelier than a typo that also happens to be close."""
    spellings = {k.lower(): k for k in known}
    lowered = name.lower()
    prefixed = sorted(k for k in spellings if lowered and k.startswith(lowered) and k != lowered)
    found = prefixed or difflib.get_close_matches(lowered, list(spellings), n=count, cutoff=CUTOFF)
    return [spellings[k] for k in found[:count]]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'prompt'?"`` (or ``'a' or 'b'``), or ``""`` when no known name is close;
    written to follow a message such as ``unknown field 'promt'``."""
    matches = closest(name, known)
    if not matches:
        return ""
    quoted = [repr(m) for m in matches]
    spoken = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f"; did you mean {spoken}?"
