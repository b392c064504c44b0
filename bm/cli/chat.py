"""Chat templates given with ``--chat-template``: read and checked before the model loads (no torch)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bm.workloads.request import RowError


class ChatTemplateError(ValueError):
    """The chat template cannot be read or compiled; phrased for the user."""


def jinja_renderer(template: str, eos: Any) -> Callable[[list[dict[str, Any]]], str]:
    """Render a chat template the way transformers does (sandboxed Jinja, trimmed blocks)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        compiled = env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"--chat-template: not a valid Jinja template: {exc}") from None

    def render(messages: list[dict[str, Any]]) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, eos_token="", bos_token="")
        except TemplateError as exc:
            raise RowError(f"messages: the chat template failed: {exc}") from None

    return render


def read_chat_template(path: Path) -> str:
    """A chat template file (Jinja), checked before the model loads."""
    if not path.is_file():
        raise ChatTemplateError(f"--chat-template {str(path)!r}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(
            f"--chat-template {str(path)!r}: not a readable UTF-8 text file ({exc})"
        ) from None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateError as exc:
        raise ChatTemplateError(f"--chat-template {str(path)!r}: not a valid Jinja template: {exc}") from None
    return text
