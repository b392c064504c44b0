"""Prompt tuning: prompt ids past the vocabulary embed as rows of the request's own table.

The oracle is HF ``generate(inputs_embeds=...)`` on the request alone, with the table rows put where the
virtual ids are; bm runs the same requests batched beside plain ones, in one packed forward.
"""

from __future__ import annotations

import json

import pytest
import torch

from bm.batch_manager import InferenceRequest, generate
from bm.runfiles.prompts import read_prompt_lines
from tests.conftest import make_config

REUSE = {"max_tokens": 4096, "tokens_per_block": 8, "enable_block_reuse": True}


def make_table(seed: int, rows: int, hidden: int) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5


def hf_prompt_tuned(
    ref, prompt: list[int], table: torch.Tensor | None, vocab: int, max_new: int
) -> list[int]:
    """HF generate() fed embeddings: each id >= vocab replaced by its table row."""
    ids = torch.tensor(prompt)
    with torch.no_grad():
        embeds = ref.get_input_embeddings()(ids.masked_fill(ids >= vocab, 0))
        if table is not None:
            virtual = (ids >= vocab).nonzero()[:, 0]
            embeds[virtual] = table[ids[virtual] - vocab].to(embeds.dtype)
        out = ref.generate(
            inputs_embeds=embeds[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0].tolist()


def tuned_prompts(vocab: int, num_virtual: int, count: int, seed: int) -> list[list[int]]:
    """Virtual tokens first (as p-tuning places them), sometimes also mid-prompt; then ordinary ids."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        n = int(torch.randint(4, 30, (1,), generator=g))
        text = torch.randint(3, vocab, (n,), generator=g).tolist()
        virtual = [vocab + j for j in range(num_virtual)]
        prompts.append(virtual + text if i % 2 == 0 else text[:3] + virtual[::-1] + text[3:])
    return prompts


def test_virtual_ids_embed_as_table_rows_like_hf_inputs_embeds_batched_beside_plain_requests(
    tiny_model, tiny_reference
):
    vocab = tiny_model.vocab_size
    hidden = tiny_model.model.get_input_embeddings().embedding_dim
    tables = [make_table(s, 5, hidden) for s in range(3)]
    prompts = tuned_prompts(vocab, 5, 6, seed=3)
    requests, expected = [], {}
    for i, prompt in enumerate(prompts):
        table = tables[i % 3]
        requests.append(
            InferenceRequest.from_values(
                i, prompt, 12, prompt_embedding_table=table[None], prompt_vocab_size=5
            )
        )
        expected[i] = hf_prompt_tuned(tiny_reference, prompt, table, vocab, 12)
    plain = [p[5:] for p in prompts[::2]]  # ordinary prompts sharing the same forwards
    for j, prompt in enumerate(plain):
        requests.append(InferenceRequest.from_values(100 + j, prompt, 12))
        expected[100 + j] = hf_prompt_tuned(tiny_reference, prompt, None, vocab, 12)
    results = generate(
        requests, make_config(engine={"max_batch_size": 4, "max_num_tokens": 64}), model=tiny_model
    )
    for rid, tokens in expected.items():
        assert results[rid].ok, results[rid].error
        assert results[rid].output_ids == tokens, f"request {rid}"


def test_blocks_are_reused_only_between_requests_with_an_identical_table(tiny_model, tiny_reference):
    vocab = tiny_model.vocab_size
    hidden = tiny_model.model.get_input_embeddings().embedding_dim
    prompt = [vocab, vocab + 1, vocab + 2, *range(3, 40)]  # 40 tokens: 5 blocks of 8
    a, b = make_table(1, 3, hidden), make_table(2, 3, hidden)
    tables = [a, b, a.clone(), None]
    requests = [
        InferenceRequest.from_values(
            i,
            prompt if t is not None else prompt[3:],
            4,
            **({"prompt_embedding_table": t[None]} if t is not None else {}),
        )
        for i, t in enumerate(tables)
    ]
    config = make_config(engine={"max_batch_size": 1}, kv_cache=REUSE)  # one after the other
    results = generate(requests, config, model=tiny_model)
    assert [results[i].num_reused_blocks for i in range(4)] == [0, 0, 4, 0]
    for i, t in enumerate(tables):
        p = prompt if t is not None else prompt[3:]
        assert results[i].output_ids == hf_prompt_tuned(tiny_reference, p, t, vocab, 4), f"request {i}"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_vocab_size": 2}, "prompt_vocab_size: 2 does not match prompt_embedding_table's 3 rows"),
        ({"repetition_penalty": 1.3}, "repetition_penalty: not supported with prompt_embedding_table"),
        ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size: not supported with prompt_embedding_table"),
    ],
)
def test_inconsistent_prompt_tuning_requests_are_refused_naming_the_field(tiny_model, fields, message):
    vocab = tiny_model.vocab_size
    hidden = tiny_model.model.get_input_embeddings().embedding_dim
    table = make_table(0, 3, hidden)
    req = InferenceRequest.from_values(0, [vocab, 5, 6], 3, prompt_embedding_table=table[None], **fields)
    result = generate([req], make_config(), model=tiny_model)[0]
    assert message in result.error


def test_table_shape_and_virtual_ids_are_checked_against_the_model(tiny_model):
    vocab = tiny_model.vocab_size
    hidden = tiny_model.model.get_input_embeddings().embedding_dim
    cases = [
        (
            InferenceRequest.from_values(
                0, [vocab + 3], 3, prompt_embedding_table=make_table(0, 3, hidden)[None]
            ),
            f"input_ids: token id {vocab + 3} is outside the vocabulary [0, {vocab + 3})",
        ),
        (
            InferenceRequest.from_values(
                1, [vocab], 3, prompt_embedding_table=make_table(0, 3, hidden + 1)[None]
            ),
            f"every row needs the model's hidden size {hidden}",
        ),
        (
            InferenceRequest.from_values(2, [vocab], 3),
            f"input_ids: token id {vocab} is outside the vocabulary [0, {vocab})",
        ),
        (
            InferenceRequest.from_values(3, [5], 3, prompt_vocab_size=3),
            "prompt_vocab_size: given without prompt_embedding_table",
        ),
    ]
    results = generate([r for r, _ in cases], make_config(), model=tiny_model)
    for i, (_, message) in enumerate(cases):
        assert message in results[i].error, results[i].error


def test_jsonl_lines_carry_the_table_as_a_nested_list(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps(
            {"input_ids": [1000, 7], "prompt_embedding_table": [[0.5, 1.0], [2, 3]], "prompt_vocab_size": 2}
        )
        + "\n"
        + json.dumps({"input_ids": [7], "prompt_embedding_table": [0.5, 1.0]})
        + "\n"
    )
    (good, request), (bad, _) = read_prompt_lines(path, None, 8, None)
    assert good.error is None
    assert request.prompt_embedding_table == [[0.5, 1.0], [2, 3]]
    assert request.prompt_vocab_size == 2
    assert bad.error is not None and "line 2: prompt_embedding_table: expected a nested list" in bad.error


def test_prompt_tuning_lines_through_bm_run_equal_hf_inputs_embeds(tiny_model, tiny_reference, tmp_path):
    """`bm run` used to refuse every such line ("token id 300 is outside the vocabulary"): the CLI checked
    ids against the vocabulary before the engine, which knows ids from vocab_size on are table rows."""
    from typer.testing import CliRunner

    from bm.cli.main import app

    vocab, hidden = tiny_model.vocab_size, tiny_model.model.config.hidden_size
    prompts = tuned_prompts(vocab, num_virtual=3, count=4, seed=5)
    tables = [make_table(seed=40 + i, rows=3, hidden=hidden) for i in range(len(prompts))]
    path = tmp_path / "tuned.jsonl"
    lines = [
        {"input_ids": p, "prompt_embedding_table": t.tolist(), "max_tokens": 6}
        for p, t in zip(prompts, tables, strict=True)
    ]
    path.write_text(
        "".join(json.dumps(line) + "\n" for line in lines) + json.dumps({"input_ids": [5, 9]}) + "\n"
    )
    out = tmp_path / "out"
    args = ["run", str(path), "-o", str(out), "--quiet", "--ignore-eos", "--max-tokens", "6"]
    result = CliRunner().invoke(app, [*args, "--set", "model.device=cpu"])
    assert result.exit_code == 0, result.output
    records = {r["index"]: r for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    for i, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
        assert records[i]["error"] is None, records[i]["error"]
        assert records[i]["output_ids"] == hf_prompt_tuned(tiny_reference, prompt, table, vocab, 6)
    assert records[len(prompts)]["output_ids"] == hf_prompt_tuned(tiny_reference, [5, 9], None, vocab, 6)


def test_a_step_with_a_prompt_tuning_table_reads_no_device_value_on_the_host(tiny_model):
    """Where the virtual ids sit is known from the step's token ids on the host; reading it off the
    device (``nonzero``) would make the host wait for the step in flight on CUDA. The embeddings are the
    table's rows there and the model's own elsewhere."""
    from collections import Counter

    from bm.runtime import ModelRunner, work_item
    from tests.op_counts import HOST_READS, Operators

    vocab = tiny_model.vocab_size
    embedding = tiny_model.model.get_input_embeddings()
    table = make_table(4, 3, embedding.embedding_dim)
    runner = ModelRunner(tiny_model, num_blocks=16, tokens_per_block=8, max_seq_len=64)
    items = [
        work_item([5, vocab + 2, 7, vocab, vocab + 1, 9], 0, [0]),
        work_item([6, 8, 10], 0, [1]),
        work_item([vocab + 1, 11], 0, [2]),
    ]
    ids = torch.tensor([t for item in items for t in item.token_ids])[None]
    with torch.inference_mode():
        operators: Counter = Counter()
        with Operators(operators):
            embeds = runner._embed(items, ids, {0: table, 2: table})
        assert [name for name in operators if name in HOST_READS] == []
        want = embedding(ids.masked_fill(ids >= vocab, 0))[0]
        for row, token in enumerate(ids[0].tolist()):
            if token >= vocab:  # every virtual id is in an item with the table
                want[row] = table[token - vocab]
    assert torch.equal(embeds[0], want)
