"""A request's decoding controls beyond temperature / top-k / top-p: plain values, no torch.

Here, below the engine and the runtime, because the scheduler's request record carries them and both
the engine (which validates them) and the runtime (which applies them) read the same object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Controls:
    """The validated controls beyond temperature / top-k / top-p, as plain values: the one type the
    engine validates into (bm.engine.requests.request), the scheduler carries on each request and the runtime
    reads (its per-request decoding state holds these controls, not a copy of them)."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_length: int = 0
    no_repeat_ngram_size: int = 0
    embedding_bias: tuple[float, ...] | None = None
    bad_words_list: tuple[tuple[int, ...], ...] = ()
    stop_words_list: tuple[tuple[int, ...], ...] = ()
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    logits_post_processor: Callable[..., Any] | None = None
    len_penalty: float = 1.0
    early_stopping: int = 1
    guided: Any = None  # a bm.engine.requests.structured.GuidedSpec: the runtime masks tokens to follow it
    top_log_probs: int = 0  # most likely tokens returned per position (with return_log_probs)

    @property
    def processes_logits(self) -> bool:
        """Whether any control rewrites logits before sampling."""
        return (
            self.logits_post_processor is not None
            or self.embedding_bias is not None
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_length > 0
            or self.no_repeat_ngram_size > 0
            or bool(self.bad_words_list)
        )

    @property
    def reads_output(self) -> bool:
        """Whether sampling the next token needs the tokens generated so far on the host (n-gram and
        multi-token bad words, a post-processor, a grammar): the core's overlap scheduler then runs the
        request's steps in order, since the last of those tokens may still be on the device.

        The penalties need the output's token counts only, and the runtime counts a token still pending
        on the device there (bm.runtime.logits), so a request with penalties overlaps."""
        return (
            self.guided is not None
            or self.logits_post_processor is not None
            or self.no_repeat_ngram_size > 0
            or any(len(word) > 1 for word in self.bad_words_list)
        )

    @property
    def needs_runtime_state(self) -> bool:
        return bool(
            self.guided is not None
            or self.processes_logits
            or self.stop_words_list
            or self.return_log_probs
            or self.return_context_logits
            or self.return_generation_logits
        )
