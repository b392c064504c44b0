"""The lines of a JSONL file as JSON objects, each line on its own: a line that is not one yields its error.

Shared by every reader of JSONL (bm's request lines, OpenAI batch lines, bench datasets, a run's own
records) and by ``bm run --ray``'s slices of a file, so a line reads the same whichever reads it. Plain
Python (no torch). Reading never raises on what a file holds: bad bytes, a lone surrogate, 100k-deep
nesting or a BOM each end as one line's error (or, for the BOM, as nothing at all).
"""

from __future__ import annotations

import json
import sys
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from bm.engine.requests.fields import FIELD_ALIASES, INT_FIELDS
from bm.workloads.request import RowError

MAX_DEPTH = 64  # no field of the format nests deeper; deeper input is refused before it can recurse


def iter_lines(path: Path) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """(line number, object) per non-blank line; a line that is not a JSON object yields its error.

    The file is read as bytes and decoded line by line, so one bad byte costs one line, not the file."""
    with path.open("rb") as f:
        yield from _decoded(f, 1)


def _decoded(raws: Iterable[bytes], first_number: int) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """:func:`iter_lines` over raw lines that start at the file's line ``first_number`` (1-based)."""
    for number, raw in enumerate(raws, start=first_number):
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 BOM, as Windows editors write it: not part of the data
        nul = raw.find(b"\x00")
        if nul >= 0:  # wherever it is in the file: its line's error (a file of nothing else is refused whole)
            yield (
                number,
                RowError(
                    f"a NUL byte (0x00) at column {nul + 1}, which is not text; remove it (inside a string, "
                    "write it as \\u0000)"
                ),
            )
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield (
                number,
                RowError(
                    f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                    "save the file as UTF-8"
                ),
            )
            continue
        if not text.strip():  # whitespace of any kind, U+00A0 included: a blank line, not a request
            continue
        yield number, _load_object(text)


def _load_object(text: str) -> dict[str, Any] | RowError:
    text = text.rstrip("\r\n")  # the line ending is not JSON: an error there was reported at column 1
    # scanned only when there are enough brackets to matter: a plain 200 KB prompt costs two counts
    depth = _max_depth(text) if text.count("[") + text.count("{") > MAX_DEPTH else 0
    if depth > MAX_DEPTH:
        return RowError(f"JSON nested {depth} levels deep; bm's request format needs at most a few")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return _syntax_error(text, exc)
    except ValueError:  # an integer longer than Python reads (sys.get_int_max_str_digits)
        return _long_integer_error(text)
    except RecursionError as exc:  # belt and braces: json's own limits
        return RowError(f"unreadable JSON ({type(exc).__name__})")
    if not isinstance(data, dict):
        return RowError(f"expected a JSON object, got {type(data).__name__}")
    surrogate = _find_path(data, "", _has_surrogate)
    if surrogate is not None:
        return RowError(
            f"{surrogate or 'a key'}: contains a lone UTF-16 surrogate (e.g. \\ud800), which is not "
            "text; remove it or write the character it was meant to be"
        )
    return data


def _syntax_error(text: str, exc: json.JSONDecodeError) -> RowError:
    """json's complaint in the user's terms: where the line went wrong, what it found there, the fix."""
    end = len(text.rstrip())
    if exc.pos >= end:
        return RowError(
            f"malformed JSON (the line ends at column {end + 1} before the object is closed: was it cut short?)"
        )
    column, char = exc.pos + 1, text[exc.pos]
    if exc.msg == "Extra data":
        gap = text[: exc.pos]
        if "\r" in gap[len(gap.rstrip(" \t\r")) :]:
            return RowError(
                f"lines run together at column {column}: the file ends its lines with a lone CR (classic "
                "Mac line endings), which JSONL does not read as a line end; convert them to LF, e.g. "
                "tr '\\r' '\\n' < in.jsonl > out.jsonl"
            )
        return RowError(
            f"malformed JSON (more follows the first value, at column {column}; give one JSON object per line)"
        )
    if exc.msg.startswith("Invalid control character"):  # json's message ends in "at"
        return RowError(
            f"malformed JSON (a raw control character U+{ord(char):04X} at column {column} inside a string; "
            f"write it escaped, as \\u{ord(char):04x}, or remove it)"
        )
    if char.isspace():  # not JSON's four: U+00A0, U+2003, U+3000 ...
        name = unicodedata.name(char, "whitespace").lower()
        return RowError(
            f"malformed JSON (a {name} (U+{ord(char):04X}) at column {column}, which JSON does not read as "
            "whitespace; replace it with a plain space)"
        )
    return RowError(f"malformed JSON ({exc.msg} at column {column})")


class _LongInteger:
    """Stands for an integer too long to read, so its place in the line can be named."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _long_integer_error(text: str) -> RowError:
    """The field holding an integer longer than Python converts (4300 digits by default), and its fix."""
    limit = sys.get_int_max_str_digits()
    too_long: list[_LongInteger] = []  # in the line's order, which is the order _find_path walks

    def parse_int(literal: str) -> int | _LongInteger:
        digits = len(literal.lstrip("-"))
        if not limit or digits <= limit:
            return int(literal)
        too_long.append(_LongInteger(digits))
        return too_long[-1]

    try:
        data = json.loads(text, parse_int=parse_int)
    except (ValueError, RecursionError) as exc:
        return RowError(f"unreadable JSON ({type(exc).__name__})")
    if not too_long:
        return RowError("unreadable JSON (ValueError)")
    path = _find_path(data, "", lambda value: isinstance(value, _LongInteger)) or "the line"
    key = path.rsplit(".", 1)[-1]
    field = FIELD_ALIASES.get(key, key)
    if field in INT_FIELDS:
        low, high = INT_FIELDS[field]
        fix = f"{key} takes an integer in [{low}, {high}]"
    else:
        fix = "no field takes an integer this long: write the value it was meant to be"
    return RowError(
        f"{path}: a {too_long[0].digits}-digit integer, longer than the {limit} digits Python reads; {fix}"
    )


def _max_depth(text: str) -> int:
    """Bracket depth outside strings, found without recursion (json.loads would recurse)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _has_surrogate(value: Any) -> bool:
    """A string holding a lone surrogate (it cannot be encoded or written)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _find_path(value: Any, path: str, bad: Callable[[Any], bool]) -> str | None:
    """The dotted path of the first value (or key: the path of its object) for which ``bad`` holds."""
    if bad(value):
        return path
    if isinstance(value, dict):
        for key, item in value.items():
            if bad(key):
                return path or "a key"
            found = _find_path(item, f"{path}.{key}" if path else str(key), bad)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_path(item, f"{path}[{i}]", bad)
            if found is not None:
                return found
    return None


def iter_slice_lines(data: bytes, first_number: int) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """:func:`iter_lines` over a slice of a file (its raw bytes, the first line being the file's line
    ``first_number``): the same decoding and the same line numbers, so a reader of slices (``bm run
    --ray``'s replicas) and a reader of the whole file give each line the same row or error."""
    return _decoded(split_lines(data), first_number)


def split_lines(data: bytes) -> list[bytes]:
    """Raw lines as a binary file's iteration gives them: split after each ``\\n`` only (a lone ``\\r`` is
    part of its line, where ``bytes.splitlines`` would cut)."""
    pieces = data.split(b"\n")
    lines = [piece + b"\n" for piece in pieces[:-1]]
    return [*lines, pieces[-1]] if pieces[-1] else lines
