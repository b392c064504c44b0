"""The output directory of ``bm run``, ``bm bench`` and ``bm compare``: checked before anything runs,
never silently replaced, readable back for ``--resume``, and removed again when a usage error stops the
command before it wrote anything. Plain Python (no torch), so ``-o`` problems are reported at once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bm.workloads.jsonl import iter_lines

FINAL_REASONS = ("end_id", "stop", "length")
RUN_FILES = ("outputs.jsonl", "stats.jsonl", "summary.json", "run.json", "batch_output.jsonl", "logits")
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


def write_run_identity(out_dir: Path, prompts: Path) -> None:
    """What ``--resume`` checks: the prompts file this directory's records belong to."""
    (out_dir / "run.json").write_text(
        json.dumps({"prompts": str(prompts), "prompts_sha256": file_digest(prompts)}, indent=2) + "\n"
    )


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class OutDirError(ValueError):
    """The output directory cannot be used as asked; phrased for the user (exit code 2)."""


def check_writable_dir(out: Path, flag: str) -> Path | None:
    """``out`` is (now) a directory this process can write into; else :class:`OutDirError`.

    Returns the topmost directory created here (``out`` or a missing parent), or None when ``out``
    existed, so a command that stops on a usage error can take back what it made
    (:func:`remove_created`)."""
    if out.exists() and not out.is_dir():
        raise OutDirError(f"{flag} {str(out)!r} is a file; give a directory (it is created if missing)")
    created = next((p for p in reversed((out, *out.parents)) if not p.exists()), None)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutDirError(f"{flag} {str(out)!r}: cannot create the directory ({exc.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutDirError(f"{flag} {str(out)!r}: the directory is not writable; choose another")
    probe = out / ".bm-write-check"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutDirError(f"{flag} {str(out)!r}: cannot write there ({exc.strerror})") from None
    return created


def remove_created(out: Path, created: Path | None) -> None:
    """Remove ``out`` and its parents up to ``created`` while they are empty: a usage error must not
    leave an empty ``-o`` directory behind (a later run would then need ``--overwrite`` for nothing)."""
    if created is None:
        return
    for directory in (out, *out.parents):
        try:
            directory.rmdir()
        except OSError:  # not empty, or already gone: leave it
            return
        if directory == created:
            return


def prepare_out_dir(out: Path, *, resume: bool, overwrite: bool, prompts: Path | None = None, files: tuple[str, ...] = RUN_FILES, command: str = "bm run") -> Path | None:  # fmt: skip
    """Check ``-o`` before anything runs: a directory (made here) that is writable, and never a previous
    run's results silently replaced: non-empty needs ``--resume`` or ``--overwrite``, which removes
    only bm's own ``files`` (so old variant folders cannot outlive the run that replaced them).

    Returns what :func:`check_writable_dir` created, for :func:`remove_created`."""
    if resume and overwrite:
        raise OutDirError("--resume and --overwrite are exclusive: keep the finished records or replace them")
    created = check_writable_dir(out, "-o")
    present = sorted(p.name for p in out.iterdir())
    if present and not (resume or overwrite):
        hint = "--resume to finish it or " if files == RUN_FILES else ""
        raise OutDirError(
            f"-o {str(out)!r} is not empty ({', '.join(present[:4])}{' ...' if len(present) > 4 else ''}); "
            f"give {hint}--overwrite to replace it, or another directory"
        )
    if overwrite:
        for name in files:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    if resume and prompts is not None and (out / "outputs.jsonl").exists():
        identity = out / "run.json"
        try:
            saved = json.loads(identity.read_text(encoding="utf-8"))["prompts_sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            raise OutDirError(
                f"--resume: {str(out)!r} has no readable run.json, so its records cannot be matched to "
                f"{str(prompts)!r}; use --overwrite or another directory"
            ) from None
        if saved != file_digest(prompts):
            raise OutDirError(
                f"--resume: {str(out)!r} holds the records of a different prompts file than "
                f"{str(prompts)!r}; resume with the same file, or use --overwrite"
            )
    return created
