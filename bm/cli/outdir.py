"""The output directory of ``bm run``, ``bm bench``, ``bm compare`` and ``bm sweep``: checked before
anything runs, locked for one writer (:mod:`bm.cli.outlock`), checked for room (:mod:`bm.cli.diskspace`),
never silently replaced (a ``--baseline`` in it included), readable back for ``--resume`` (which
refuses another model, by name or by its files' contents: :mod:`bm.cli.model_files`), and removed again
when a usage error stops the command before it wrote anything. Plain Python (no torch), so ``-o``
problems are reported at once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bm
from bm.cli import outlock
from bm.cli.diskspace import NoRoomError, check_free_space
from bm.cli.model_files import model_files, model_files_change
from bm.config import BmConfig
from bm.engine.seeds import random_run_seed
from bm.files import write_whole
from bm.workloads.jsonl import iter_lines

FINAL_REASONS = ("end_id", "stop", "length")
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


# Config keys that decide how fast and where a run goes, never which tokens a request gets (bm's outputs
# equal HF's alone under every scheduler, batch size, cache size and kernel), plus the sections bm run
# does not read. A resume may change them; every other key is in the digest.
NOT_IN_DIGEST = (
    "model.device", "model.prepack", "model.fused_elementwise", "model.fused_projections",
    "engine.batching_scheme", "engine.scheduler_policy", "engine.max_batch_size", "engine.max_num_tokens",
    "engine.max_num_active_requests", "engine.enable_chunked_context", "engine.context_chunking_policy",
    "engine.context_chunk_size", "engine.capacity_scheduler", "engine.micro_batch_scheduler",
    "engine.scheduler",
    "kv_cache.tokens_per_block", "kv_cache.max_tokens", "kv_cache.free_memory_fraction",
    "kv_cache.enable_block_reuse",
    "peft_cache", "bench", "sim",
)  # fmt: skip
IDENTITY_LABELS = {  # run.json key -> how the refusal names it, in the order they are checked
    "bm_version": "bm's version",
    "model": "the model",
    "model_files": "the model",  # its files' contents (bm.cli.model_files), compared by digest
    "config": "the config",
    "options": "the run options",
    "seed": "the run seed",
}


def run_identity(
    prompts: Path,
    config: BmConfig,
    options: dict[str, Any],
    seed: int | None = None,
    name: str | None = None,
    known: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a run directory's records depend on, known before the model loads (so a refused
    ``--resume`` costs nothing): the prompts file, bm's version, the model as named and by the contents
    of its files (:func:`bm.cli.model_files.model_files`), the config keys that change outputs (and their
    digest), the run's own options (``--max-tokens`` ...) and the run seed that unseeded lines derive
    theirs from (null: a run from before run seeds, where every unseeded line sampled with seed 0).
    ``loaded`` (the model as it loaded) is added by :func:`write_run_identity`. ``name`` is the input as
    the user gave it, when ``prompts`` is bm's copy of a pipe or gzip file (the digest is of the bytes
    the run read). ``known``: the run.json being resumed (:func:`saved_identity`), whose file digests
    are reused for files that have not changed since."""
    settings = effective_settings(config)
    recorded = known.get("model_files") if isinstance(known, dict) else None
    return {
        "prompts": name if name is not None else str(prompts),
        "prompts_sha256": file_digest(prompts),
        "bm_version": bm.__version__,
        "model": model_named(config),
        "model_files": model_files(config, prompts, recorded),
        "config_sha256": hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest(),
        "config": settings,
        "config_not_in_digest": list(NOT_IN_DIGEST),
        "options": options,
        "seed": seed,
    }


def has_records(out: Path) -> bool:
    """Whether ``out`` holds a run's records: ``outputs.jsonl``, or the block parts of a ``bm run --ray``
    whose driver was killed before it assembled them."""
    return (out / "outputs.jsonl").exists() or (out / RAY_PARTS).is_dir()


def check_resume_mode(out: Path, ray: bool) -> None:
    """``--resume`` goes on the way the run went: a ``--ray`` run keeps its records in block parts, which
    a one-process resume does not read (and the other way round), so mixing them is refused."""
    parts = (out / RAY_PARTS).is_dir()
    if ray and not parts and (out / "outputs.jsonl").exists():
        raise OutDirError(
            f"--resume --ray: {str(out)!r} holds a run made without --ray; resume it without --ray, or use "
            "a new -o directory or --overwrite"
        )
    if not ray and parts:
        raise OutDirError(
            f"--resume: {str(out)!r} holds a bm run --ray run (its records are in parts/); resume it with "
            "--ray, or use a new -o directory or --overwrite"
        )


