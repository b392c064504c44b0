"""The ``bench`` section (``bm bench``): every flag of the command has its key here, so a YAML file can
hold a whole benchmark. Kept in one module: its checks, its allowed values and its cross-field rules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bm.config.fields import ConfigError, boolean, choice, int_at_least, knob, number_in, optional_str

DATASET_KINDS = {
    k: k for k in ("auto", "bm", "openai-batch", "trtllm", "sharegpt", "azure", "mooncake", "hf", "synthetic")
} | {
    "jsonl": "bm",
    "trtllm-bench": "trtllm",
    "huggingface": "hf",
    "random": "synthetic",
    "custom": "bm",  # vllm bench's JSONL of {"prompt": ...} lines
    "openai": "openai-batch",
}


# The latencies a run reports (bm.bench.metrics.LATENCIES), by the stems of their results.json keys.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "queue_time")
STANDARD_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


def _items(key: str, value: Any, example: str) -> list[Any]:
    """A list given as a YAML list or as vLLM's comma-separated text (``ttft,tpot``)."""
    if isinstance(value, str):
        items: list[Any] = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"{key}: expected a comma-separated list, e.g. {example}, got {value!r}")
    if not items:
        raise ConfigError(f"{key}: give at least one, e.g. {example}")
    return items


def _metric_names(key: str, value: Any) -> tuple[str, ...]:
    """Latency names (vLLM's ``--percentile-metrics``): which rows the latency table shows."""
    names = [str(v).strip().lower() for v in _items(key, value, "ttft,tpot,itl")]
    bad = next((n for n in names if n not in LATENCY_METRICS), None)
    if bad is not None:
        raise ConfigError(f"{key}: unknown metric {bad!r}; bm reports {', '.join(LATENCY_METRICS)}")
    return tuple(dict.fromkeys(names))


def _percentiles(key: str, value: Any) -> tuple[float, ...]:
    """Percentiles in (0, 100] (vLLM's ``--metric-percentiles 25,50,99``)."""
    out = []
    for item in _items(key, value, "25,50,99"):
        try:
            number = float(item) if not isinstance(item, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not 0 < number <= 100:
            raise ConfigError(f"{key}: {item!r} is not a percentile in (0, 100]")
        out.append(number)
    return tuple(sorted(set(out)))


def _rate(key: str, value: Any) -> Any:
    """Requests per second; null or .inf means every request at t=0 (offline), as in ``vllm bench``."""
    if value is None or (isinstance(value, float) and value == float("inf")):
        return None
    return number_in(0, None)(key, value)


@dataclass
class BenchConfig:
    dataset: str | None = knob(
        None, "Dataset file or directory (not used by the synthetic kind).", optional_str
    )
    dataset_kind: str = knob(
        "auto",
        "auto (from the file's name and first record), bm, trtllm, sharegpt, azure, mooncake, hf, synthetic.",
        choice(DATASET_KINDS),
    )
    prompt_column: str = knob(
        "prompt", "hf: the column holding the prompt (text or token ids).", optional_str
    )
    output_column: str | None = knob(
        None,
        "hf: a column giving the output length (an integer) or a completion text whose token count is it.",
        optional_str,
    )
    split: str = knob("train", "hf: the split to read.", optional_str)
    input_len: int = knob(1024, "synthetic: mean prompt length (tokens), prefix excluded.", int_at_least(1))
    output_len: int = knob(
        128,
        "synthetic: mean output length; also the output length of rows that give none (bm, hf).",
        int_at_least(1),
    )
    range_ratio: float = knob(
        0.0,
        "synthetic: lengths are uniform in [len*(1-r), len*(1+r)]; 0 gives fixed lengths.",
        number_in(0, 1, low_open=False),
    )
    prefix_len: int = knob(
        0, "synthetic: tokens of a shared prefix put in front of every prompt.", int_at_least(0)
    )
    num_prefix_groups: int = knob(
        1,
        "synthetic: how many distinct shared prefixes; request i gets prefix i mod groups.",
        int_at_least(1),
    )
    hash_block_size: int = knob(
        512, "mooncake: tokens covered by one hash id (before --input-scale).", int_at_least(1)
    )
    input_scale: float = knob(1.0, "Multiply every prompt length by this.", number_in(0, None))
    output_scale: float = knob(1.0, "Multiply every output length by this.", number_in(0, None))
    max_input_len: int | None = knob(
        None, "Cap prompt lengths (after scaling).", int_at_least(1, optional=True)
    )
    max_output_len: int | None = knob(
        None, "Cap output lengths (after scaling).", int_at_least(1, optional=True)
    )
    num_requests: int | None = knob(
        None,
        "Use the first N requests (after shuffling); default all rows, 1000 for synthetic.",
        int_at_least(1, optional=True),
    )
    shuffle: bool = knob(False, "Shuffle the rows with the seed before taking num_requests.", boolean)
    seed: int = knob(0, "Seed of shuffling, synthetic token ids and arrival gaps.", int_at_least(0))
    request_rate: float | None = knob(
        None, "Poisson (or gamma) arrivals at this many requests/s; null: all at t=0 (offline).", _rate
    )
    burstiness: float = knob(
        1.0,
        "Gamma shape of the gaps at request_rate: 1 is Poisson, < 1 burstier, > 1 more regular.",
        number_in(0, None),
    )
    trace_timestamps: bool = knob(False, "Replay the dataset's own timestamps.", boolean)
    time_scale: float = knob(
        1.0, "Multiply trace gaps by this (0.5 replays twice as fast).", number_in(0, None)
    )
    max_concurrency: int | None = knob(
        None,
        "Most requests in flight at once, client side; later arrivals wait.",
        int_at_least(1, optional=True),
    )
    warmup: int = knob(0, "Requests run first (all at once) and left out of the results.", int_at_least(0))
    slo_ttft_ms: float | None = knob(
        None, "Goodput SLO on time to first token (ms).", number_in(0, None, optional=True)
    )
    slo_tpot_ms: float | None = knob(
        None, "Goodput SLO on time per output token (ms).", number_in(0, None, optional=True)
    )
    slo_e2el_ms: float | None = knob(
        None, "Goodput SLO on end-to-end latency (ms).", number_in(0, None, optional=True)
    )
    percentile_metrics: tuple[str, ...] = knob(
        LATENCY_METRICS,
        "The latencies the terminal's table shows (vLLM's --percentile-metrics); results.json has all.",
        _metric_names,
    )
    metric_percentiles: tuple[float, ...] = knob(
        STANDARD_PERCENTILES,
        "Percentiles reported (vLLM's --metric-percentiles); results.json always has p50, p90, p95, p99.",
        _percentiles,
    )
    ignore_eos: bool = knob(
        True,
        "Run every request to its dataset's output length, past the model's end token, as vllm bench "
        "throughput and trtllm-bench do; false (--respect-eos) stops a request at the end token.",
        boolean,
    )
    chat_template: str | None = knob(
        None,
        "A Jinja chat template file for chat rows ('messages'); default the checkpoint's own, as bm run.",
        optional_str,
    )
    out_dir: str | None = knob(None, "Results directory (default bm-out/bench-TIME).", optional_str)
    json_output: bool = knob(False, "Print only the results JSON on the terminal.", boolean)


def validate_bench(bench: BenchConfig) -> None:
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
