"""The request surface against HF generate(): each feature on its own request, batched beside others.

Every test runs its requests together (staggered, with unrelated settings beside them) and checks each one
against HF ``generate()`` on that request alone with the equivalent GenerationConfig or logits processor:
tokens identical, log probs within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from bm.batch_manager import BatchManager, InferenceRequest
from bm.scheduling import FinishReason
from tests.clients import StaggeredClient
from tests.conftest import hf_generate, hf_greedy, make_config, random_prompts

TOL = 1e-4


def run_batch(model, requests, per_iteration=3, **sections):
    config = make_config(**sections)
    client = StaggeredClient(requests, per_iteration=per_iteration)
    with BatchManager(config, client.get_requests, client.send_response, model=model, check_integrity=True):
        client.wait_or_fail()
    for rid, result in client.results.items():
        assert result.ok, (rid, result.error)
    return client.results


def hf_run(ref, prompt, max_new, **kwargs):
    """HF generate() alone; returns (new tokens, per-token log probs of the processed distribution)."""
    out = hf_generate(ref, prompt, max_new, output_scores=True, return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, len(prompt) :].tolist()
    log_probs = [
        torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens, strict=False)
    ]
    return tokens, log_probs


def unrelated_requests(vocab, start_id, count=4):
    """Requests with other settings to share the batch: sampling, penalties, plain greedy."""
    specs = random_prompts(seed=99, count=count, vocab=vocab, max_prompt=30, max_output=16)
    settings = [
        {"temperature": 0.8, "runtime_top_k": 20, "random_seed": 5},
        {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
        {},
        {"presence_penalty": 0.7, "runtime_top_p": 0.9, "random_seed": 1},
    ]
    return [
        InferenceRequest.from_values(start_id + i, p, m, **settings[i % len(settings)])
        for i, (p, m) in enumerate(specs)
    ]


def assert_matches(result, tokens, log_probs):
    assert result.output_ids == tokens
    assert result.output_log_probs is not None
    assert len(result.output_log_probs) == len(log_probs)
    assert max(abs(a - b) for a, b in zip(result.output_log_probs, log_probs, strict=True)) < TOL


def pick_end_id(ref, prompt, max_new):
    """A token HF's plain greedy run produces early, so min_length and end_id really interact."""
    return hf_greedy(ref, prompt, max_new)[2]


def test_greedy_controls_match_hf_while_batched_with_other_settings(tiny_model, tiny_reference):
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=11, count=5, vocab=vocab, max_prompt=24, max_output=24)
    specs = [(p, 24) for p, _ in specs]
    end_ids = [pick_end_id(tiny_reference, p, m) for p, m in specs]
    cases = [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        (
            {"repetition_penalty": 0.7, "no_repeat_ngram_size": 2},
            {"repetition_penalty": 0.7, "no_repeat_ngram_size": 2},
        ),
        ({"no_repeat_ngram_size": 1}, {"no_repeat_ngram_size": 1}),
        ({"min_length": 10, "end_id": end_ids[3]}, {"min_new_tokens": 10, "eos_token_id": end_ids[3]}),
        (
            {"bad_words_list": [[end_ids[4]], [specs[4][0][-1], 7]]},
            {"bad_words_ids": [[end_ids[4]], [specs[4][0][-1], 7]]},
        ),
    ]
    requests = [
        InferenceRequest.from_values(i, p, m, return_log_probs=True, **cases[i][0])
        for i, (p, m) in enumerate(specs)
    ]
    results = run_batch(tiny_model, requests + unrelated_requests(vocab, 100))
    for i, (prompt, max_new) in enumerate(specs):
        tokens, log_probs = hf_run(tiny_reference, prompt, max_new, **cases[i][1])
        assert_matches(results[i], tokens, log_probs)
    # plain greedy would end at its third token; min_length holds the end id back for ten
    assert len(results[3].output_ids) >= 10 and end_ids[3] not in results[3].output_ids[:10]
    assert end_ids[4] not in results[4].output_ids


class TrtPenalties(LogitsProcessor):
    """The reference for what HF has no processor for: presence/frequency penalties over the output
    (TensorRT-LLM / OpenAI semantics) and an additive embedding bias."""

    def __init__(self, prompt_len, presence=0.0, frequency=0.0, bias=None):
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        if self.bias is not None:
            scores += self.bias
        for row, ids in enumerate(input_ids):
            for token in ids[self.prompt_len :].tolist():
                scores[row, token] -= self.frequency
            for token in set(ids[self.prompt_len :].tolist()):
                scores[row, token] -= self.presence
        return scores


