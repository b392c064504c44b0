"""n samples per request (num_return_sequences / OpenAI's n), top log probs and logit bias, on the engine
core: the tiny model against HF generate(), and the fake executor across schedulers, chunking and reuse."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from bm.engine.requests.request import Request
from bm.engine.requests.seeds import sample_seed
from bm.engine.step.core import EngineCore
from bm.runtime.executor import TorchExecutor
from tests.conftest import hf_generate, hf_greedy, make_config, random_prompts
from tests.test_engine_core import core_for, mixed_requests, run_all

PROMPT = [5, 17, 33, 90, 41, 12, 8, 61, 77, 23, 14]  # 11 tokens: the last block is partial (8 per block)


def run_model(model, requests, **sections):
    core = EngineCore(make_config(**sections), TorchExecutor(model), check_integrity=True)
    out = run_all(core, requests)
    for rid, response in out["finals"].items():
        assert not response.error, (rid, response.error)
    assert core.kv_cache_manager.pool.num_used_blocks == 0 or core.kv_cache_manager.enable_block_reuse
    return out


def context_tokens(out) -> int:
    return sum(step.stats.context_tokens for step in out["records"] if step.stats is not None)


def beside(vocab: int) -> list[Request]:
    """Unrelated requests to share the batch."""
    specs = random_prompts(seed=3, count=3, vocab=vocab, max_prompt=20, max_output=10)
    return [Request(50 + i, p, m, temperature=0.7, random_seed=i) for i, (p, m) in enumerate(specs)]


def test_n_samples_at_temperature_one_are_distinct(tiny_model):
    request = Request(1, PROMPT, 12, temperature=1.0, random_seed=7, num_return_sequences=4)
    response = run_model(tiny_model, [request])["finals"][1]
    outputs = [tuple(s.output_ids) for s in response.samples]
    assert [s.index for s in response.samples] == [0, 1, 2, 3]
    assert len(set(outputs)) == 4, outputs
    assert response.output_ids == list(outputs[0])


def test_n_greedy_samples_are_identical_and_equal_hf_generate(tiny_model, tiny_reference):
    request = Request(1, PROMPT, 10, num_return_sequences=4)
    response = run_model(tiny_model, [request, *beside(tiny_model.vocab_size)])["finals"][1]
    expected = hf_greedy(tiny_reference, PROMPT, 10)
    assert [s.output_ids for s in response.samples] == [expected] * 4


def test_each_sample_is_the_same_request_alone_with_its_derived_seed(tiny_model):
    """A sample depends on its seed alone: sample i equals an n=1 request seeded with sample i's seed,
    run by itself, however its siblings and the batch run (chunked prompt, small blocks)."""
    request = Request(1, PROMPT, 8, temperature=1.0, random_seed=11, num_return_sequences=3)
    together = run_model(
        tiny_model,
        [request, *beside(tiny_model.vocab_size)],
        engine={"enable_chunked_context": True, "max_num_tokens": 16},
        kv_cache={"tokens_per_block": 4},
    )["finals"][1]
    for sample in together.samples:
        seed = sample_seed(11, sample.index)
        alone = run_model(tiny_model, [Request(2, PROMPT, 8, temperature=1.0, random_seed=seed)])
        assert sample.output_ids == alone["finals"][2].output_ids


def test_the_prompt_of_n_samples_is_computed_once(tiny_model):
    one = run_model(tiny_model, [Request(1, PROMPT, 6, temperature=1.0)])
    four = run_model(tiny_model, [Request(1, PROMPT, 6, temperature=1.0, num_return_sequences=4)])
    assert context_tokens(one) == context_tokens(four) == len(PROMPT)
    generated = sum(step.stats.generation_requests for step in four["records"] if step.stats)
    # sample 0 samples its first token from the prompt's forward; each sibling recomputes only the
    # prompt's last position (one token) before its own tokens
    assert generated == 5 + 3 * 6


@pytest.mark.parametrize(
    "engine, kv",
    [
        ({}, {}),
        ({"scheduler_policy": "max_utilization"}, {"max_tokens": 96}),
        ({"enable_chunked_context": True, "max_num_tokens": 8}, {"enable_block_reuse": True}),
        ({"batching_scheme": "inflight"}, {"enable_block_reuse": True}),
    ],
)
def test_samples_share_the_prompts_blocks_under_every_scheduler(engine, kv):
    """The fake executor, with the KV manager's integrity checked every step: forked tables, copies of
    the shared tail block, pauses and reuse all keep the pool's accounting exact."""
    core = core_for(engine, kv)
    requests = [
        *mixed_requests(6),
        Request(100, [5, 6, 7, 8, 9, 10], 10, num_return_sequences=4),
        Request(101, [5, 6, 7, 8], 6, num_return_sequences=3),  # the prompt ends on a block boundary
    ]
    out = run_all(core, requests)
    finals = out["finals"]
    assert [len(s.output_ids) for s in finals[100].samples] == [10] * 4
    assert [len(s.output_ids) for s in finals[101].samples] == [6] * 3
    assert context_tokens(out) >= sum(len(r.input_ids) for r in requests)  # pauses recompute
    if engine.get("scheduler_policy") != "max_utilization":
        assert context_tokens(out) == sum(len(r.input_ids) for r in requests)
    assert not core.kv_cache_manager.request_ids()


