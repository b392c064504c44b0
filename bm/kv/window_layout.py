"""Which attention layers slide, and over how many tokens: pure Python, shared by the KV manager, the
engine and the runner.

Models mix layouts: Mistral slides on every layer, Gemma 2 on every other, Gemma 3 on five of every six,
Qwen2 above ``max_window_layers``. ``kv_cache.max_attention_window`` narrows that further, either one
window for every layer or a list repeated over the layers (as TensorRT-LLM's ``max_attention_window``).
A sequence may then run to the model's full length: each layer attends within its own window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionWindowLayout:
    """Per layer (by layer index): its attention window in tokens, or None for full attention."""

    windows: tuple[int | None, ...]
    sink_token_length: int = 0  # first tokens every windowed layer keeps attending (StreamingLLM sinks)

    @classmethod
    def build(
        cls,
        model_windows: Sequence[int | None],
        max_attention_window: int | Sequence[int] | None = None,
        sink_token_length: int = 0,
        max_seq_len: int | None = None,
    ) -> AttentionWindowLayout:
        """The model's own per-layer windows narrowed by the configured ones (the smaller wins per layer).

        A configured list shorter than the layers repeats from its start. A window no sequence can outgrow
        (``>= max_seq_len``) is full attention. Sinks apply only where a configured window is.
        """
        n = len(model_windows)
        if max_attention_window is None:
            given: list[int | None] = [None] * n
        elif isinstance(max_attention_window, int):
            given = [max_attention_window] * n
        else:
            pattern = list(max_attention_window)
            if not pattern:
                raise ValueError("max_attention_window: an empty list; give one window or one per layer")
            given = [pattern[i % len(pattern)] for i in range(n)]
        windows: list[int | None] = []
        for own, configured in zip(model_windows, given, strict=True):
            options = [w for w in (own, configured) if w is not None]
            window = min(options) if options else None
            if window is not None and max_seq_len is not None and window >= max_seq_len:
                window = None
            windows.append(window)
        sinks = sink_token_length if max_attention_window is not None and any(windows) else 0
        return cls(tuple(windows), sinks)

    @property
    def distinct(self) -> list[int | None]:
        """The different windows in layer order (None: full attention), each once."""
        return list(dict.fromkeys(self.windows))

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one; None when some layer attends everything."""
        distinct = self.distinct
        return distinct[0] if len(distinct) == 1 else None

    @property
    def is_mixed(self) -> bool:
        """Some layers slide and others do not (or slide over a different span)."""
        return len(self.distinct) > 1

    @property
    def num_windowed_layers(self) -> int:
        return sum(w is not None for w in self.windows)