def test_presence_frequency_and_embedding_bias_match_a_direct_reference(tiny_model, tiny_reference):
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=12, count=3, vocab=vocab, max_prompt=20, max_output=20)
    bias = torch.zeros(vocab)
    bias[torch.arange(3, vocab, 7)] = 2.5
    bias[torch.arange(5, vocab, 11)] = -4.0
    fields = [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.8, "presence_penalty": -0.3},
        {"embedding_bias": bias[None]},
    ]
    processors = [
        TrtPenalties(len(specs[0][0]), presence=1.5),
        TrtPenalties(len(specs[1][0]), presence=-0.3, frequency=0.8),
        TrtPenalties(len(specs[2][0]), bias=bias),
    ]
    requests = [
        InferenceRequest.from_values(i, p, m, return_log_probs=True, **fields[i])
        for i, (p, m) in enumerate(specs)
    ]
    results = run_batch(tiny_model, requests + unrelated_requests(vocab, 100))
    for i, (prompt, max_new) in enumerate(specs):
        tokens, log_probs = hf_run(
            tiny_reference, prompt, max_new, logits_processor=LogitsProcessorList([processors[i]])
        )
        assert_matches(results[i], tokens, log_probs)


class StopOnTokenWords(StoppingCriteria):
    """HF's stop_strings, on token ids: stop once the sequence ends with any of the words."""

    def __init__(self, words):
        self.words = words

    def __call__(self, input_ids, scores, **kwargs):
        ids = input_ids[0].tolist()
        done = any(len(ids) >= len(w) and ids[-len(w) :] == w for w in self.words)
        return torch.tensor([done])


def test_stop_words_end_the_request_like_an_hf_stopping_criterion(tiny_model, tiny_reference):
    vocab = tiny_model.vocab_size
    specs = [(p, 30) for p, _ in random_prompts(seed=13, count=4, vocab=vocab, max_prompt=20, max_output=1)]
    words = []
    for prompt, max_new in specs:
        full = hf_greedy(tiny_reference, prompt, max_new)
        words.append([full[5:7], [vocab - 1]])  # a two-token word that occurs, and one that may not
    requests = [
        InferenceRequest.from_values(i, p, m, stop_words_list=words[i], return_log_probs=True)
        for i, (p, m) in enumerate(specs)
    ]
    results = run_batch(tiny_model, requests + unrelated_requests(vocab, 100))
    for i, (prompt, max_new) in enumerate(specs):
        criteria = StoppingCriteriaList([StopOnTokenWords(words[i])])
        tokens, log_probs = hf_run(tiny_reference, prompt, max_new, stopping_criteria=criteria)
        assert_matches(results[i], tokens, log_probs)
        assert results[i].finish_reason == FinishReason.STOP_WORDS
        assert len(tokens) <= 7


