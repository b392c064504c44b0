"""How long a sequence may grow and which attention window the cache serves, from config and model."""

from __future__ import annotations

from bm.config import BmConfig
from bm.engine.executor import ModelLimits


def max_seq_len(config: BmConfig, model: ModelLimits) -> int:
    limits = [config.engine.max_seq_len, model.max_position_embeddings]
    if model.sliding_window and not model.sliding_window_on_every_layer:
        # Only some layers slide: one engine window cannot serve them all, so a sequence never
        # outgrows the window (attention is full there, windowed or not).
        limits.append(model.sliding_window)
    given = [x for x in limits if x]
    return min(given) if given else 1 << 20


def attention_window(config: BmConfig, model: ModelLimits, max_seq_len: int) -> int | None:
    """The engine's attention window: the smaller of kv_cache.max_attention_window and the model's own
    sliding window (when every layer slides); None when no sequence can outgrow it."""
    native = model.sliding_window if model.sliding_window_on_every_layer else None
    given = [w for w in (config.kv_cache.max_attention_window, native) if w]
    window = min(given) if given else None
    return window if window is not None and window < max_seq_len else None