def test_cancelling_an_n_sample_request_ends_every_sample_with_one_response():
    core = core_for()
    assert core.add_request(Request(7, [5, 6, 7, 8, 9], 50, num_return_sequences=3)) is None
    for _ in range(3):
        core.step()
    assert core.num_active == 3 and core.has_request(7)
    response = core.cancel(7)
    assert response is not None and response.request_id == 7 and len(response.samples) == 3
    assert core.num_active == 0 and not core.has_request(7)
    assert not core.kv_cache_manager.request_ids()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_return_sequences": 0}, "num_return_sequences"),
        ({"num_return_sequences": 129}, "num_return_sequences"),
        ({"num_return_sequences": 2, "streaming": True}, "streaming"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {3: 101}}, "logit_bias[3]"),
        ({"logit_bias": {10**6: 1}}, "outside the vocabulary"),
    ],
)
def test_out_of_range_sampling_fields_are_refused_naming_the_field(fields, message):
    response = core_for().add_request(Request(1, [5, 6, 7], 4, **fields))
    assert response is not None and message in response.error, response


def test_top_log_probs_are_sorted_hold_the_chosen_token_and_match_hf_log_softmax(tiny_model, tiny_reference):
    prompt, steps = PROMPT, 8
    request = Request(1, prompt, steps, top_logprobs=5)
    response = run_model(tiny_model, [request, *beside(tiny_model.vocab_size)])["finals"][1]
    out = hf_generate(tiny_reference, prompt, steps, output_scores=True, return_dict_in_generate=True)
    assert response.output_ids == out.sequences[0, len(prompt) :].tolist()
    assert len(response.output_top_log_probs) == steps
    for position, (token, log_prob, top) in enumerate(
        zip(response.output_ids, response.output_log_probs, response.output_top_log_probs, strict=True)
    ):
        values = [v for _, v in top]
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert dict(top)[token] == log_prob  # greedy: the chosen token is the most likely
        reference = torch.log_softmax(out.scores[position][0].float(), -1)
        for t, v in top:
            assert v == pytest.approx(reference[t].item(), abs=1e-4)


class AddBias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids, scores):
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


def test_logit_bias_is_added_to_the_logits_as_hf_does_it(tiny_model, tiny_reference):
    plain = hf_greedy(tiny_reference, PROMPT, 8)
    bias = {plain[0]: -100.0, plain[3]: -100.0, 40: 5.0}
    request = Request(1, PROMPT, 8, logit_bias=bias)
    response = run_model(tiny_model, [request, *beside(tiny_model.vocab_size)])["finals"][1]
    processors = LogitsProcessorList([AddBias(bias)])
    expected = hf_generate(tiny_reference, PROMPT, 8, logits_processor=processors)[0, len(PROMPT) :].tolist()
    assert response.output_ids == expected and expected != plain


def test_the_seeds_tensor_api_takes_num_return_sequences_and_returns_every_sample(tiny_model, tiny_reference):
    from bm.batch_manager import BatchManager, InferenceRequest
    from tests.clients import ScriptedClient

    client = ScriptedClient()
    client.push(
        InferenceRequest.from_values(1, PROMPT, 6, num_return_sequences=3, return_log_probs=True),
        InferenceRequest.from_values(2, PROMPT, 6, num_return_sequences=2, temperature=1.0, random_seed=4),
    )
    config = make_config()
    with BatchManager(config, client.get_requests, client.send_response, model=tiny_model):
        client.wait_finals(2)
    ((greedy, error),) = client.finals_for(1)
    assert not error
    expected = hf_greedy(tiny_reference, PROMPT, 6)
    assert greedy["output_ids"].tolist() == [expected] * 3
    assert greedy["sequence_length"].tolist() == [6] * 3 and greedy["output_log_probs"].shape == (1, 3, 6)
    ((sampled, _),) = client.finals_for(2)
    assert sampled["num_return_sequences"].tolist() == [2] and sampled["output_ids"].shape[0] == 2


def test_bm_generate_returns_every_sample_and_the_top_log_probs(tiny_model):
    from bm.batch_manager.offline import generate

    results = generate(
        [Request(1, PROMPT, 5, temperature=1.0, random_seed=2, num_return_sequences=3, top_logprobs=2)],
        make_config(),
        model=tiny_model,
    )
    result = results[1]
    assert result.ok and [s.index for s in result.samples] == [0, 1, 2]
    assert result.output_ids == result.samples[0].output_ids
    assert [len(s.output_top_log_probs) for s in result.samples] == [5, 5, 5]
    assert len(result.output_top_log_probs) == 5 and all(len(top) == 2 for top in result.output_top_log_probs)
