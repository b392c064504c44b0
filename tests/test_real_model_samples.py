"""On SmolLM2-135M-Instruct (when installed): the issue's own reproduction, three identical unseeded
lines at temperature 1 that all returned the same text, now differ; ``n: 3`` gives three different
choices; top log probs equal HF's log-softmax. Skipped when the model file is not installed."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import ModelConfig
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.runtime.executor import TorchExecutor
from bm.runtime.presets import is_available
from tests.conftest import make_config, reference_model
from tests.test_engine_core import run_all

pytestmark = pytest.mark.skipif(not is_available("smollm2-135m"), reason="smollm2-135m not installed")


@pytest.fixture(scope="module")
def smollm():
    from bm.runtime import load_model

    return load_model(ModelConfig(preset="smollm2-135m", device="cpu"))


def test_identical_unseeded_lines_and_n_choices_differ_on_a_real_model(tmp_path):
    from openai.types.chat import ChatCompletion

    body = {
        "messages": [{"role": "user", "content": "Tell me a joke."}],
        "max_tokens": 16,
        "temperature": 1.0,
    }
    lines = [
        {"custom_id": f"dup-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(3)
    ]
    lines.append(
        {"custom_id": "n", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "n": 3}}
    )
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    args = ["run", str(batch), "--model", "smollm2-135m", "-o", str(out), "-q", "--set", "model.device=cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    outputs = {
        x["custom_id"]: x for x in map(json.loads, (out / "batch_output.jsonl").read_text().splitlines())
    }
    parsed = {k: ChatCompletion.model_validate(v["response"]["body"]) for k, v in outputs.items()}
    assert len({parsed[f"dup-{i}"].choices[0].message.content for i in range(3)}) == 3
    assert len({c.message.content for c in parsed["n"].choices}) == 3
    assert parsed["n"].model == "smollm2-135m"  # as named, not the cache path


def test_top_log_probs_on_a_real_model_match_hf_log_softmax(smollm):
    prompt = smollm.tokenizer.encode("The capital of France is")
    steps = 8
    core = EngineCore(make_config(), TorchExecutor(smollm), check_integrity=True)
    response = run_all(core, [Request(1, prompt, steps, top_logprobs=20, num_return_sequences=2)])["finals"][
        1
    ]
    ref = reference_model(smollm)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, len(prompt) :].tolist()
    for sample in response.samples:
        assert sample.output_ids == expected
        for position, top in enumerate(sample.output_top_log_probs):
            values = [v for _, v in top]
            assert len(top) == 20 and values == sorted(values, reverse=True)
            assert top[0][1] == sample.output_log_probs[position]
            reference = torch.log_softmax(out.scores[position][0].float(), -1)
            assert max(abs(v - reference[t].item()) for t, v in top) < 1e-4
