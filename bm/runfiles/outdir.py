"""The output directory of ``bm run``, ``bm bench``, ``bm compare`` and ``bm sweep``: checked before
anything runs, locked for one writer (:mod:`bm.runfiles.outlock`), checked for room
(:mod:`bm.runfiles.diskspace`), never silently replaced (a ``--baseline`` in it included), readable back
for ``--resume`` (whose identity checks are :mod:`bm.runfiles.identity`'s), and removed again when a
usage error stops the command before it wrote anything. Plain Python (no torch), so ``-o`` problems are reported at once."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bm.files import file_digest
from bm.runfiles import outlock
from bm.runfiles.diskspace import NoRoomError, check_free_space
from bm.workloads.jsonl import iter_lines

# end_id: the end token, as records written before finish reasons took bm.LLM's words say
FINAL_REASONS = ("stop", "length", "end_id")
RUN_FILES = (
    "outputs.jsonl",
    "stats.jsonl",
    "summary.json",
    "run.json",
    "batch_output.jsonl",
    "logits",
    "parts",
)
RAY_PARTS = "parts"  # bm run --ray: one file of records per finished block (bm.ray.blocks)
BENCH_FILES = ("results.json", "requests.jsonl", "stats.jsonl", "plots")
COMPARE_FILES = ("compare.json", "compare.md", "variants", "plots")


def iter_final_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a previous run that need no rerun (finished, not cancelled or failed), one at a time
    and once per index, so resuming a file of millions of lines holds only their indexes.

    A run killed mid-write may leave a torn last line; it is skipped, and its request runs again."""
    if not path.is_file():
        return
    seen: set[int] = set()
    for _number, data in iter_lines(path):
        if not isinstance(data, dict):
            continue
        index = data.get("index")
        if (
            isinstance(index, int)
            and index >= 0
            and index not in seen
            and data.get("finish_reason") in FINAL_REASONS
        ):
            seen.add(index)
            yield data


def has_records(out: Path) -> bool:
    """Whether ``out`` holds a run's records: ``outputs.jsonl``, or the block parts of a ``bm run --ray``
    whose driver was killed before it assembled them."""
    return (out / "outputs.jsonl").exists() or (out / RAY_PARTS).is_dir()


class OutDirError(ValueError):
    """The output directory cannot be used as asked; phrased for the user (exit code 2)."""


