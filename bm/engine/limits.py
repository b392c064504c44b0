"""How long a sequence may grow and which attention windows the layers and the cache serve, from config
and model."""

from __future__ import annotations

from bm.config import BmConfig
from bm.engine.executor import ModelLimits
from bm.kv.window_layout import AttentionWindowLayout


def max_seq_len(config: BmConfig, model: ModelLimits) -> int:
    """Sliding windows never cap it: each layer attends within its own window, however long the sequence."""
    given = [x for x in (config.engine.max_seq_len, model.max_position_embeddings) if x]
    return min(given) if given else 1 << 20


def window_layout(config: BmConfig, model: ModelLimits, max_seq_len: int) -> AttentionWindowLayout:
    """Every layer's window: the model's own per layer narrowed by kv_cache.max_attention_window."""
    own = model.layer_windows or (model.sliding_window if model.sliding_window_on_every_layer else None,)
    kv = config.kv_cache
    return AttentionWindowLayout.build(own, kv.max_attention_window, kv.sink_token_length, max_seq_len)


def attention_window(config: BmConfig, model: ModelLimits, max_seq_len: int) -> int | None:
    """The window the KV cache releases blocks behind: the one every layer shares, None when some layer
    attends further (its blocks must stay) or no sequence can outgrow it."""
    return window_layout(config, model, max_seq_len).uniform_window
