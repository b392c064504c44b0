"""Hugging Face hub ids (``org/name``) as vLLM users give them, found in the local Hugging Face cache.

A vLLM user types ``--model Qwen/Qwen2.5-0.5B-Instruct``; bm runs offline and never downloads, but the
checkpoint is often already in the cache that ``huggingface-cli download`` or an earlier vLLM run
filled. So a name that is not a local path and is spelled as a hub id is looked up there (the snapshot
``main`` points at, through ``huggingface_hub`` with ``local_files_only``), and a missing one is refused
naming the cache directory looked in and the local-directory form. The id stays the model's name (what
``run.json`` records and a batch response echoes); only the loader and the digests read the snapshot.

Plain Python (no torch), so the config can refuse a missing id before anything loads. The cache
directory is read from the environment when asked (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
``XDG_CACHE_HOME``/huggingface/hub, else ``~/.cache/huggingface/hub``), as ``huggingface_hub`` reads it
at its import, so a test or a shell that sets it later is obeyed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name as the hub spells a repo id: one slash, no leading dot, slash or tilde
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class HubCacheError(ValueError):
    """A hub id that is not in the local cache; the message names the cache and the fix."""


def is_hub_id(text: str) -> bool:
    """Whether ``text`` names a hub repo rather than a local path: ``org/name`` with nothing at that path
    (a directory named so wins, as it does for transformers)."""
    return bool(_HUB_ID.match(text)) and ".." not in text and not Path(text).exists()


def hub_cache_dir() -> Path:
    """Where the Hugging Face hub cache is, by the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "huggingface" / "hub"


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot directory of ``repo_id`` (the revision ``main`` points at), or None when the
    cache does not hold it. Never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        found = snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError):
        return None
    path = Path(found)
    return path if path.is_dir() else None


def local_dir(text: str) -> str:
    """``text`` as a local path: a hub id becomes its cached snapshot, anything else stays as it is (a
    missing hub id too: the caller's own check says so, naming its setting)."""
    if not is_hub_id(text):
        return text
    snapshot = cached_snapshot(text)
    return str(snapshot) if snapshot is not None else text


def check_cached(setting: str, text: str, flag: str = "--model") -> None:
    """Raise :class:`HubCacheError` when ``text`` is a hub id the local cache does not hold; ``setting``
    (``--model``, ``model.tokenizer``) and ``flag`` (the local-directory form to name) phrase it."""
    if is_hub_id(text) and cached_snapshot(text) is None:
        raise HubCacheError(
            f"{setting} {text!r}: no such local directory, and {text!r} is not in the Hugging Face cache "
            f"({hub_cache_dir()}); bm never downloads: give a local checkpoint directory ({flag} DIR), "
            f"or fetch it into that cache first (huggingface-cli download {text})"
        )
