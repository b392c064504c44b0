"""Room for a run's outputs, checked before the model loads.

A run onto a full file system used to load the model, then fail on its first writes with a stream of
``OSError: [Errno 28]`` tracebacks (25 in a run onto a 1 MB tmpfs), leaving torn lines behind. The free space of ``-o``'s file system
(``os.statvfs``, the blocks an unprivileged user may take) is held against an estimate of what the run
writes: each line's record and its share of ``stats.jsonl``, from ``--max-tokens``, plus, on
``--resume``, a second copy of the kept records (they are rewritten beside the old file, then renamed
over it), and never less than :data:`MIN_FREE_BYTES`. The estimate is a floor: a line that asks for more
tokens, log probs or beams writes more, and a disk that fills during the run is still found, as one
error that says the run can resume (bm.cli.main).
"""

from __future__ import annotations

import os
from pathlib import Path

MIN_FREE_BYTES = 16 << 20  # run.json, summary.json, a bench's results: never start on less
# Measured (200 lines of 8 prompt tokens, --ignore-eos, the CPU's default batch sizes): a record took 226
# and 509 bytes of outputs.jsonl at 16 and 64 output tokens on the bench model
# (configs/models/bench-llama-15m.json, no tokenizer), and 169 and 678 bytes of stats.jsonl; the
# embedded model's decoded text added 29 and 70 bytes. About 130 bytes plus 17 a token in all.
RECORD_BYTES = 256
TOKEN_BYTES = 16


class NoRoomError(ValueError):
    """The file system cannot hold what the run will write; phrased for the user (exit code 2)."""


def run_output_bytes(prompts: Path, max_tokens: int, out: Path, resume: bool) -> tuple[int, str]:
    """What ``bm run`` on ``prompts`` writes into ``out`` (at least), and how that was reckoned."""
    lines = _count_lines(prompts)
    per_record = RECORD_BYTES + TOKEN_BYTES * max_tokens
    needed = lines * per_record
    how = f"{lines:,} line(s) x ~{format_bytes(per_record)} a record at --max-tokens {max_tokens}"
    kept = out / "outputs.jsonl"
    if resume and kept.is_file():
        needed += kept.stat().st_size
        how += f", plus a copy of the kept records ({format_bytes(kept.stat().st_size)})"
    return needed, how


def check_free_space(out: Path, needed: int = 0, how: str = "", replaced: tuple[str, ...] = ()) -> None:
    """Raise :class:`NoRoomError` when ``out``'s file system has less room than ``needed`` bytes (at
    least :data:`MIN_FREE_BYTES`), counting what ``--overwrite`` frees there (``replaced``: its names)."""
    stats = os.statvfs(out)
    free = stats.f_bavail * stats.f_frsize
    freed = sum(_size(out / name) for name in replaced)
    want = max(needed, MIN_FREE_BYTES)
    if free + freed >= want:
        return
    if needed >= MIN_FREE_BYTES:
        reckoned = f"about {format_bytes(want)}" + (f" ({how})" if how else "")
    else:
        reckoned = f"at least {format_bytes(MIN_FREE_BYTES)}, bm's floor for any run" + (
            f" (its records: about {format_bytes(needed)}, {how})" if how else ""
        )
    raise NoRoomError(
        f"-o {str(out)!r}: {format_bytes(free)} free on its file system"
        + (f" (and {format_bytes(freed)} that --overwrite frees)" if freed else "")
        + f", but the run needs {reckoned}; free some space there, or give -o a directory on another "
        "file system"
    )


def _count_lines(path: Path) -> int:
    count, last = 0, b"\n"
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def _size(path: Path) -> int:
    """Bytes under ``path`` (a file, or a folder's files); 0 when it is missing."""
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


def format_bytes(count: int) -> str:
    """``12.0 MB`` (powers of 1,000, as ``df -H`` prints them)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
