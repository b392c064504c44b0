"""The correctness oracle: bm's greedy output equals HF generate() on each request alone."""

from __future__ import annotations

import pytest

from bm.batch_manager import BatchManager, InferenceRequest
from bm.scheduling import FinishReason
from tests.clients import StaggeredClient
from tests.conftest import hf_greedy, make_config, random_prompts


def run_staggered(model, config, specs, per_iteration=3, **fields):
    requests = [InferenceRequest.from_values(i, p, m, **fields) for i, (p, m) in enumerate(specs)]
    client = StaggeredClient(requests, per_iteration=per_iteration)
    with BatchManager(config, client.get_requests, client.send_response, model=model, check_integrity=True):
        client.wait_or_fail()
    return client


@pytest.mark.parametrize(
    ("engine", "kv"),
    [
        ({"max_batch_size": 8, "max_num_tokens": 96}, {"tokens_per_block": 8, "max_tokens": 4096}),
        # a cache too small for everyone at once: requests wait for blocks, none is evicted
        ({"max_batch_size": 16, "max_num_tokens": 256}, {"tokens_per_block": 4, "max_tokens": 160}),
        ({"max_batch_size": 3, "max_num_tokens": 64}, {"tokens_per_block": 16, "max_tokens": 2048}),
    ],
)
def test_greedy_output_equals_hf_generate_for_mixed_concurrent_requests(
    tiny_model, tiny_reference, engine, kv
):
    specs = random_prompts(seed=1, count=24, vocab=tiny_model.vocab_size, max_prompt=48, max_output=24)
    client = run_staggered(tiny_model, make_config(engine=engine, kv_cache=kv), specs)
    for i, (prompt, max_new) in enumerate(specs):
        result = client.results[i]
        assert result.ok, result.error
        assert result.finish_reason == FinishReason.LENGTH
        assert result.output_ids == hf_greedy(tiny_reference, prompt, max_new), f"request {i}"


def test_generation_stops_at_end_id_like_hf(tiny_model, tiny_reference):
    specs = random_prompts(seed=2, count=12, vocab=tiny_model.vocab_size, max_prompt=20, max_output=40)
    # pick, for each prompt, an end id that HF actually produces part-way, so stopping is exercised
    end_ids = []
    for prompt, max_new in specs:
        full = hf_greedy(tiny_reference, prompt, max_new)
        end_ids.append(full[len(full) // 2])
    requests = [InferenceRequest.from_values(i, p, m, end_id=end_ids[i]) for i, (p, m) in enumerate(specs)]
    client = StaggeredClient(requests, per_iteration=4)
    with BatchManager(make_config(), client.get_requests, client.send_response, model=tiny_model):
        client.wait_or_fail()
    for i, (prompt, max_new) in enumerate(specs):
        expected = hf_greedy(tiny_reference, prompt, max_new, end_id=end_ids[i])
        assert client.results[i].output_ids == expected
        assert client.results[i].finish_reason == FinishReason.END_ID
