"""How long a sequence may grow and which attention windows the layers and the cache serve, from config
and model."""

from __future__ import annotations

from dataclasses import dataclass

from bm.config import BatchingScheme, BmConfig
from bm.engine.execution.protocol import ModelLimits
from bm.kv.types import cdiv
from bm.kv.window_groups import WindowGroup, split_blocks, window_pool_bound
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


@dataclass(frozen=True)
class CachePools:
    """How the cache is laid out: the main pool (the one schedulers see) and any windowed pools."""

    num_blocks: int  # main pool
    attention_window: int | None  # the main table releases blocks behind it (None: it keeps them)
    sink_token_length: int  # of the main table's window
    num_layers: int  # layers the main table serves
    window_groups: tuple[WindowGroup, ...] = ()
    window_sink_token_length: int = 0


def cache_pools(
    config: BmConfig, layout: AttentionWindowLayout, num_blocks: int, max_num_requests: int, max_seq_len: int
) -> CachePools:
    """The main table serves the layers that attend furthest: with some full layer, the full layers and
    no window; otherwise every layer, released behind the largest window (no layer reads behind it).

    Layers with a narrower window get pools of their own (per-window block accounting) when every request
    keeps one table (no beams, no static V1 batch with its pad tables), no prefix is shared (block reuse
    off) and bm's own schedulers keep the iteration's tokens within ``engine.max_num_tokens``; the
    memory of ``num_blocks`` all-layer blocks is then split so that the main pool grows (up to what
    ``max_num_requests`` sequences of ``max_seq_len`` tokens can fill; past that, memory is saved).
    """
    engine, kv = config.engine, config.kv_cache
    windows = layout.windows
    main = None if any(w is None for w in windows) else max(windows)
    main_sinks = layout.sink_token_length if main is not None else 0
    narrower = sorted({w for w in windows if w is not None and w != main})
    single = CachePools(num_blocks, main, main_sinks, len(windows))
    eligible = (
        narrower
        and not kv.enable_block_reuse
        and engine.batching_scheme != BatchingScheme.V1
        and engine.max_beam_width == 1
        and not engine.scheduler
        and not engine.micro_batch_scheduler
    )
    if not eligible:
        return single
    bs = kv.tokens_per_block
    sinks = layout.sink_token_length
    bounds = [window_pool_bound(w, sinks, bs, max_num_requests, engine.max_num_tokens) for w in narrower]
    layers = [sum(x == w for x in windows) for w in narrower]
    main_layers = len(windows) - sum(layers)
    most = cdiv(max_num_requests * max_seq_len, bs)
    main_blocks, sizes = split_blocks(num_blocks, main_layers, list(zip(layers, bounds, strict=True)), most)
    if main_blocks <= num_blocks and all(size >= main_blocks for size in sizes):
        return single  # neither more capacity nor less memory
    groups = tuple(WindowGroup(w, n, size) for w, n, size in zip(narrower, layers, sizes, strict=True))
    return CachePools(main_blocks, main, main_sinks, main_layers, groups, sinks)