@pytest.mark.parametrize(
    ("beam_width", "len_penalty", "early_stopping", "hf_early_stopping"),
    [(2, 1.0, 1, True), (3, 0.5, 0, False), (4, -0.5, 2, "never"), (3, 2.0, 1, True)],
)
def test_beam_search_matches_hf_while_batched(
    tiny_model, tiny_reference, beam_width, len_penalty, early_stopping, hf_early_stopping
):
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=14 + beam_width, count=3, vocab=vocab, max_prompt=20, max_output=12)
    # an end id the greedy path reaches, so hypotheses finish at different lengths
    end_ids = [hf_greedy(tiny_reference, p, m)[m // 2] for p, m in specs]
    fields = {"beam_width": beam_width, "len_penalty": len_penalty, "early_stopping": early_stopping}
    requests = [
        InferenceRequest.from_values(i, p, m, end_id=end_ids[i], return_log_probs=True, **fields)
        for i, (p, m) in enumerate(specs)
    ]
    results = run_batch(
        tiny_model,
        requests + unrelated_requests(vocab, 100),
        engine={"max_beam_width": 4},
        kv_cache={"tokens_per_block": 4, "max_tokens": 4096},
    )
    for i, (prompt, max_new) in enumerate(specs):
        out = hf_generate(
            tiny_reference,
            prompt,
            max_new,
            num_beams=beam_width,
            num_return_sequences=beam_width,
            length_penalty=len_penalty,
            early_stopping=hf_early_stopping,
            eos_token_id=end_ids[i],
            output_scores=True,
            return_dict_in_generate=True,
        )
        # per-token log probs of each returned beam, as HF's beam search scored them
        transitions = tiny_reference.compute_transition_scores(
            out.sequences, out.scores, out.beam_indices, normalize_logits=False
        )
        result = results[i]
        assert len(result.beams) == beam_width
        for b, beam in enumerate(result.beams):
            hf_beam = out.sequences[b, len(prompt) :].tolist()
            assert hf_beam[: len(beam)] == beam, f"request {i} beam {b}"
            length = len(beam)
            hf_log_probs = transitions[b, :length].tolist()
            assert result.beam_log_probs[b] == pytest.approx(hf_log_probs, abs=TOL)
            score = result.cum_log_probs[b] / (length**len_penalty)
            assert abs(score - out.sequences_scores[b].item()) < TOL
            assert abs(sum(result.beam_log_probs[b]) - result.cum_log_probs[b]) < TOL


def test_logits_post_processor_sees_the_tokens_so_far_and_changes_the_choice(tiny_model, tiny_reference):
    vocab = tiny_model.vocab_size
    (prompt, max_new), other = random_prompts(seed=15, count=2, vocab=vocab, max_prompt=16, max_output=12)
    seen: list[list[int]] = []

    def forbid_repeats_of_last(request_id, logits, tokens):
        assert request_id == 0
        seen.append(list(tokens[0]))
        logits[0, tokens[0][-1]] = float("-inf")
        return logits

    class Same(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[0, input_ids[0, -1]] = float("-inf")
            return scores

    request = InferenceRequest.from_values(0, prompt, max_new, return_log_probs=True)
    request.logits_post_processor = forbid_repeats_of_last
    results = run_batch(tiny_model, [request, InferenceRequest.from_values(1, *other)])
    tokens, log_probs = hf_run(
        tiny_reference, prompt, max_new, logits_processor=LogitsProcessorList([Same()])
    )
    assert_matches(results[0], tokens, log_probs)
    assert seen == [prompt + tokens[:k] for k in range(max_new)]


def test_context_and_generation_logits_equal_the_reference_model(tiny_model, tiny_reference):
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=16, count=3, vocab=vocab, max_prompt=40, max_output=6)
    requests = [
        InferenceRequest.from_values(i, p, m, return_context_logits=True, return_generation_logits=True)
        for i, (p, m) in enumerate(specs)
    ]
    # chunked contexts: the context logits are gathered piece by piece
    results = run_batch(
        tiny_model,
        requests + unrelated_requests(vocab, 100),
        engine={"enable_chunked_context": True, "max_num_tokens": 16},
        kv_cache={"tokens_per_block": 8},
    )
    for i, (prompt, max_new) in enumerate(specs):
        with torch.no_grad():
            context = tiny_reference(torch.tensor([prompt])).logits[0].float()
        out = hf_generate(tiny_reference, prompt, max_new, output_logits=True, return_dict_in_generate=True)
        assert results[i].context_logits.shape == (len(prompt), vocab)
        assert torch.allclose(results[i].context_logits, context, atol=TOL)
        generation = torch.cat(out.logits).float()
        assert results[i].generation_logits.shape == (max_new, vocab)
        assert torch.allclose(results[i].generation_logits, generation, atol=TOL)


@pytest.mark.parametrize(
    "engine",
    [
        {"batching_scheme": "v1", "max_batch_size": 4},
        {"scheduler_policy": "max_utilization"},
        {"scheduler_policy": "static_batch", "batching_scheme": "inflight"},
    ],
)
def test_beam_requests_match_hf_under_every_scheme_and_a_tight_cache(tiny_model, tiny_reference, engine):
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=31, count=6, vocab=vocab, max_prompt=16, max_output=10)
    requests = [
        InferenceRequest.from_values(i, p, m, beam_width=3 if i % 2 == 0 else 1)
        for i, (p, m) in enumerate(specs)
    ]
    # 30 blocks of 4 tokens: not everyone fits at once, so plain requests wait (or are paused) beside beams
    results = run_batch(
        tiny_model,
        requests,
        per_iteration=2,
        engine={"max_beam_width": 3, **engine},
        kv_cache={"tokens_per_block": 4, "max_tokens": 120},
    )
    for i, (prompt, max_new) in enumerate(specs):
        if i % 2:
            assert results[i].output_ids == hf_greedy(tiny_reference, prompt, max_new)
            continue
        out = hf_generate(tiny_reference, prompt, max_new, num_beams=3, early_stopping=True)
        assert results[i].output_ids == out[0, len(prompt) :].tolist(), f"request {i}"