def check_writable_dir(out: Path, flag: str) -> Path | None:
    """``out`` is (now) a directory this process may write into; else :class:`OutDirError`. (Whether a
    write there succeeds is found by writing its lock file, :func:`prepare_out_dir`: a 0-byte probe
    passed on a full file system.)

    Returns the topmost directory created here (``out`` or a missing parent), or None when ``out``
    existed, so a command that stops on a usage error can take back what it made
    (:func:`remove_created`)."""
    if out.exists() and not out.is_dir():
        raise OutDirError(f"{flag} {str(out)!r} is a file; give a directory (it is created if missing)")
    if not out.exists() and out.suffix.lower() in (".jsonl", ".json"):  # a file name: not made a directory
        raise OutDirError(
            f"{flag} {str(out)!r} names a file, but {flag} is the directory the results go into (bm writes "
            f"its files there); give a directory such as {str(out.with_suffix(''))!r}"
        )
    created = next((p for p in reversed((out, *out.parents)) if not p.exists()), None)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutDirError(f"{flag} {str(out)!r}: cannot create the directory ({exc.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutDirError(f"{flag} {str(out)!r}: the directory is not writable; choose another")
    return created


def remove_created(out: Path, created: Path | None) -> None:
    """Remove ``out`` and its parents up to ``created`` while they are empty: a usage error must not
    leave an empty ``-o`` directory behind (a later run would then need ``--overwrite`` for nothing).
    The lock this process took there goes with it."""
    if created is None:
        return
    outlock.release(out, remove=True)
    for directory in (out, *out.parents):
        try:
            directory.rmdir()
        except OSError:  # not empty, or already gone: leave it
            return
        if directory == created:
            return


def check_baseline_kept(out: Path, baseline: Path, files: tuple[str, ...]) -> None:
    """Refuse an ``-o`` that would write over, or with ``--overwrite`` remove, the file ``--baseline``
    names: a failing gate wrote the regressed result over ``base/compare.json`` given as both, and the
    same command then passed. Compared by the file itself (device and inode), whatever the spelling
    (``./``, ``..``, a symlink on either side); a baseline inside a folder ``-o`` replaces is refused too."""
    try:
        kept = baseline.resolve(strict=True)
    except OSError:
        return  # no such file: reading the baseline says so
    for name in files:
        target = out / name
        if not (target.exists() or target.is_symlink()):
            continue
        same = target.is_file() and os.path.samefile(target, kept)
        inside = target.is_dir() and kept.is_relative_to(target.resolve())
        if same or inside:
            what = f"the {name} that -o {str(out)!r} writes" if same else f"inside {name}/ of -o {str(out)!r}"
            raise OutDirError(
                f"--baseline {str(baseline)!r} is {what}: the result would replace the baseline it is "
                f"judged against (a failing gate included); give -o another directory, e.g. "
                f"-o {str(out.parent / (out.name + '-new'))!r}"
            )


def prepare_out_dir(out: Path, *, resume: bool, overwrite: bool, prompts: Path | None = None, files: tuple[str, ...] = RUN_FILES, command: str = "bm run", prompts_name: str | None = None, baseline: Path | None = None, needed: tuple[int, str] = (0, "")) -> Path | None:  # fmt: skip
    """Check ``-o`` before anything runs: a directory (made here) that is writable, that no other
    process writes into (this process locks it first, :mod:`bm.runfiles.outlock`), on a file system with room
    for ``needed`` (bytes, and how they were reckoned: :mod:`bm.runfiles.diskspace`), holding no file that
    ``--baseline`` names (``baseline``, :func:`check_baseline_kept`), and never a previous run's results
    silently replaced: non-empty needs ``--resume`` or ``--overwrite``, which removes only bm's own
    ``files`` (so old variant folders cannot outlive the run that replaced them).

    Returns what :func:`check_writable_dir` created, for :func:`remove_created`. ``prompts_name``: the
    input as the user named it, when ``prompts`` is bm's copy of it."""
    if resume and overwrite:
        raise OutDirError("--resume and --overwrite are exclusive: keep the finished records or replace them")
    if baseline is not None:
        check_baseline_kept(out, baseline, files)
    needed_bytes, how = needed
    created = check_writable_dir(out, "-o")
    lock_created = _lock(out, created)
    present = sorted(p.name for p in out.iterdir() if p.name != outlock.LOCK_NAME)
    if present and not (resume or overwrite):
        outlock.release(out, remove=lock_created)
        hint = "--resume to finish it or " if files == RUN_FILES else ""
        raise OutDirError(
            f"-o {str(out)!r} is not empty ({', '.join(present[:4])}{' ...' if len(present) > 4 else ''}); "
            f"give {hint}--overwrite to replace it, or another directory"
        )
    try:
        check_free_space(out, needed_bytes, how, replaced=files if overwrite else ())
    except NoRoomError as exc:
        outlock.release(out, remove=lock_created)
        remove_created(out, created)
        raise OutDirError(str(exc)) from None
    if overwrite:
        for name in files:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    if resume and prompts is not None and has_records(out):
        identity = out / "run.json"
        try:
            saved = json.loads(identity.read_text(encoding="utf-8"))["prompts_sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            raise OutDirError(
                f"--resume: {str(out)!r} has no readable run.json, so its records cannot be matched to "
                f"{prompts_name or str(prompts)!r}; use --overwrite or another directory"
            ) from None
        if saved != file_digest(prompts):
            raise OutDirError(
                f"--resume: {str(out)!r} holds the records of a different prompts file than "
                f"{prompts_name or str(prompts)!r}; resume with the same file (the same bytes, when piped), "
                "or use --overwrite"
            )
    return created


def _lock(out: Path, created: Path | None) -> bool:
    """Take ``out`` for this process (before anything is written there); whether its lock file is new."""
    try:
        return outlock.acquire(out)
    except outlock.DirectoryLocked as exc:
        raise OutDirError(str(exc)) from None
    except OSError as exc:  # the first write there failed: a full file system, a read-only mount
        remove_created(out, created)
        raise OutDirError(f"-o {str(out)!r}: cannot write there ({exc.strerror})") from None
