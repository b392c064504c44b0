"""Chat templates as Jinja text, rendered the way transformers renders them; pure Python (jinja2, no torch),
so ``--chat-template`` is checked before the model loads and tokenizers without a template engine of
their own (the embedded byte-level one) can still render chats."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ChatTemplateError(ValueError):
    """A chat template that cannot be compiled or that fails on a chat; phrased for the user."""


def jinja_renderer(template: str) -> Callable[..., str]:
    """Render a chat template the way transformers does (sandboxed Jinja, trimmed blocks), for tokenizers
    that have no ``apply_chat_template`` of their own (the embedded byte-level one)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        compiled = env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template: not a valid Jinja template: {exc}") from None

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return compiled.render(
                messages=messages, tools=tools, add_generation_prompt=True, eos_token="", bos_token=""
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template failed: {exc}") from None

    return render
