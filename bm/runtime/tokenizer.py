"""Text in and out. The embedded default model uses a byte-level tokenizer built here, so nothing is
downloaded; checkpoints bring their own Hugging Face tokenizer, wrapped to the same two methods."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from bm.chat_template import ChatTemplateError, jinja_renderer

ChatRenderer = Callable[[list[dict[str, Any]]], list[int]]


class TextCodec(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_word(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids: 0 pad, 1 bos, 2 eos."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    num_special = 3
    vocab_size = 256 + num_special

    def encode(self, text: str) -> list[int]:
        return [b + self.num_special for b in text.encode("utf-8")]

    def encode_word(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t - self.num_special for t in token_ids if self.num_special <= t < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter over a transformers tokenizer: prompts are encoded as the tokenizer's defaults say."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def encode_word(self, text: str) -> list[int]:
        """A stop or bad word: its tokens alone, without the BOS a prompt gets."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat rendered with the checkpoint's template (or ``chat_template``), as token ids.

        Rendered to text first, then encoded without special tokens: the template writes its own BOS.
        """
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                tools=tools,
            )
        except Exception as exc:  # a template is a program: any of its errors is the caller's to fix
            raise ChatTemplateError(f"messages: the chat template failed: {exc}") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_renderer(tokenizer: TextCodec | None, chat_template: str | None = None) -> ChatRenderer | None:
    """Chat turns -> prompt ids with ``chat_template`` (Jinja text) or else the tokenizer's own template;
    None when there is neither. One definition for ``bm run``'s ``messages`` lines and ``LLM.chat``."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, HFTokenizer) and (chat_template is not None or tokenizer.chat_template):
        return functools.partial(tokenizer.apply_chat_template, chat_template=chat_template)
    if chat_template is None:
        return None
    render = jinja_renderer(chat_template)
    return lambda messages, tools=None: tokenizer.encode(render(messages, tools=tools))
