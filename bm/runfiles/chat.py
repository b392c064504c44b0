"""Chat templates given with ``--chat-template``: read and checked before the model loads (no torch)."""

from __future__ import annotations

from pathlib import Path

from bm.chat_template import ChatTemplateError

__all__ = ["ChatTemplateError", "read_chat_template"]


def read_chat_template(path: Path, name: str = "--chat-template") -> str:
    """A chat template file (Jinja), checked before the model loads: the one check of ``bm run
    --chat-template`` and of ``bm.ray.run_batch(chat_template=...)``, whose errors name the setting as
    the caller's user wrote it (``name``)."""
    if not path.is_file():
        raise ChatTemplateError(f"{name} {str(path)!r}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{name} {str(path)!r}: not a readable UTF-8 text file ({exc})") from None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateError as exc:
        raise ChatTemplateError(f"{name} {str(path)!r}: not a valid Jinja template: {exc}") from None
    return text
