"""The ``kv_cache`` and ``peft_cache`` sections: the paged KV cache's block size, size and reuse, attention
windows, and how many LoRA adapters stay loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bm.config.fields import ConfigError, boolean, choice, fraction, int_at_least, knob


def _attention_window(key: str, value: Any) -> Any:
    """One window for every layer, or a list of windows repeated over the layers (TensorRT-LLM's form)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{key}: an empty list; give one window (e.g. 4096) or one per layer")
        return [int_at_least(1)(f"{key}[{i}]", w) for i, w in enumerate(value)]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer >= 1 or a list of them (one per layer), got {value!r}")
    return int_at_least(1)(key, value)


@dataclass
class KvCacheConfig:
    tokens_per_block: int = knob(32, "Tokens held by one KV cache block.", int_at_least(1))
    max_tokens: int | None = knob(
        None,
        "Most tokens the KV cache holds; with free_memory_fraction the smaller of the two wins. Where "
        "layers with a narrower window get pools of their own, the memory of that many tokens in every layer.",
        int_at_least(1, optional=True),
    )
    free_memory_fraction: float = knob(
        0.9,
        "Fraction of the memory free after the model loads (system RAM on CPU, device memory on CUDA) "
        "that the KV cache may take.",
        fraction,
    )
    enable_block_reuse: bool = knob(
        False,
        "Keep full blocks of finished prefixes cached and let requests with the same prefix take them "
        "instead of recomputing it (not used by the v1 scheme).",
        boolean,
    )
    max_attention_window: int | Sequence[int] | None = knob(
        None,
        "Each token attends to at most this many latest tokens (plus the sink tokens); older blocks are "
        "released while a request runs. A list gives each layer its own window, repeated over the layers "
        "when shorter (as TensorRT-LLM's). Default: no window beyond the model's own sliding windows.",
        _attention_window,
    )
    sink_token_length: int = knob(
        0,
        "With max_attention_window: the first tokens of a sequence, always attended (StreamingLLM sinks).",
        int_at_least(0),
    )
    dtype: str = knob(
        "auto",
        "auto, int8, or fp8_e4m3 (vLLM's fp8); see kv-cache.md.",
        choice({"auto": "auto", "int8": "int8", "fp8_e4m3": "fp8_e4m3", "fp8": "fp8_e4m3"}),
    )


@dataclass
class PeftCacheConfig:
    max_adapters: int = knob(
        8,
        "Most LoRA adapters kept loaded at once; when full, the least recently used adapter no active "
        "request holds is evicted, and a request whose adapter cannot be loaded waits.",
        int_at_least(1),
    )
    max_bytes: int | None = knob(
        None,
        "Most bytes of LoRA weights kept loaded (in the model's dtype); default: no byte limit.",
        int_at_least(1, optional=True),
    )
