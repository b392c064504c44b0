"""The model by its contents, for ``run.json``: a SHA-256 of every file that decides a run's outputs.

``--resume`` used to compare the model's *path*: after a config behind the same path went from 6 layers to
2, a resume was accepted and ``outputs.jsonl`` held 128 records of one model and 172 of the other. The
files digested are those the loader reads: the model config JSON of ``model.config`` (random weights:
its contents and ``model.seed`` decide them), every top-level file of a checkpoint directory (config,
weights, tokenizer files and the chat template inside them), the ``model.tokenizer`` directory, the GGUF
file a preset is converted from, and the ``lora_dir`` adapters the prompts file names. A checkpoint's
subdirectories are not read by the loader (``original/`` holds a second copy of Meta's weights), nor are
its ``*.md`` and licence files; where it holds ``*.safetensors`` its ``*.bin``/``*.pt`` copies are not
read either, and are skipped.

Every file's contents are hashed in full (about 350 MB/s on one core here: a 500 MB checkpoint costs
1.4 s once; the shards of a larger one are hashed on as many threads as there are cores, up to 8). A digest of the safetensors headers plus sizes and modification times would be cheap but
not sound: ``rsync -t`` or ``cp -p`` of other weights of the same size keeps the modification time, and
a header says nothing of the values. What is recorded beside each digest is the file's identity and
change time (device, inode, size, ``mtime_ns``, ``ctime_ns``); a later digest of the same file reuses
the recorded one only when all five are unchanged. The kernel sets ``ctime`` on every write, rename over
and metadata change, and no system call sets it back (``utime`` sets ``mtime`` and moves ``ctime`` to
now), so new contents behind an unchanged record would take a write within the same timestamp tick as
the one recorded. To rule that out, a file changed less than :data:`SETTLED_S` before it is hashed gets
no reusable record (it is hashed again next time). A resume of a large checkpoint so costs nothing more,
and its first run costs one read of the files, which the load then finds in the page cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bm.config import BmConfig
from bm.hub_cache import local_dir
from bm.preset_files import preset_gguf

SETTLED_S = 2.0  # coarser than any file system's timestamp tick (FAT's is 2 s; ext4's a few ms)
NOT_READ = (".md", ".gguf", ".onnx", ".h5", ".msgpack", ".ot")  # never read by a checkpoint's loader
SECOND_COPIES = (".bin", ".pt", ".pth", ".ckpt")  # unread when the directory holds *.safetensors
NOT_READ_NAMES = ("license", "licence", "readme", "notice", "use_policy")
NAMED_JSON = ("config.json", "generation_config.json", "adapter_config.json")  # a change is named by its key
MAX_NAMED_JSON_BYTES = 1 << 20
MAX_HASH_THREADS = 8  # a sharded checkpoint's files are hashed side by side

_memo: dict[tuple[Any, ...], str] = {}  # (path, *stat signature) -> sha256, within this process
_memo_lock = threading.Lock()


def model_files(
    config: BmConfig, prompts: Path | None, known: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``{source: {"path", "files": {name: {"sha256", "size", "stat"}}, "json": {name: contents}}}`` for
    the model (``model``), ``model.tokenizer`` (``tokenizer``) and each adapter ``model.lora_modules`` or the
    prompts file names (``adapter DIR``). ``known``: a previous result (a resumed run's ``run.json``), whose digests are
    reused for files whose recorded identity is unchanged."""
    model = config.model
    sources: dict[str, Path] = {}
    if model.preset:
        gguf = preset_gguf(model.preset)  # its converted checkpoint follows from it and bm's version
        if gguf is not None:
            sources["model"] = gguf
    elif model.path or model.config:  # a hub id: its cached snapshot's files (bm.hub_cache)
        sources["model"] = Path(local_dir(str(model.path or model.config))).resolve()
    if model.tokenizer:
        sources["tokenizer"] = Path(local_dir(str(model.tokenizer))).resolve()
    # the adapters an OpenAI batch line may name (model.lora_modules), and those bm lines name
    for directory in (Path(d).resolve() for d in (model.lora_modules or {}).values()):
        sources[f"adapter {directory}"] = directory
    if prompts is not None:
        for directory in adapter_dirs(prompts):
            sources[f"adapter {directory}"] = directory
    known = known if isinstance(known, dict) else {}
    return {label: _source(path, known.get(label)) for label, path in sources.items()}


