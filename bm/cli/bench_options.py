"""The options ``bm bench``, ``bm compare`` and ``bm sweep`` share, declared once so the three cannot drift
apart (a benchmark written for one runs unchanged under the others), and how they become a config.

Every flag sets one key of the config's ``bench`` section (or ``engine.batching_scheme`` /
``engine.scheduler_policy`` for ``--scheme`` / ``--policy``), so a YAML file can hold a whole benchmark
and the flags override it; the config's own checks judge every value, flags and file alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from bm.config import BmConfig, ConfigError, load_config, model_override, parse_override

DATA, ARRIVE, RUN, MODEL = "Dataset", "Arrivals", "Run and output", "Model and engine"
SIM = "Simulator"

# flag parameter -> config key; a flag left unset (None) keeps the config file's value.
FLAG_KEYS = {
    "dataset": "bench.dataset",
    "scheme": "engine.batching_scheme",
    "policy": "engine.scheduler_policy",
    "model": "model.path",
    "model_config": "model.config",
    **{
        name: f"bench.{name}"
        for name in (
            "dataset_kind",
            "prompt_column",
            "output_column",
            "split",
            "input_len",
            "output_len",
            "range_ratio",
            "prefix_len",
            "num_prefix_groups",
            "hash_block_size",
            "input_scale",
            "output_scale",
            "max_input_len",
            "max_output_len",
            "num_requests",
            "shuffle",
            "seed",
            "burstiness",
            "trace_timestamps",
            "time_scale",
            "warmup",
            "ignore_eos",
            "chat_template",
            "percentile_metrics",
            "metric_percentiles",
            "out_dir",
        )
    },
    "rate": "bench.request_rate",
    "concurrency": "bench.max_concurrency",
    "json_output": "bench.json_output",
    "executor": "engine.executor",
    "hardware": "sim.hardware",
    "tensor_parallel": "sim.tensor_parallel",
}
SLO_KEYS = {"ttft": "bench.slo_ttft_ms", "tpot": "bench.slo_tpot_ms", "e2el": "bench.slo_e2el_ms"}


def parse_slo(texts: list[str]) -> dict[str, float]:
    """``ttft=500,tpot=50`` (or vLLM's ``ttft:500 tpot:50``) -> config overrides, in ms."""
    out: dict[str, float] = {}
    for text in texts:
        for part in text.replace(" ", ",").split(","):
            if not part:
                continue
            name, sep, value = part.replace(":", "=").partition("=")
            key = SLO_KEYS.get(name.strip().lower())
            if key is None or not sep:
                raise ConfigError(
                    f"--slo {part!r}: expected METRIC=MS with METRIC one of ttft, tpot, e2el (e.g. ttft=500)"
                )
            try:
                out[key] = float(value)
            except ValueError:
                raise ConfigError(f"--slo {part!r}: {value!r} is not a number of milliseconds") from None
    return out


def resolve_config(config: Path | None, sets: list[str], flags: dict[str, Any], slo: list[str]) -> BmConfig:
    path = flags.get("dataset_path")  # vLLM's --dataset-path, trtllm-bench's --dataset: DATASET by name
    if path is not None:
        if flags.get("dataset") is not None and Path(flags["dataset"]) != Path(path):
            raise ConfigError(
                f"two datasets: DATASET {str(flags['dataset'])!r} and --dataset-path {str(path)!r}; give one"
            )
        flags = {**flags, "dataset": path}
    overrides: dict[str, Any] = dict(parse_override(o) for o in sets)
    for name, key in FLAG_KEYS.items():
        value = flags.get(name)
        if value is not None:
            if name == "model":  # --model NAME picks a preset, as in bm run
                key, value = model_override(value)
            overrides[key] = str(value) if isinstance(value, Path) else value
    overrides.update(parse_slo(slo))
    # The simulator gets no defaults of its own: it resolves the engine's per-device defaults from its
    # hardware row exactly as the real engine does from the model's device (bm.config.resolve_engine),
    # so a what-if predicts the run the same flags would make.
    return load_config(config, overrides)


# Options bm bench and bm compare share, declared once so the two commands cannot drift apart: a
# benchmark written for one runs unchanged under the other. name -> (type, typer option).
SHARED_OPTIONS: dict[str, tuple[Any, Any]] = {
    "set_": (list[str], typer.Option([], "--set", "-s", help="Override a config key, e.g. bench.warmup=8.", rich_help_panel=MODEL)),
    "model": (str | None, typer.Option(None, "--model", help="A preset (smollm2-135m, tiny-random) or a local checkpoint directory.", rich_help_panel=MODEL)),
    "model_config": (str | None, typer.Option(None, "--model-config", help="Model config JSON (random weights).", rich_help_panel=MODEL)),
    "dataset_kind": (str | None, typer.Option(None, "--dataset-kind", "--dataset-name", help="auto, bm, trtllm, sharegpt, azure, mooncake, hf, synthetic.", rich_help_panel=DATA)),
    "prompt_column": (str | None, typer.Option(None, "--prompt-column", help="hf: prompt column.", rich_help_panel=DATA)),
    "output_column": (str | None, typer.Option(None, "--output-column", help="hf: output length (or text) column.", rich_help_panel=DATA)),
    "split": (str | None, typer.Option(None, "--split", help="hf: split (default train).", rich_help_panel=DATA)),
    "input_len": (int | None, typer.Option(None, "--input-len", help="synthetic: mean prompt length [1024].", rich_help_panel=DATA)),
    "output_len": (int | None, typer.Option(None, "--output-len", help="synthetic: mean output length; also for rows that give none (default 128).", rich_help_panel=DATA)),
    "range_ratio": (float | None, typer.Option(None, "--range-ratio", help="synthetic: lengths uniform in len*(1±r) (default 0).", rich_help_panel=DATA)),
    "prefix_len": (int | None, typer.Option(None, "--prefix-len", help="synthetic: shared prefix tokens [0].", rich_help_panel=DATA)),
    "num_prefix_groups": (int | None, typer.Option(None, "--num-prefix-groups", help="synthetic: distinct prefixes [1].", rich_help_panel=DATA)),
    "hash_block_size": (int | None, typer.Option(None, "--hash-block-size", help="mooncake: tokens per hash id [512].", rich_help_panel=DATA)),
    "input_scale": (float | None, typer.Option(None, "--input-scale", help="Multiply prompt lengths (default 1).", rich_help_panel=DATA)),
    "output_scale": (float | None, typer.Option(None, "--output-scale", help="Multiply output lengths (default 1).", rich_help_panel=DATA)),
    "max_input_len": (int | None, typer.Option(None, "--max-input-len", help="Cap prompt lengths.", rich_help_panel=DATA)),
    "max_output_len": (int | None, typer.Option(None, "--max-output-len", help="Cap output lengths.", rich_help_panel=DATA)),
    "num_requests": (int | None, typer.Option(None, "--num-requests", "--num-prompts", "-n", help="First N requests (default all; 1000 synthetic).", rich_help_panel=DATA)),
    "shuffle": (bool | None, typer.Option(None, "--shuffle/--no-shuffle", help="Shuffle rows with the seed.", rich_help_panel=DATA)),
    "seed": (int | None, typer.Option(None, "--seed", help="Seed of shuffling, token ids, arrivals (default 0).", rich_help_panel=DATA)),
    "rate": (float | None, typer.Option(None, "--rate", "--request-rate", help="Poisson arrivals, requests/s (default offline: all at t=0).", rich_help_panel=ARRIVE)),
    "burstiness": (float | None, typer.Option(None, "--burstiness", help="Gamma shape of the gaps at --rate (default 1: Poisson).", rich_help_panel=ARRIVE)),
    "trace_timestamps": (bool | None, typer.Option(None, "--trace-timestamps/--no-trace-timestamps", help="Replay the dataset's timestamps.", rich_help_panel=ARRIVE)),
    "time_scale": (float | None, typer.Option(None, "--time-scale", help="Multiply trace gaps (0.5: twice as fast) (default 1).", rich_help_panel=ARRIVE)),
    "concurrency": (int | None, typer.Option(None, "--concurrency", "--max-concurrency", help="Most requests in flight.", rich_help_panel=ARRIVE)),
    "warmup": (int | None, typer.Option(None, "--warmup", help="Requests run first, unmeasured.", rich_help_panel=RUN)),
    "slo": (list[str], typer.Option([], "--slo", help="Goodput SLOs in ms: ttft=500,tpot=50,e2el=2000.", rich_help_panel=RUN)),
    "ignore_eos": (bool | None, typer.Option(None, "--ignore-eos/--respect-eos", " /--no-ignore-eos", help="Run each request to its full length (default); --respect-eos stops at EOS.", rich_help_panel=RUN)),
    "chat_template": (Path | None, typer.Option(None, "--chat-template", help="Jinja template for 'messages' rows.", rich_help_panel=DATA)),
    "percentile_metrics": (str | None, typer.Option(None, "--percentile-metrics", help="Latency rows shown, e.g. ttft,tpot,itl.", rich_help_panel=RUN)),
    "metric_percentiles": (str | None, typer.Option(None, "--metric-percentiles", help="Percentiles shown, e.g. 25,50,99.", rich_help_panel=RUN)),
    "dataset_path": (Path | None, typer.Option(None, "--dataset-path", "--dataset", hidden=True, help="DATASET, named as vllm bench and trtllm-bench name it.")),
    "executor": (str | None, typer.Option(None, "--executor", help="torch (default) or sim: simulated time from a cost model.", rich_help_panel=SIM)),
    "hardware": (str | None, typer.Option(None, "--hardware", help="sim: hardware row: a datasheet's (h100-sxm, h200, b200, a100-80gb, l40s, mi300x) or one measured here with bm's own forward (cpu-local, cuda-local; bm sim calibrate).", rich_help_panel=SIM)),
    "tensor_parallel": (int | None, typer.Option(None, "--tensor-parallel", "--tp", help="Devices the model is split over (default 1): simulated under engine.executor=sim; in bm bench on torch, real ranks (tp_plan='auto', needs --model).", rich_help_panel=SIM)),
}  # fmt: skip


def with_shared_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` (which takes ``**shared``) every option of :data:`SHARED_OPTIONS` as its own.

    typer reads a command's parameters from its signature, so the signature is extended instead of
    repeating the declarations; typer copies each option object, so sharing them is safe."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
        for name, (kind, option) in SHARED_OPTIONS.items()
    ]
    command.__signature__ = signature.replace(parameters=[*own, *extra])  # type: ignore[attr-defined]
    return command
