"""The oracle every quantized-weight format is held to (int8 on load, GGUF blocks, GPTQ, AWQ, FP8): bm's
greedy output equals HF generate() on the model with each weight expanded as the format defines it, for
16 staggered requests under two engines: plain batches, and chunked prompts in a cache so small that
max_utilization pauses and resumes requests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bm.runtime import LoadedModel, load_model
from bm.runtime.model_loader import ModelConfig
from bm.scheduling import FinishReason
from tests.conftest import hf_greedy, make_config, random_prompts, reference_model
from tests.test_oracle import run_staggered

ORACLE_ENGINES = pytest.mark.parametrize(
    "engine",
    [
        {"max_batch_size": 8, "max_num_tokens": 96},
        # chunked prompts, and a cache so small that max_utilization pauses and resumes requests
        {"max_batch_size": 16, "max_num_tokens": 32, "scheduler_policy": "max_utilization"},
    ],
)


def stored_checkpoint(tiny_model: LoadedModel, folder: Path, write: Callable, layout: str) -> tuple:
    """The tiny model written by ``write(reference, folder, layout)`` as a checkpoint stored quantized,
    and what loads from it: ``(layout, folder, expanded, loaded)``, ``expanded`` being the model the
    checkpoint stands for (``write``'s return) and ``loaded`` bm's model of the directory."""
    expanded = write(reference_model(tiny_model), folder, layout)
    return layout, folder, expanded, load_model(ModelConfig(path=str(folder), device="cpu"))


def assert_greedy_equals_hf(loaded: LoadedModel, reference: torch.nn.Module, engine: dict) -> list:
    """Run the oracle's requests through bm under ``engine`` and compare each with HF generate() on
    ``reference`` alone; returns the requests (prompt, output length)."""
    specs = random_prompts(seed=3, count=16, vocab=loaded.vocab_size, max_prompt=40, max_output=16)
    kv = {"tokens_per_block": 4, "max_tokens": 160 if engine["max_num_tokens"] == 32 else 4096}
    client = run_staggered(loaded, make_config(engine=engine, kv_cache=kv), specs)
    assert_each_equals_hf(client, specs, reference)
    return specs


def assert_each_equals_hf(client, specs: list, reference: torch.nn.Module) -> None:
    """Each of ``client``'s requests (``specs``: prompt, output length, in request-id order) finished at
    its length with HF generate()'s greedy tokens on ``reference`` alone."""
    for i, (prompt, max_new) in enumerate(specs):
        result = client.results[i]
        assert result.ok, result.error
        assert result.finish_reason == FinishReason.LENGTH
        assert result.output_ids == hf_greedy(reference, prompt, max_new), f"request {i}"
