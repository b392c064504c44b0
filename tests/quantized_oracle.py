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


def expanded_reference(model: LoadedModel, expand: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """HF's copy of ``model`` with every weight bm quantizes on load replaced by ``expand(weight)``: the
    float32 weight a scheme's codes and scales stand for, the reference its oracle compares with."""
    from bm.runtime.weight_quant import quantized_linears

    ref = reference_model(model)
    with torch.no_grad():
        for _, linear in quantized_linears(ref):
            linear.weight.copy_(expand(linear.weight))
    return ref


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


def assert_lora_matches_peft(
    loaded: LoadedModel, reference: torch.nn.Module, full_width: torch.nn.Module, tmp_path: Path
) -> None:
    """bm's LoRA wraps whatever forward a layer has, a quantized one included: adapter requests equal a
    PeftModel holding the adapter (trained shape on ``full_width``) over ``reference`` (the expanded
    weights), base requests ``reference`` alone, mixed in one engine."""
    import copy

    peft = pytest.importorskip("peft")
    from bm.batch_manager import BatchManager, InferenceRequest
    from tests.clients import StaggeredClient
    from tests.test_lora import lora_fields

    torch.manual_seed(100)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    peft.get_peft_model(copy.deepcopy(full_width), config).save_pretrained(tmp_path)
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(reference), tmp_path).eval()
    specs = random_prompts(seed=21, count=8, vocab=loaded.vocab_size, max_prompt=30, max_output=12)
    requests, expected = [], {}
    for i, (prompt, max_new) in enumerate(specs):
        if i % 2:
            requests.append(InferenceRequest.from_values(i, prompt, max_new))
            expected[i] = hf_greedy(reference, prompt, max_new)
        else:
            requests.append(InferenceRequest.from_values(i, prompt, max_new, **lora_fields(tmp_path)))
            expected[i] = hf_greedy(adapted, prompt, max_new)
    assert any(expected[i] != hf_greedy(reference, *specs[i]) for i in range(0, 8, 2))
    client = StaggeredClient(requests, per_iteration=3)
    config = make_config(engine={"max_batch_size": 8, "max_num_tokens": 128})
    with BatchManager(config, client.get_requests, client.send_response, model=loaded):
        assert client.wait(120)
    for i, tokens in expected.items():
        assert client.results[i].ok, client.results[i].error
        assert client.results[i].output_ids == tokens, f"request {i}"
