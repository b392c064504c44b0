"""The ``engine`` section: batching scheme, scheduler policy and names, the per-iteration budgets, custom
scheduler classes, the executor and speculative decoding; and what ``engine.defaults`` gives the budgets
left unset on each device."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from bm.config.fields import ConfigError, choice, int_at_least, knob, on_off_auto, optional_bool


class _Named(str, Enum):
    """A config choice: compares equal to its spelling and prints as it (``v1``, not ``BatchingScheme.V1``)."""

    def __str__(self) -> str:
        return self.value


class BatchingScheme(_Named):
    V1 = "v1"
    INFLIGHT = "inflight"
    INFLIGHT_FUSED = "inflight_fused"


class SchedulerPolicy(_Named):
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    MAX_UTILIZATION = "max_utilization"
    STATIC_BATCH = "static_batch"


class ContextChunkingPolicy(_Named):
    FIRST_COME_FIRST_SERVED = "first_come_first_served"
    EQUAL_PROGRESS = "equal_progress"


BATCHING_SCHEMES = {
    **{s.value: s for s in BatchingScheme},
    "inflightbatching": BatchingScheme.INFLIGHT,
    "inflightfusedbatching": BatchingScheme.INFLIGHT_FUSED,
}
SCHEDULER_POLICIES = {p.value: p for p in SchedulerPolicy}
CHUNKING_POLICIES = {
    **{p.value: p for p in ContextChunkingPolicy},
    "fcfs": ContextChunkingPolicy.FIRST_COME_FIRST_SERVED,
}


def _class_path(key: str, value: Any) -> Any:
    if value is None:
        return None
    module, sep, name = str(value).partition(":") if isinstance(value, str) else ("", "", "")
    if not (sep and module and name.isidentifier()):
        raise ConfigError(f"{key}: expected 'package.module:ClassName', got {value!r}")
    return value


def _speculative(key: str, value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping {{method: ngram, num_draft_tokens: K, max_ngram: N}}")
    allowed = {"method", "num_draft_tokens", "max_ngram"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key; allowed keys: {', '.join(sorted(allowed))}")
    if value.get("method") != "ngram":
        raise ConfigError(f"{key}.method: unknown value {value.get('method')!r}; allowed: ngram")
    return {
        "method": "ngram",
        "num_draft_tokens": int_at_least(1)(f"{key}.num_draft_tokens", value.get("num_draft_tokens", 4)),
        "max_ngram": int_at_least(1)(f"{key}.max_ngram", value.get("max_ngram", 3)),
    }


@dataclass
class EngineConfig:
    batching_scheme: BatchingScheme = knob(  # noqa: RUF009 (a field spec, not a shared default)
        BatchingScheme.INFLIGHT_FUSED,
        "v1 (static batches padded and run in lockstep), inflight (context and generation as separate "
        "forwards), inflight_fused (one packed forward per iteration). Seed names (V1, InflightBatching, "
        "InflightFusedBatching) accepted.",
        choice(BATCHING_SCHEMES),
    )
    scheduler_policy: SchedulerPolicy = knob(  # noqa: RUF009
        SchedulerPolicy.GUARANTEED_NO_EVICT,
        "guaranteed_no_evict (reserve blocks to completion), max_utilization (pack the iteration, pause "
        "the latest started when short), static_batch (no new request until the batch drains).",
        choice(SCHEDULER_POLICIES),
    )
    defaults: str = knob(
        "bm",
        "What the budget keys left unset (max_batch_size, max_num_tokens, enable_chunked_context) resolve "
        "to, per device: bm (chunked context on; CPU 128 requests and 2048 tokens an iteration, CUDA 256 "
        "and 8192: a long prompt never waits for the batch to drain) or seed (the seed's, TensorRT-LLM "
        "Batch Manager's: chunked context off, 128 requests, 2048 tokens, on every device). A key you set "
        "wins either way.",
        choice({"bm": "bm", "seed": "seed", "trtllm": "seed"}),
    )
    max_batch_size: int | None = knob(
        None,
        "Most requests scheduled in one iteration (default per device, see engine.defaults).",
        int_at_least(1, optional=True),
    )
    max_num_tokens: int | None = knob(
        None,
        "Most tokens (context + generation) computed in one iteration (default per device, see "
        "engine.defaults).",
        int_at_least(1, optional=True),
    )
    max_num_active_requests: int | None = knob(
        None,
        "Most requests held by the batch manager at once, queued ones included (default: max_batch_size).",
        int_at_least(1, optional=True),
    )
    max_seq_len: int | None = knob(
        None,
        "Longest prompt + output a request may have (default: the model's max_position_embeddings).",
        int_at_least(1, optional=True),
    )
    max_beam_width: int = knob(1, "Largest beam_width a request may ask for.", int_at_least(1))
    enable_chunked_context: bool | None = knob(
        None,
        "Split long contexts across iterations so generation keeps flowing beside them (default: on; off "
        "under engine.defaults: seed).",
        optional_bool,
    )
    context_chunking_policy: ContextChunkingPolicy = knob(  # noqa: RUF009
        ContextChunkingPolicy.FIRST_COME_FIRST_SERVED,
        "first_come_first_served (fill the token budget in arrival order) or equal_progress (advance "
        "every context one block at a time).",
        choice(CHUNKING_POLICIES),
    )
    context_chunk_size: int | None = knob(
        None,
        "Most context tokens of one request per iteration (default: the token budget decides).",
        int_at_least(1, optional=True),
    )
    capacity_scheduler: str | None = knob(
        None,
        "Your CapacityScheduler subclass, 'package.module:ClassName' (replaces the policy).",
        _class_path,
    )
    micro_batch_scheduler: str | None = knob(
        None, "Your MicroBatchScheduler subclass, 'package.module:ClassName'.", _class_path
    )
    scheduler: str | None = knob(
        None,
        "Your RequestScheduler (schedule_request implemented directly), 'package.module:ClassName'.",
        _class_path,
    )
    executor: str = knob(
        "torch",
        "torch (run the model) or sim (bm.sim: the same scheduler, forwards priced by a roofline cost "
        "model of sim.hardware, simulated time; needs model.config).",
        choice({"torch": "torch", "sim": "sim"}),
    )
    overlap_scheduler: str = knob(
        "auto",
        "Launch iteration n+1 before reading n's tokens, same outputs (docs/scheduling.md): auto (CUDA), "
        "on, off.",
        on_off_auto,
    )
    speculative: dict | None = knob(  # noqa: RUF009
        None,
        "Draft tokens without a draft model: {method: ngram, num_draft_tokens: K, max_ngram: N} proposes "
        "the K tokens that followed the latest earlier occurrence of the sequence's last N (down to 1) "
        "tokens (prompt lookup); one forward verifies them. Default: off.",
        _speculative,
    )


# What engine.defaults gives the budget keys left unset, per device type. bm's values were chosen by
# measurement (docs/defaults.md): with chunked context a prompt at the token cap never waits for the
# generating requests to drain, and CUDA's larger budgets keep a GPU's batch full. "seed" is the seed's
# (TensorRT-LLM Batch Manager's) behaviour, the same on every device.
ENGINE_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "bm": {
        "cpu": {"enable_chunked_context": True, "max_batch_size": 128, "max_num_tokens": 2048},
        "cuda": {"enable_chunked_context": True, "max_batch_size": 256, "max_num_tokens": 8192},
    },
    "seed": {
        device: {"enable_chunked_context": False, "max_batch_size": 128, "max_num_tokens": 2048}
        for device in ("cpu", "cuda")
    },
}


def chunked_context(engine: EngineConfig) -> bool:
    """Whether chunked context is on, set or by engine.defaults (the same on every device)."""
    if engine.enable_chunked_context is not None:
        return engine.enable_chunked_context
    return ENGINE_DEFAULTS[engine.defaults]["cpu"]["enable_chunked_context"]


def engine_defaults(engine: EngineConfig, device_type: str) -> dict[str, Any]:
    """The values engine.defaults gives on ``device_type`` (cpu; cuda and every accelerator torch calls
    cuda), whether or not the keys are set."""
    return dict(ENGINE_DEFAULTS[engine.defaults]["cpu" if device_type == "cpu" else "cuda"])
