"""Build the request scheduler a config asks for: built-in policies by name, or user classes by path.

Custom classes are named ``package.module:ClassName`` in the config:

- ``engine.capacity_scheduler``: a :class:`CapacityScheduler` subclass, constructed like the scheduler
  page's example, ``Class(max_num_requests, kv_cache_manager)`` (plus ``max_num_tokens=`` and
  ``chunking=`` when its ``__init__`` accepts them);
- ``engine.micro_batch_scheduler``: a :class:`MicroBatchScheduler` subclass,
  ``Class(max_batch_size, max_num_tokens, chunking)``;
- ``engine.scheduler``: a :class:`RequestScheduler` implementing ``schedule_request`` directly,
  ``Class(engine_config, kv_cache_manager)``.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from bm.config import BatchingScheme, ConfigError, EngineConfig, SchedulerPolicy, find_class_module
from bm.kv import KVCacheManager
from bm.scheduling.budget import ChunkingConfig
from bm.scheduling.capacity import (
    CapacityScheduler,
    GuaranteedNoEvictScheduler,
    MaxUtilizationScheduler,
    StaticBatchScheduler,
)
from bm.scheduling.micro_batch import MicroBatchScheduler
from bm.scheduling.scheduler import RequestScheduler, SimpleScheduler
from bm.scheduling.v1 import V1Scheduler

POLICIES: dict[SchedulerPolicy, type[CapacityScheduler]] = {
    SchedulerPolicy.GUARANTEED_NO_EVICT: GuaranteedNoEvictScheduler,
    SchedulerPolicy.MAX_UTILIZATION: MaxUtilizationScheduler,
    SchedulerPolicy.STATIC_BATCH: StaticBatchScheduler,
}


def chunking_config(engine: EngineConfig, tokens_per_block: int) -> ChunkingConfig:
    return ChunkingConfig(
        enabled=engine.enable_chunked_context,
        policy=engine.context_chunking_policy,
        unit=tokens_per_block,
        max_chunk=engine.context_chunk_size,
    )


def load_class(key: str, path: str, base: type) -> type:
    """Import ``module:Class``; a failure names the config key and what went wrong."""
    module_name, _, class_name = path.partition(":")
    find_class_module(path, [Path.cwd()])  # a config built in code: the working directory, as for the CLI
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key}: cannot import {path!r} ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{key}: {path!r} is not a subclass of {base.__module__}.{base.__name__}")
    return cls


def _accepts(cls: type, name: str) -> bool:
    params = inspect.signature(cls.__init__).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def build_scheduler(engine: EngineConfig, kv: KVCacheManager) -> RequestScheduler:
    chunking = chunking_config(engine, kv.tokens_per_block)
    if engine.scheduler:
        return load_class("engine.scheduler", engine.scheduler, RequestScheduler)(engine, kv)
    if engine.batching_scheme == BatchingScheme.V1:
        return V1Scheduler(engine.max_batch_size, engine.max_num_tokens, kv, chunking)
    capacity_cls = POLICIES[SchedulerPolicy(engine.scheduler_policy)]
    if engine.capacity_scheduler:
        capacity_cls = load_class("engine.capacity_scheduler", engine.capacity_scheduler, CapacityScheduler)
    extra: dict[str, Any] = {}
    if _accepts(capacity_cls, "max_num_tokens"):
        extra["max_num_tokens"] = engine.max_num_tokens
    if _accepts(capacity_cls, "chunking"):
        extra["chunking"] = chunking
    capacity = capacity_cls(engine.max_batch_size, kv, **extra)
    micro_cls = MicroBatchScheduler
    if engine.micro_batch_scheduler:
        micro_cls = load_class(
            "engine.micro_batch_scheduler", engine.micro_batch_scheduler, MicroBatchScheduler
        )
    return SimpleScheduler(capacity, micro_cls(engine.max_batch_size, engine.max_num_tokens, chunking))
