"""Request fields beyond the oracle: seeds, streaming, stop signals, validation, beam KV accounting, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from bm.batch_manager import BatchManager, InferenceRequest
from bm.kv import KVCacheManager
from bm.scheduling import FinishReason, LlmRequest
from bm.scheduling.capacity import GuaranteedNoEvictScheduler, MaxUtilizationScheduler
from tests.clients import ScriptedClient, StaggeredClient
from tests.conftest import make_config, random_prompts
from tests.engine_wait import generate_or_fail, wait_until
from tests.test_cli_run import invoke, read_jsonl


def sampled(model, requests, per_iteration=2):
    client = StaggeredClient(requests, per_iteration=per_iteration)
    with BatchManager(make_config(), client.get_requests, client.send_response, model=model):
        client.wait_or_fail()
    return client.results


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_model):
    specs = random_prompts(seed=21, count=6, vocab=tiny_model.vocab_size, max_prompt=20, max_output=16)
    fields = {"temperature": 1.3, "runtime_top_p": 0.95, "random_seed": 1234}
    target = InferenceRequest.from_values(0, specs[0][0], 16, **fields)
    alone = sampled(tiny_model, [target])[0].output_ids
    again = sampled(tiny_model, [InferenceRequest.from_values(0, specs[0][0], 16, **fields)])[0].output_ids
    others = [
        InferenceRequest.from_values(i, p, m, temperature=0.9, random_seed=i, repetition_penalty=1.3)
        for i, (p, m) in enumerate(specs[1:], start=1)
    ]
    crowded = sampled(
        tiny_model, [*others[:3], InferenceRequest.from_values(0, specs[0][0], 16, **fields), *others[3:]]
    )
    assert alone == again == crowded[0].output_ids
    other_seed = sampled(
        tiny_model, [InferenceRequest.from_values(0, specs[0][0], 16, **{**fields, "random_seed": 7})]
    )
    assert other_seed[0].output_ids != alone  # the seed matters (16 tokens at temperature 1.3)


def test_streaming_yields_the_non_streamed_tokens_one_step_at_a_time(tiny_model):
    specs = random_prompts(seed=22, count=4, vocab=tiny_model.vocab_size, max_prompt=20, max_output=12)
    fields = {"repetition_penalty": 1.4, "return_log_probs": True}
    plain = generate_or_fail(
        [InferenceRequest.from_values(i, p, m, **fields) for i, (p, m) in enumerate(specs)],
        make_config(),
        model=tiny_model,
    )
    client = ScriptedClient()
    with BatchManager(make_config(), client.get_requests, client.send_response, model=tiny_model):
        client.push(
            *[
                InferenceRequest.from_values(i, p, m, streaming=True, **fields)
                for i, (p, m) in enumerate(specs)
            ]
        )
        client.wait_finals(len(specs))
    for i in range(len(specs)):
        responses = [(t, f) for rid, t, f, _ in client.responses if rid == i]
        assert [f for _, f in responses] == [False] * (len(responses) - 1) + [True]
        steps = [t["output_ids"][0].tolist() for t, _ in responses]
        assert all(len(s) == 1 for s in steps[:-1]) and len(steps[-1]) <= 1
        assert [tok for s in steps for tok in s] == plain[i].output_ids
        log_probs = [v for t, _ in responses for v in t["output_log_probs"][0, 0].tolist()]
        assert log_probs == pytest.approx(plain[i].output_log_probs, abs=1e-5)


def test_stop_signal_cancels_with_partial_output_and_frees_blocks(tiny_model):
    client = ScriptedClient()
    config = make_config(engine={"max_beam_width": 2})
    with BatchManager(
        config,
        client.get_requests,
        client.send_response,
        client.poll_stop_signal,
        model=tiny_model,
        check_integrity=True,
    ) as manager:
        client.push(
            InferenceRequest.from_values(1, [5, 6, 7], 200, streaming=True),
            InferenceRequest.from_values(2, [8, 9], 200, beam_width=2),
            InferenceRequest.from_values(3, [10, 11], 6),
        )

        def streamed() -> int:
            with client.lock:
                return sum(1 for r in client.responses if r[0] == 1)

        wait_until(lambda: streamed() >= 5, lambda: f"request 1 streamed {streamed()} responses, not 5")
        with client.lock:
            client.stop_ids = {1, 2}
        client.wait_finals(3)
        kv = manager.kv_cache_manager
    ((t1, e1),) = client.finals_for(1)
    ((t2, _),) = client.finals_for(2)
    assert int(t1["finish_reason"][0]) == int(FinishReason.CANCELLED) and e1 == ""
    assert int(t2["finish_reason"][0]) == int(FinishReason.CANCELLED)
    streamed = [tok for rid, t, _, _ in client.responses if rid == 1 for tok in t["output_ids"][0].tolist()]
    assert 5 <= len(streamed) < 200
    assert t2["output_ids"].shape[0] == 2 and 0 < int(t2["sequence_length"][0]) < 200
    assert int(client.finals_for(3)[0][0]["finish_reason"][0]) == int(FinishReason.LENGTH)
    assert kv.pool.num_used_blocks == 0 and kv.num_requests == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"runtime_top_k": -3}, "runtime_top_k: must be at least 0, got -3"),
        ({"runtime_top_p": 1.01}, "runtime_top_p: 1.01 is out of range; allowed (0, 1]"),
        ({"temperature": -1.0}, "temperature: -1.0 is out of range; allowed >= 0"),
        ({"beam_width": 5}, "beam_width: must be at most 4, got 5"),
        ({"embedding_bias": torch.zeros(1, 7)}, "embedding_bias: expected 259 numbers"),
        ({"bad_words_list": torch.tensor([[5, 6, 7], [2, 1, -1]])}, "bad_words_list: offsets must increase"),
        ({"stop_words_list": torch.tensor([5, 6])}, "stop_words_list: expected the [2, n] form"),
        (
            {"stop_words_list": torch.tensor([[5, 6], [-1, 2]])},
            "stop_words_list: offset -1 (padding) is followed",
        ),
        ({"bad_words_list": [[5, 9999]]}, "bad_words_list: token id outside the vocabulary"),
        ({"repetition_penalty": 0.0}, "repetition_penalty: 0.0 is out of range; allowed > 0"),
        ({"temperature": float("nan")}, "temperature: expected a finite number"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty: expected a finite number"),
        ({"early_stopping": -1}, "early_stopping: must be at least 0, got -1"),
        ({"len_penalty": float("nan")}, "len_penalty: expected a finite number"),
        ({"min_length": 9}, "min_length: must be at most 4, got 9"),
        ({"beam_width": 2, "temperature": 0.7}, "beam_width: beam search is deterministic"),
        ({"beam_width": 2, "streaming": True}, "streaming: not supported with beam_width > 1"),
    ],
)
def test_invalid_decoding_fields_get_an_error_naming_the_field_and_range(tiny_model, fields, message):
    config = make_config(engine={"max_beam_width": 4})
    results = generate_or_fail(
        [InferenceRequest.from_values(1, [5, 6], 4, **fields)], config, model=tiny_model
    )
    assert message in results[1].error, results[1].error
    assert results[1].finish_reason == FinishReason.ERROR


def test_beams_share_prompt_blocks_and_fork_the_one_they_write():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4)
    kv.allocate(7, 6)  # prompt of 6 tokens: one full block and a partial one
    kv.fork_beams(7, [0, 0, 0])
    tables = [kv.block_ids(7, b) for b in range(3)]
    assert tables[0] == tables[1] == tables[2] and kv.pool.num_used_blocks == 2
    kv.check_integrity()
    assert kv.num_blocks_to_allocate(7, 7) == 2  # two of three beams must copy the shared partial block
    copies = [kv.copy_on_write(7, b, 6) for b in range(3)]
    assert copies[0] is not None and copies[1] is not None and copies[2] is None  # the last holds it alone
    assert {c[0] for c in copies if c} == {tables[2][1]}
    assert kv.block_ids(7, 0)[0] == kv.block_ids(7, 2)[0]  # full block still shared
    kv.check_integrity()
    kv.fork_beams(7, [2, 2, 0])  # beams 0 and 1 continue beam 2; beam 0's copy is no longer referenced
    kv.check_integrity()
    assert kv.pool.num_used_blocks == 3 and kv.num_requests == 1
    assert kv.free(7) == 6 and kv.pool.num_used_blocks == 0
    kv.check_integrity()


def beam_request(rid, prompt_len, max_new, width):
    return LlmRequest(
        request_id=rid, prompt_ids=list(range(3, 3 + prompt_len)), max_new_tokens=max_new, beam_width=width
    )


def test_capacity_counts_a_beam_request_as_a_table_per_beam():
    kv = KVCacheManager(num_blocks=11, tokens_per_block=4)
    beam, plain = beam_request(1, 6, 6, 3), beam_request(2, 6, 6, 1)
    assert kv.get_needed_resource_to_completion(beam) == 9
    fitting, _ = GuaranteedNoEvictScheduler(8, kv).schedule_request([beam, plain])
    assert fitting == [beam]  # 9 + 3 > 11: the plain request waits
    # MAX_UTILIZATION reserves a beam request's whole need too (beams are never paused); others get the rest
    kv2 = KVCacheManager(num_blocks=10, tokens_per_block=4)
    fitting, paused = MaxUtilizationScheduler(8, kv2).schedule_request([beam_request(1, 6, 6, 3), plain])
    assert [r.request_id for r in fitting] == [1] and paused == []
    kv3 = KVCacheManager(num_blocks=11, tokens_per_block=4)
    fitting, paused = MaxUtilizationScheduler(8, kv3).schedule_request([beam_request(1, 6, 6, 3), plain])
    assert [r.request_id for r in fitting] == [1, 2] and paused == []


def test_cli_accepts_every_field_and_writes_log_probs_and_logits_files(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {
            "id": "a",
            "prompt": "hello there",
            "max_tokens": 6,
            "return_log_probs": True,
            "repetition_penalty": 1.3,
            "presence_penalty": 0.2,
            "frequency_penalty": 0.1,
            "min_length": 2,
            "no_repeat_ngram_size": 3,
            "bad_words_list": ["zz", [70, 71]],
            "stop_words_list": [[9, 9, 9]],
            "pad_id": 0,
            "embedding_bias": [0.0] * 259,
            "top_k": 0,
            "top_p": 1.0,
            "temperature": 0.0,
        },
        {
            "id": "b",
            "prompt": "beams",
            "max_tokens": 5,
            "beam_width": 2,
            "len_penalty": 0.8,
            "early_stopping": 1,
            "return_log_probs": True,
            "return_context_logits": True,
        },
        {
            "id": "c",
            "prompt": "raw",
            "max_tokens": 4,
            "return_generation_logits": True,
            "bad_words_list": [[5, 6], [1, 2]],
            "seed": 3,
            "temperature": 0.8,
        },
        {"id": "d", "prompt": "bad", "stop_words_list": [["x"]]},
        {"id": "e", "prompt": "bad", "embedding_bias": [1.0, 2.0]},
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = invoke(prompts, "-o", tmp_path / "out", "--set", "engine.max_beam_width=2")
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in read_jsonl(tmp_path / "out" / "outputs.jsonl")}
    a, b, c = records["a"], records["b"], records["c"]
    assert a["error"] is None and len(a["output_log_probs"]) == a["num_output_tokens"]
    assert a["cum_log_probs"] == pytest.approx(sum(a["output_log_probs"]), abs=1e-4)
    assert b["error"] is None and len(b["beams"]) == 2 and b["output_ids"] == b["beams"][0]
    assert len(b["cum_log_probs"]) == 2 and "logits_file" in b
    logits = load_file(tmp_path / "out" / b["logits_file"])
    assert logits["context_logits"].shape == (len("beams"), 259)
    gen = load_file(tmp_path / "out" / c["logits_file"])["generation_logits"]
    assert gen.shape == (c["num_output_tokens"], 259) and "logits_file" not in a
    assert "stop_words_list" in records["d"]["error"] and "[x]" not in json.dumps(records["d"])
    assert "embedding_bias: expected 259 numbers" in records["e"]["error"]


def test_from_values_takes_a_tokenizers_result_and_refuses_other_shapes_in_bms_words():
    from bm.batch_manager import InferenceRequest
    from bm.engine.requests.request import RequestError

    plain = InferenceRequest.from_values(0, [5, 6, 7], 4).tensors["input_ids"]
    for given in (
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
        {"input_ids": [[5, 6, 7]]},
        [[5, 6, 7]],
    ):
        assert torch.equal(InferenceRequest.from_values(0, given, 4).tensors["input_ids"], plain)
    with pytest.raises(RequestError, match="input_ids: expected a list of integer token ids, got str"):
        InferenceRequest.from_values(0, "hello", 4)
    with pytest.raises(RequestError, match="a mapping with keys"):
        InferenceRequest.from_values(0, {"text": "hello"}, 4)