def run_seed_for(out: Path, given: int | None, resume: bool) -> int | None:
    """The run seed: ``--seed``; on ``--resume`` the seed run.json recorded (a different ``--seed`` is
    then refused by :func:`check_run_identity`); else a fresh random one, recorded for the next resume."""
    if resume and has_records(out):
        saved = saved_identity(out)
        if saved is not None and "seed" in saved:
            return saved["seed"] if given is None else given
    return given if given is not None else random_run_seed()


def run_options(
    max_tokens: int, ignore_eos: bool, chat_template: str | None, tool_call_parser: str | None = None
) -> dict[str, Any]:
    """``bm run``'s own flags that change outputs: the default output length, EOS, the chat template,
    and the tool-call parser when one is named (only then, so run directories written before the flag
    existed still resume)."""
    template = hashlib.sha256(chat_template.encode()).hexdigest() if chat_template is not None else None
    options = {"--max-tokens": max_tokens, "--ignore-eos": ignore_eos, "--chat-template (sha256)": template}
    if tool_call_parser is not None:
        options["--tool-call-parser"] = tool_call_parser
    return options


def model_named(config: BmConfig) -> str:
    """The model as the user named it: a preset, or an absolute path (so ``./ckpt`` equals its path)."""
    model = config.model
    if model.preset:
        return f"preset {model.preset}"
    if model.path or model.config:
        kind, value = ("path", model.path) if model.path else ("config", model.config)
        return f"{kind} {Path(str(value)).resolve()}"
    return "embedded tiny-llama"


def effective_settings(config: BmConfig) -> dict[str, Any]:
    """The config's keys (dotted) that change outputs, as JSON values; model files as absolute paths."""
    settings: dict[str, Any] = {}
    for section, values in config.to_dict().items():
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if section in NOT_IN_DIGEST or dotted in NOT_IN_DIGEST:
                continue
            if section == "model" and key in ("path", "config", "tokenizer") and value is not None:
                value = str(Path(str(value)).resolve())
            settings[dotted] = json.loads(json.dumps(value, default=str))
    return settings


def saved_identity(out: Path) -> dict[str, Any] | None:
    """The identity ``out/run.json`` records (:func:`run_identity`), None when it is missing or unreadable."""
    try:
        saved = json.loads((out / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def check_run_identity(out: Path, identity: dict[str, Any]) -> None:
    """Refuse ``--resume`` into a directory whose records came from another model (by name or by the
    contents of its files), config, run options or bm version (they would be mixed into one
    ``outputs.jsonl``), naming what changed.

    A run.json written before bm digested the model's files records its path only; it is refused, as
    any run.json that lacks a key is: whether the files behind that path changed since cannot be told,
    and telling is the check's whole point (bm's version, also checked, changes with every release, so
    only a run and its resume by two builds of one version meet this)."""
    if not has_records(out):
        return
    saved = saved_identity(out)
    fix = "resume with the same settings, or use a new -o directory or --overwrite"
    if saved is None or any(key not in saved for key in IDENTITY_LABELS if key != "model_files"):
        raise OutDirError(
            f"--resume: {str(out)!r} does not record the model and config its records came from "
            f"(written by an older bm, or run.json is missing); {fix}"
        )
    for key, label in IDENTITY_LABELS.items():
        if key == "model_files":
            if key not in saved:
                raise OutDirError(
                    f"--resume: {str(out)!r} records the model by its path only (run.json written by a bm "
                    "that did not digest the model's files), so whether its records came from the files "
                    f"there now cannot be told; use a new -o directory or --overwrite"
                )
            change = model_files_change(saved[key] or {}, identity[key])
            if change is not None:
                raise OutDirError(f"--resume: {label} changed: {change}; {fix}")
        elif saved[key] != identity[key]:
            raise OutDirError(f"--resume: {label} changed: {_difference(saved[key], identity[key])}; {fix}")


def _difference(before: Any, now: Any) -> str:
    """``engine.max_seq_len 512 -> 1024`` for the first key that differs, else ``before -> now``."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(set(before) | set(now)):
            if before.get(key) != now.get(key):
                return f"{key} {json.dumps(before.get(key))} -> {json.dumps(now.get(key))}"
    return f"{before} -> {now}"


def write_run_identity(out_dir: Path, identity: dict[str, Any], loaded: str) -> None:
    """Record what ``--resume`` checks (see :func:`run_identity`), with the model as it loaded; written
    whole (a kill or a full disk mid-write leaves the previous run.json, never an empty one)."""
    write_whole(out_dir / "run.json", json.dumps({**identity, "loaded": loaded}, indent=2) + "\n")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    process writes into (this process locks it first, :mod:`bm.cli.outlock`), on a file system with room
    for ``needed`` (bytes, and how they were reckoned: :mod:`bm.cli.diskspace`), holding no file that
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
