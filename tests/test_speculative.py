"""Draft tokens: one forward verifies them, the output never changes.

Greedy: identical to HF ``generate()`` (and to decoding without drafts) whatever the drafts: random ones
(mostly rejected), perfect ones (the reference continuation, all accepted) and prompt-lookup ones.
Sampled: rejection sampling keeps the model's distribution, checked by a chi-square test against the
exact distribution on a tiny vocabulary. KV integrity is checked every iteration, so rolled-back draft
blocks must be returned.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from bm.batch_manager import InferenceRequest, generate
from bm.engine.execution.fake_executor import FakeExecutor, fake_token
from bm.engine.requests.request import Request
from bm.engine.requests.speculative import ngram_drafts
from bm.engine.step.core import EngineCore
from bm.runtime import load_model
from bm.runtime.model_loader import ModelConfig
from tests.conftest import REPO, hf_greedy, make_config, random_prompts, reference_model

NGRAM = {"speculative": {"method": "ngram", "num_draft_tokens": 4, "max_ngram": 3}}


def run(model, requests, **sections):
    stats: list[str] = []
    results = generate(requests, make_config(**sections), model=model, return_stats=stats.append)
    for rid, result in results.items():
        assert result.ok, (rid, result.error)
    return results, [json.loads(s) for s in stats]


def copy_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a span, so prompt lookup finds n-grams to propose."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        span = torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        prompts.append(span * 3 + span[:2])
    return prompts


def test_greedy_output_is_identical_with_random_perfect_and_ngram_drafts(tiny_model, tiny_reference):
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=5, count=6, vocab=vocab, max_prompt=24, max_output=20)
    specs += [(p, 20) for p in copy_prompts(vocab, 4, seed=6)]
    expected = [hf_greedy(tiny_reference, p, m) for p, m in specs]
    g = torch.Generator().manual_seed(7)
    random_drafts = [torch.randint(3, vocab, (m,), generator=g).tolist() for _, m in specs]
    # a random guess of the first token, then the real continuation: drafts apply only while the
    # output follows them, so these are rejected at the prompt's step and never proposed again
    kinds = {
        "random": random_drafts,
        "perfect": expected,
        "wrong_first": [[(e[0] + 1) % vocab, *e[1:]] for e in expected],
    }
    for name, drafts in kinds.items():
        requests = [
            InferenceRequest.from_values(i, p, m, draft_input_ids=drafts[i])
            if i % 3
            else InferenceRequest.from_values(i, p, m)  # plain requests share the forwards
            for i, (p, m) in enumerate(specs)
        ]
        results, stats = run(tiny_model, requests, engine={"max_batch_size": 8, "max_num_tokens": 96})
        for i, tokens in enumerate(expected):
            assert results[i].output_ids == tokens, (name, i)
        drafted = [results[i] for i in range(len(specs)) if i % 3 and len(expected[i]) > 1]
        if name == "perfect":
            assert all(r.acceptance_rate == 1.0 for r in drafted)
            assert sum(r.num_draft_steps for r in drafted) < sum(len(r.output_ids) - 1 for r in drafted)
        if name == "wrong_first":
            assert all(r.num_accepted_draft_tokens == 0 and r.num_draft_steps <= 1 for r in drafted)
        assert sum(s["Draft Tokens"] for s in stats) == sum(r.num_draft_tokens for r in results.values())

    results, stats = run(
        tiny_model,
        [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)],
        engine={"max_batch_size": 8, "max_num_tokens": 96, **NGRAM},
    )
    for i, tokens in enumerate(expected):
        assert results[i].output_ids == tokens, ("ngram", i)
    assert sum(s["Draft Tokens"] for s in stats) > 0
    assert sum(s["Accepted Draft Tokens"] for s in stats) == sum(
        r.num_accepted_draft_tokens for r in results.values()
    )


def test_a_perfect_draft_on_the_model_costs_the_prompts_forward_alone(tiny_model, tiny_reference):
    """On the real model: K perfect drafts verified beside the prompt give HF's K + 1 tokens from one
    forward, with a plain request sharing it."""
    vocab = tiny_model.vocab_size
    (prompt, _), (other, _) = random_prompts(seed=9, count=2, vocab=vocab, max_prompt=20, max_output=2)
    k = 6
    expected = hf_greedy(tiny_reference, prompt, k + 1)
    requests = [
        InferenceRequest.from_values(0, prompt, k + 1, draft_input_ids=expected[:k]),
        InferenceRequest.from_values(1, other, 1),
    ]
    results, stats = run(tiny_model, requests, engine={"max_batch_size": 4, "max_num_tokens": 64})
    assert results[0].output_ids == expected
    assert results[1].output_ids == hf_greedy(tiny_reference, other, 1)
    assert results[0].num_draft_steps == 1 and results[0].num_accepted_draft_tokens == k
    assert len(stats) == 1 and stats[0]["Draft Tokens"] == k


def test_ngram_drafts_follow_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_drafts(tokens, max_ngram=3, k=2) == [7, 8]  # "1 2 3" last seen before 7 8
    assert ngram_drafts([4, 5, 6, 5], max_ngram=3, k=3) == [6, 5]  # only "5" matches
    assert ngram_drafts([4, 5, 6], max_ngram=3, k=3) == []


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_perfect_draft_finishes_with_the_prompts_last_forward(chunk):
    """K perfect drafts and K + 1 output tokens: the forward of the prompt's last chunk verifies them
    all and adds the next token, so no generation forward follows (with a chunked prompt, the earlier
    chunks run first, without drafts)."""
    executor = FakeExecutor(vocab_size=500)
    engine = {"max_batch_size": 2, "max_num_tokens": 64}
    if chunk is not None:
        engine |= {"enable_chunked_context": True, "context_chunk_size": chunk}
    kv = {"max_tokens": 512, "tokens_per_block": 4}
    core = EngineCore(make_config(engine=engine, kv_cache=kv), executor, check_integrity=True)
    prompt = list(range(5, 15))
    k = 5
    truth = [fake_token(0, len(prompt) + j, 0, 500) for j in range(k + 1)]
    assert core.add_request(Request(0, prompt, k + 1, draft_input_ids=truth[:k])) is None
    steps = []
    while core.num_active:
        steps.append(core.step())
    final = [r for s in steps for r in s.responses if r.final]
    assert [r.output_ids for r in final] == [truth]
    assert final[0].num_draft_steps == 1 and final[0].num_accepted_draft_tokens == k
    prompt_steps = 1 if chunk is None else -(-len(prompt) // chunk)
    assert len(steps) == prompt_steps
    assert core.kv_cache_manager.pool.num_used_blocks == 0


def test_drafts_count_against_the_token_budget_and_rejected_blocks_are_rolled_back():
    """Perfect drafts on the fake executor: every draft accepted, never more tokens than the budget."""
    executor = FakeExecutor(vocab_size=500)
    config = make_config(engine={"max_batch_size": 4, "max_num_tokens": 12}, kv_cache={"max_tokens": 512})
    core = EngineCore(config, executor, check_integrity=True)
    prompt = [5, 6, 7]
    for rid in range(4):
        truth = [fake_token(rid, len(prompt) + j, 0, 500) for j in range(30)]
        drafts = truth if rid % 2 else [3] * 30  # odd: perfect, even: always rejected
        assert core.add_request(Request(rid, prompt, 30, draft_input_ids=drafts)) is None
    outputs: dict[int, list[int]] = {}
    while core.num_active:
        out = core.step()
        assert out.computed_tokens <= 12
        for r in out.responses:
            if r.final:
                outputs[r.request_id] = r.output_ids
                assert r.num_accepted_draft_tokens == (r.num_draft_tokens if r.request_id % 2 else 0)
    for rid in range(4):
        assert outputs[rid] == [fake_token(rid, len(prompt) + j, 0, 500) for j in range(30)]
    assert core.kv_cache_manager.pool.num_used_blocks == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"beam_width": 2}, "draft_input_ids: not supported with beam_width > 1"),
        ({"repetition_penalty": 1.2}, "draft_input_ids: not supported beside logits controls"),
        ({"draft_logits": [[0.0] * 10]}, "draft_logits: expected shape [2, 1000]"),
    ],
)
def test_drafts_with_what_they_cannot_serve_are_refused(fields, message):
    config = make_config(engine={"max_beam_width": 2}, kv_cache={"max_tokens": 512})
    core = EngineCore(config, FakeExecutor())
    response = core.add_request(Request(0, [5, 6], 4, draft_input_ids=[7, 8], **fields))
    assert response is not None and message in response.error


CHI2_CRITICAL_DF7_P001 = 24.32  # chi-square quantile 0.999 with 7 degrees of freedom


def chi_square(counts: Counter, probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(t, 0) - n * float(p)) ** 2 / (n * float(p)) for t, p in enumerate(probs))


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    config = json.loads((REPO / "configs" / "models" / "tiny-llama.json").read_text()) | {
        "vocab_size": 8,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.05,
    }
    path = tmp_path_factory.mktemp("vocab8") / "config.json"
    path.write_text(json.dumps(config))
    torch.manual_seed(0)
    return load_model(ModelConfig(config=str(path), device="cpu", seed=3))


@pytest.mark.parametrize("source", ["ngram", "draft_logits"])
def test_sampled_outputs_keep_the_model_distribution(tiny_vocab_model, source):
    """The first three tokens' marginals over many seeds match the exact ones (chi-square at
    p = 0.001): the prompt's forward verifies drafts from the first token on, and later tokens read the
    KV a verification left."""
    model = tiny_vocab_model
    ref = reference_model(model)
    prompt = [3, 5, 3, 5, 4, 3]
    with torch.no_grad():

        def dist(ids):
            return torch.softmax(ref(torch.tensor([ids])).logits[0, -1].float(), -1)

        p0 = dist(prompt)
        second, third = torch.zeros(8), torch.zeros(8)
        for a in range(8):
            p1 = dist([*prompt, a])
            second += p0[a] * p1
            for b in range(8):
                third += p0[a] * p1[b] * dist([*prompt, a, b])
    n = 600
    g = torch.Generator().manual_seed(11)
    requests = []
    for i in range(n):
        fields = {"temperature": 1.0, "random_seed": 1000 + i}
        if source == "draft_logits":
            # drafts as a draft model makes them: each drawn from its own logits row (the first
            # follows the model, so that drafts often apply)
            logits = torch.randn(3, 8, generator=g) * 3
            drafts = [int(torch.multinomial(torch.softmax(row, -1), 1, generator=g)) for row in logits]
            drafts[0] = int(torch.multinomial(p0, 1, generator=g))
            fields |= {"draft_input_ids": drafts, "draft_logits": logits.tolist()}
        requests.append(Request(i, prompt, 3, **fields))
    engine = {"max_batch_size": 64, "max_num_tokens": 512} | (NGRAM if source == "ngram" else {})
    results, stats = run(model, requests, engine=engine)
    drafted = sum(s["Draft Tokens"] for s in stats)
    accepted = sum(s["Accepted Draft Tokens"] for s in stats)
    assert accepted > 20 and drafted - accepted > 10  # both branches of rejection sampling ran
    for position, exact in ((0, p0), (1, second), (2, third)):
        counts = Counter(r.output_ids[position] for r in results.values())
        assert chi_square(counts, exact, n) < CHI2_CRITICAL_DF7_P001, position
