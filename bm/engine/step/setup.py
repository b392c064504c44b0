"""Everything an engine core needs before its first step, built in one place and in order.

Resolve the budgets for the executor's device, size the KV cache, lay out the windowed pools, build the
one KV cache manager, bind the executor to the cache (it allocates its tensors), warm it up (compiles
and CUDA graph captures happen here, not in the first steps), then build the scheduler over the cache.
The engine loop, the distributed engine and the simulator all get their core through
:func:`bm.engine.step.core.EngineCore`, which calls :func:`set_up_core`; nothing else sizes a cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bm.config import BatchingScheme, BmConfig, resolve_engine
from bm.engine.execution.peft_cache import PeftCache
from bm.engine.execution.protocol import CacheLayout, Executor, ModelLimits, WarmupShapes, warm_up
from bm.engine.requests.request import RequestLimits
from bm.engine.requests.speculative import NgramConfig
from bm.engine.step.limits import cache_pools, max_seq_len, window_layout
from bm.kv import KVCacheManager
from bm.scheduling.factory import build_scheduler
from bm.scheduling.scheduler import RequestScheduler


@dataclass
class CoreSetup:
    """A core's parts, ready to run."""

    config: BmConfig  # resolved for the executor's device: what the core runs and results record
    max_seq_len: int
    max_num_active_requests: int
    kv_cache_manager: KVCacheManager
    attention_window: int | None  # the main table releases blocks behind it (None: it keeps them)
    scheduler: RequestScheduler
    limits: RequestLimits
    peft_cache: PeftCache
    ngram: NgramConfig | None  # prompt-lookup drafts, when engine.speculative asks for them
    warmup: dict[str, Any] | None  # the executor's warm-up report (None: it ran none)


def request_limits(config: BmConfig, model: ModelLimits) -> RequestLimits:
    """What a request is validated against under ``config`` (resolved for the device): the engine's
    cores and ``bm.LLM`` (which checks a batch before it starts any of it) take it from here."""
    engine = config.engine
    return RequestLimits(
        vocab_size=model.vocab_size,
        max_seq_len=max_seq_len(config, model),
        # with chunking a prompt of any length fits the budget piece by piece
        max_num_tokens=None if engine.enable_chunked_context else engine.max_num_tokens,
        max_beam_width=engine.max_beam_width,
        hidden_size=model.hidden_size,
    )


def set_up_core(config: BmConfig, executor: Executor) -> CoreSetup:
    """Build the cache, bind and warm up ``executor``, and build the scheduler, for ``config``."""
    model = executor.limits
    # the budgets left unset take the defaults of the device the forwards run on (the simulator's: its
    # hardware row's), so the real engine and a what-if of it resolve the same config
    config = resolve_engine(config, getattr(model, "device_type", "cpu"))
    engine, kv_cfg = config.engine, config.kv_cache
    longest = max_seq_len(config, model)
    max_active = engine.max_num_active_requests or engine.max_batch_size
    num_blocks = executor.num_kv_blocks(kv_cfg, max_active * longest)
    layout = window_layout(config, model, longest)
    # the main table releases behind the window every layer stays within; narrower windows may get
    # pools of their own, which the main pool's share of the memory then grows by
    pools = cache_pools(config, layout, num_blocks, max_active, longest)
    num_blocks = pools.num_blocks
    kv = KVCacheManager(
        num_blocks,
        kv_cfg.tokens_per_block,
        # V1 is the static baseline: a static-batching engine keeps no prefix cache.
        enable_block_reuse=kv_cfg.enable_block_reuse and engine.batching_scheme != BatchingScheme.V1,
        max_attention_window=pools.attention_window,
        sink_token_length=pools.sink_token_length,
        num_layers=pools.num_layers,
        window_groups=pools.window_groups,
        window_sink_token_length=pools.window_sink_token_length,
    )
    cached = min(longest, num_blocks * kv_cfg.tokens_per_block)
    executor.bind(
        CacheLayout(
            num_blocks,
            kv_cfg.tokens_per_block,
            cached,
            pools.attention_window,
            pools.sink_token_length,
            layout if layout.is_mixed else None,
            {g.window: g.num_blocks for g in pools.window_groups},
            kv_cfg.dtype,
        )
    )
    touch = num_blocks if kv_cfg.max_tokens is not None else 0
    report = warm_up(executor, WarmupShapes(engine.max_batch_size, engine.max_num_tokens, cached, touch))
    limits = request_limits(config, model)
    peft = config.peft_cache
    spec = engine.speculative
    return CoreSetup(
        config=config,
        max_seq_len=longest,
        max_num_active_requests=max_active,
        kv_cache_manager=kv,
        attention_window=pools.attention_window,
        scheduler=build_scheduler(engine, kv),
        limits=limits,
        peft_cache=PeftCache(peft.max_adapters, peft.max_bytes, model.weight_bytes, executor.load_adapter),
        ngram=NgramConfig(spec["num_draft_tokens"], spec["max_ngram"]) if spec else None,
        warmup=report,
    )