def model_files_change(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between two :func:`model_files` results, by content (a file whose contents are the
    same but whose time changed is no change): ``config.json of /ckpt: num_hidden_layers 6 -> 2``, the
    first three differences; None when none."""
    changes: list[str] = []
    for label in sorted(set(before) | set(now)):
        was, is_ = before.get(label) or {}, now.get(label) or {}
        if was.get("path") != is_.get("path"):
            changes.append(f"{label}: {was.get('path')} -> {is_.get('path')}")
            continue
        old, new = was.get("files") or {}, is_.get("files") or {}
        for name in sorted(set(old) | set(new)):
            root = str(is_.get("path"))
            where = root if Path(root).name == name else f"{name} of {root}"  # a file, or one of a folder
            if name not in old or name not in new:
                changes.append(f"{where}: {'added' if name in new else 'removed'}")
            elif old[name].get("sha256") != new[name].get("sha256"):
                changes.append(_content_change(where, name, was, is_, old[name], new[name]))
    if not changes:
        return None
    more = f"; and {len(changes) - 3} more" if len(changes) > 3 else ""
    return "; ".join(changes[:3]) + more


def adapter_dirs(prompts: Path) -> list[Path]:
    """The ``lora_dir`` directories a bm prompts file names (relative ones against its directory, as its
    reader resolves them), in order of first use. Only lines holding the word are parsed."""
    found: dict[Path, None] = {}
    with prompts.open("rb") as f:
        for raw in f:
            if b'"lora_dir"' not in raw:
                continue
            try:
                value = json.loads(raw).get("lora_dir")
            except (ValueError, AttributeError):
                continue  # the run refuses the line itself
            if isinstance(value, str) and value:
                found.setdefault((prompts.parent / value).resolve(), None)
    return list(found)


def _source(path: Path, known: dict[str, Any] | None) -> dict[str, Any]:
    """One model file or directory: its files' digests, and the contents of its small config JSONs."""
    if path.is_dir():
        root, names = path, _read_files(path)
    elif path.is_file():
        root, names = path.parent, [path.name]
    else:
        return {"path": str(path), "files": {}}  # missing: the load says so
    known_files = (known or {}).get("files") or {} if (known or {}).get("path") == str(path) else {}
    workers = min(len(names), os.cpu_count() or 1, MAX_HASH_THREADS)
    with ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:  # hashlib lets go of the GIL
        entries = pool.map(lambda name: _file_entry(root / name, known_files.get(name)), names)
        files = dict(zip(names, entries, strict=True))
    named = {}
    for name in names:
        if (name in NAMED_JSON or path.is_file()) and files[name]["size"] <= MAX_NAMED_JSON_BYTES:
            with contextlib.suppress(OSError, ValueError):  # not JSON: its digest alone tells a change
                named[name] = json.loads((root / name).read_text(encoding="utf-8"))
    return {"path": str(path), "files": files, "json": named}


def _read_files(directory: Path) -> list[str]:
    """The top-level files of a checkpoint (or tokenizer, or adapter) directory that its loader reads."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    has_safetensors = any(name.endswith(".safetensors") for name in names)
    return [
        name
        for name in names
        if not name.lower().endswith(NOT_READ)
        and not name.lower().startswith(NOT_READ_NAMES)
        and not (has_safetensors and name.lower().endswith(SECOND_COPIES))
    ]


def _file_entry(path: Path, known: dict[str, Any] | None) -> dict[str, Any]:
    """``{"sha256", "size", "stat"}`` of one file; the digest of ``known`` (or of this process's earlier
    digest) when the file's recorded identity is unchanged and was settled (see the module's doc)."""
    before = path.stat()
    signature = _signature(before)
    settled = time.time_ns() - max(before.st_ctime_ns, before.st_mtime_ns) > SETTLED_S * 1e9
    with _memo_lock:
        reused = _memo.get((str(path), *signature)) if settled else None
    if reused is None and settled and known is not None and known.get("stat") == signature:
        reused = known.get("sha256")
    digest = reused or _sha256(path)
    if reused is None and _signature(path.stat()) != signature:
        settled = False  # it changed while it was read: the digest is of no one version; never reuse it
    if settled:
        with _memo_lock:
            _memo[(str(path), *signature)] = digest
    return {"sha256": digest, "size": before.st_size, "stat": signature if settled else None}


def _signature(stat: Any) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _content_change(
    where: str, name: str, was: dict[str, Any], is_: dict[str, Any], old: dict[str, Any], new: dict[str, Any]
) -> str:
    before, now = (was.get("json") or {}).get(name), (is_.get("json") or {}).get(name)
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(set(before) | set(now)):
            if before.get(key) != now.get(key):
                return f"{where}: {key} {_short(before.get(key))} -> {_short(now.get(key))}"
    return f"{where}: its contents changed (sha256 {str(old.get('sha256'))[:12]} -> {str(new.get('sha256'))[:12]})"


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
