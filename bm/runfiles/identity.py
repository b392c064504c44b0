"""What a run's records depend on, kept in ``run.json`` and checked by ``--resume``: the prompts file,
bm's version, the model (as named, and by its files' contents: :mod:`bm.runfiles.model_files`), the config
keys that change outputs, the run's own options and its run seed. Known before the model loads, so a
refused resume costs nothing. Plain Python (no torch)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import bm
from bm.config import BmConfig
from bm.engine.requests.seeds import random_run_seed
from bm.files import file_digest, write_whole
from bm.runfiles.model_files import model_files, model_files_change
from bm.runfiles.outdir import RAY_PARTS, OutDirError, has_records

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
    "model_files": "the model",  # its files' contents (bm.runfiles.model_files), compared by digest
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
    of its files (:func:`bm.runfiles.model_files.model_files`), the config keys that change outputs (and their
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
