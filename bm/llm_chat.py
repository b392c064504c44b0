"""Chats rendered to prompt text for ``LLM.chat``, with vLLM's chat keywords.

Why text first, then ids: vLLM's chat outputs carry the rendered prompt in ``RequestOutput.prompt``, and
``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` are the template's
own variables; rendering to text with them, then encoding without special tokens (the template writes
its own BOS), is how transformers' ``apply_chat_template(tokenize=True)`` arrives at the same ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bm.llm_params import InvalidParameterError


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> tuple[str, list[int]]:
    """``(prompt text, prompt ids)`` of one chat. Raises :class:`InvalidParameterError` naming the
    keyword (or the template's own error) when it cannot be rendered."""
    messages = [_text_content(i, m) for i, m in enumerate(messages)]
    check_chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs, messages)
    hf = getattr(tokenizer, "tokenizer", None)  # a checkpoint's Hugging Face tokenizer
    template = chat_template or (getattr(hf, "chat_template", None) if hf is not None else None)
    if tokenizer is None or template is None:
        raise InvalidParameterError(
            "this model has no chat template; pass chat_template= (Jinja text) or use generate()"
        )
    extra = dict(chat_template_kwargs or {})
    try:
        if hf is not None:
            text = hf.apply_chat_template(
                list(messages),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                tokenize=False,
                **extra,
            )
            return text, list(hf(text, add_special_tokens=False)["input_ids"])
        text = _jinja(template, messages, tools, add_generation_prompt and not continue_final_message, extra)
    except InvalidParameterError:
        raise
    except Exception as exc:  # a template is a program: any of its errors is the caller's to fix
        raise InvalidParameterError(f"messages: the chat template failed: {exc}") from None
    if continue_final_message:
        text = _cut_after_final_message(text, messages)
    return text, tokenizer.encode(text)


def check_chat_options(
    add_generation_prompt: Any, continue_final_message: Any, kwargs: Any, messages: Sequence[Any]
) -> None:
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(value, bool):
            raise InvalidParameterError(f"LLM.chat({name}=...): expected True or False, got {value!r}")
    if continue_final_message and add_generation_prompt:
        raise InvalidParameterError(
            "LLM.chat(continue_final_message=True): it continues the last message, so it cannot also open a "
            "new turn; pass add_generation_prompt=False with it (as vLLM requires)"
        )
    if continue_final_message and not (messages and isinstance(messages[-1].get("content"), str)):
        raise InvalidParameterError(
            "LLM.chat(continue_final_message=True): the last message must have text content to continue"
        )
    if kwargs is not None and not (isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs)):
        raise InvalidParameterError(
            f"LLM.chat(chat_template_kwargs=...): expected a mapping of template variables, got {kwargs!r}"
        )


def _jinja(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    extra: dict[str, Any],
) -> str:
    """A chat rendered by Jinja as transformers renders it (sandboxed, trimmed blocks), for tokenizers
    without a template engine of their own (bm's byte tokenizer)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(
            **{"eos_token": "", "bos_token": "", **extra},
            messages=list(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError as exc:
        raise InvalidParameterError(f"messages: the chat template failed: {exc}") from None


def _text_content(index: int, message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message whose content is OpenAI's list of parts, as text: its text parts joined by newlines
    (vLLM's 'string' content format); a part that is not text is refused, as bm runs text-only models."""
    if not isinstance(message, Mapping):
        raise InvalidParameterError(
            f"messages[{index}]: expected a turn {{'role': ..., 'content': ...}}, got {type(message).__name__}"
        )
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not (
            isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidParameterError(
                f"messages[{index}].content: a {kind!r} part; bm runs text-only models and takes text parts "
                "({'type': 'text', 'text': ...}) or a string"
            )
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """The rendered chat ending right after the last message's text (whatever the template writes to
    close the turn removed), as transformers' ``continue_final_message`` does."""
    final = str(messages[-1]["content"]).strip()
    at = text.rfind(final)
    if not final or at < 0:
        raise InvalidParameterError(
            "LLM.chat(continue_final_message=True): the template does not write the last message's text "
            "as given, so it cannot be continued; pass the prompt text to generate() instead"
        )
    return text[: at + len(final)]
