"""An OpenAI batch file mixing base-model lines and adapter lines, as a vLLM user runs one
(``--lora-modules NAME=DIR``): adapter lines answer as PEFT's own ``generate()`` on that adapter, base
lines as HF ``generate()`` on the base model, a line naming a model the run does not serve gets a 404,
and every output line parses with the ``openai`` package's types."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from bm.cli.main import app
from bm.runtime import ByteTokenizer
from tests.conftest import hf_greedy

peft = pytest.importorskip("peft")
openai_types = pytest.importorskip("openai.types")
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.shared import ErrorObject  # noqa: E402

runner = CliRunner()
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
MAX_TOKENS = 8
PROMPTS = ["Once upon a time", "The capital of France is", "def main():"]


@pytest.fixture(scope="module")
def adapter(tiny_reference, tmp_path_factory):
    """A PEFT LoRA adapter of the embedded tiny model with random non-zero weights, saved: (dir, model)."""
    torch.manual_seed(7)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(tiny_reference), config)
    path = tmp_path_factory.mktemp("sql-lora")
    model.save_pretrained(path)
    model.eval()
    return path, model


def line(custom_id: str, model: str | None, url: str = COMPLETIONS, **body) -> dict:
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}
    if model is not None:
        body["model"] = model
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_adapter_lines_match_peft_base_lines_match_hf_and_an_unserved_model_is_a_404(
    tmp_path, adapter, tiny_reference
):
    adapter_dir, peft_model = adapter
    lines = []
    for i, prompt in enumerate(PROMPTS):
        lines.append(line(f"base-{i}", "tiny" if i % 2 else None, prompt=prompt))
        lines.append(line(f"lora-{i}", "sql-lora", prompt=prompt))
    chat = [{"role": "user", "content": "Hello"}]
    lines += [
        line("chat-base", "tiny", CHAT, messages=chat),
        line("chat-lora", "sql-lora", CHAT, messages=chat),
    ]
    lines.append(line("unknown", "gpt-4o", prompt=PROMPTS[0]))
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "out"
    args = [
        "run",
        str(batch),
        "-o",
        str(out),
        "-q",
        "--set",
        "model.device=cpu",
        "--chat-template",
        str(template),
    ]
    args += ["--served-model-name", "tiny", "--lora-modules", f"sql-lora={adapter_dir}"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output

    written = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    assert len(written) == len(lines)
    got = {x["custom_id"]: x for x in written}
    records = {r["id"]: r for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    tokenizer = ByteTokenizer()
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        expected = {
            f"base-{i}": hf_greedy(tiny_reference, ids, MAX_TOKENS),
            f"lora-{i}": hf_greedy(peft_model, ids, MAX_TOKENS),
        }
        assert expected[f"base-{i}"] != expected[f"lora-{i}"]  # the adapter changes the answer
        for custom_id, tokens in expected.items():
            assert records[custom_id]["output_ids"] == tokens, custom_id
            body = openai_types.Completion.model_validate(got[custom_id]["response"]["body"])
            assert body.choices[0].text == tokenizer.decode(tokens)
            assert body.choices[0].finish_reason == "length"
            assert body.model == ("sql-lora" if custom_id.startswith("lora") else "tiny")
    for custom_id, name in (("chat-base", "tiny"), ("chat-lora", "sql-lora")):
        assert ChatCompletion.model_validate(got[custom_id]["response"]["body"]).model == name
    assert records["chat-base"]["output_ids"] != records["chat-lora"]["output_ids"]
    refused = got["unknown"]["response"]
    assert refused["status_code"] == 404
    error = ErrorObject.model_validate(refused["body"]["error"])
    assert error.code == "model_not_found" and "'sql-lora'" in error.message and "'tiny'" in error.message
    counts = openai_types.BatchRequestCounts(
        total=len(written),
        completed=sum(x["response"]["status_code"] == 200 for x in written),
        failed=sum(x["response"]["status_code"] != 200 for x in written),
    )
    assert (counts.completed, counts.failed) == (len(lines) - 1, 1)
