"""The seed's callback semantics, request validation, and the loop's invariants."""

from __future__ import annotations

import json
import time

import pytest
import torch

from bm.batch_manager import BatchManager, InferenceRequest
from bm.scheduling import FinishReason
from tests.clients import ScriptedClient
from tests.conftest import hf_greedy, make_config
from tests.engine_wait import generate_or_fail, wait_until
from tests.hang import HANG_S

SEED_STATS_FIELDS = {
    "Timestamp",
    "Iteration Counter",
    "Active Request Count",
    "Max Request Count",
    "Max KV cache blocks",
    "Free KV cache blocks",
    "Used KV cache blocks",
    "Tokens per KV cache block",
    "Scheduled Requests",
    "Context Requests",
    "Generation Requests",
    "Total Context Tokens",
    "MicroBatch ID",
}


def start(model, client: ScriptedClient, **sections) -> BatchManager:
    return BatchManager(
        make_config(**sections),
        client.get_requests,
        client.send_response,
        client.poll_stop_signal,
        client.return_stats,
        model=model,
        check_integrity=True,
    )


def prompt(n: int, offset: int = 0) -> list[int]:
    return [3 + (offset + 7 * i) % 250 for i in range(n)]


def test_responses_carry_output_ids_sequence_length_and_finish_reason(tiny_model, tiny_reference):
    client = ScriptedClient()
    with start(tiny_model, client):
        client.push(InferenceRequest.from_values(5, prompt(10), 6))
        client.wait_finals(1)
    ((tensors, error),) = client.finals_for(5)
    assert error == ""
    assert tensors["output_ids"].shape == (1, 6) and tensors["output_ids"].dtype == torch.int32
    assert tensors["sequence_length"].tolist() == [6]
    assert tensors["finish_reason"].tolist() == [int(FinishReason.LENGTH)]
    assert tensors["num_pauses"].tolist() == [0]
    assert 0 <= tensors["queue_time"].item() < 60
    assert tensors["output_ids"][0].tolist() == hf_greedy(tiny_reference, prompt(10), 6)


def test_duplicate_active_id_is_rejected_and_id_is_reusable_after_final(tiny_model):
    client = ScriptedClient()
    with start(tiny_model, client):
        client.push(
            InferenceRequest.from_values(1, prompt(8), 40), InferenceRequest.from_values(1, prompt(4), 4)
        )
        client.wait_finals(2)
        finals = client.finals_for(1)
        assert "already active" in finals[0][1]  # the duplicate is refused at once
        assert finals[1][1] == "" and finals[1][0]["output_ids"].shape[1] == 40
        client.push(InferenceRequest.from_values(1, prompt(5), 3))  # reuse after the final response
        client.wait_finals(3)
    assert client.finals_for(1)[2][1] == ""
    assert client.finals_for(1)[2][0]["output_ids"].shape[1] == 3


def test_stop_signal_cancels_with_partial_output_and_frees_blocks(tiny_model):
    client = ScriptedClient()
    manager = start(tiny_model, client)
    try:
        client.push(InferenceRequest.from_values(9, prompt(12), 500))
        wait_until(
            lambda: manager.kv_cache_manager.num_tokens(9) >= 20,
            lambda: f"request 9 holds {manager.kv_cache_manager.num_tokens(9)} tokens in the cache, not 20",
        )
        client.stop_ids = {9}
        client.wait_finals(1)
        ((tensors, error),) = client.finals_for(9)
        assert error == ""
        assert tensors["finish_reason"].tolist() == [int(FinishReason.CANCELLED)]
        assert 0 < tensors["output_ids"].shape[1] < 500
        assert not manager.kv_cache_manager.has_request(9)
        assert (
            manager.kv_cache_manager.get_num_free_blocks()
            == manager.kv_cache_manager.get_max_resource_count()
        )
    finally:
        manager.shutdown()


def test_stats_are_strict_json_with_seed_fields_and_not_sent_while_idle(tiny_model):
    client = ScriptedClient()
    with start(tiny_model, client) as manager:
        time.sleep(0.05)
        assert client.stats == []  # idle: no stats
        client.push(InferenceRequest.from_values(1, prompt(6), 5))
        client.wait_finals(1)
        time.sleep(0.05)
        num = len(client.stats)
        time.sleep(0.05)
        assert len(client.stats) == num  # idle again: no more stats
        assert manager.num_active_requests == 0
    records = [json.loads(s) for s in client.stats]
    assert num == 5  # one context iteration, then four generation iterations
    assert set(records[0]) >= SEED_STATS_FIELDS
    assert [r["Iteration Counter"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["Context Requests"] == 1 and records[0]["Total Context Tokens"] == 6
    assert records[1]["Generation Requests"] == 1
    time.strptime(records[0]["Timestamp"], "%m-%d-%Y %H:%M:%S")


def test_request_too_large_for_the_cache_errors_and_others_complete(tiny_model):
    client = ScriptedClient()
    with start(tiny_model, client, kv_cache={"max_tokens": 64, "tokens_per_block": 8}):
        client.push(
            InferenceRequest.from_values(1, prompt(8), 8),
            InferenceRequest.from_values(2, prompt(40), 40),  # 80 tokens: more than the whole cache
            InferenceRequest.from_values(3, prompt(8), 8),
        )
        client.wait_finals(3)
    assert "KV cache blocks" in client.finals_for(2)[0][1]
    assert client.finals_for(1)[0][1] == "" and client.finals_for(3)[0][1] == ""


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.5}, "temperature: -0.5 is out of range; allowed >= 0"),
        ({"runtime_top_k": -1}, "runtime_top_k: must be at least 0, got -1"),
        ({"runtime_top_p": 0.0}, "runtime_top_p: 0.0 is out of range; allowed (0, 1]"),
        ({"runtime_top_p": 1.5}, "runtime_top_p: 1.5 is out of range; allowed (0, 1]"),
        ({"beam_width": 2}, "beam_width: must be at most 1, got 2"),
        ({"lora_task_id": 3}, "lora_task_id: task 3 is not in the PEFT cache"),
        ({"end_id": 100000}, "end_id: must be at most"),
    ],
)
def test_invalid_request_fields_get_an_error_naming_the_field(tiny_model, fields, message):
    results = generate_or_fail(
        [InferenceRequest.from_values(1, prompt(4), 4, **fields)], make_config(), model=tiny_model
    )
    assert message in results[1].error
    assert results[1].finish_reason == FinishReason.ERROR


def test_malformed_tensors_are_rejected(tiny_model):
    bad = [
        InferenceRequest(1, {"input_ids": torch.tensor([[5, 6]])}),  # no request_output_len
        InferenceRequest(
            2, {"input_ids": torch.zeros(1, 0, dtype=torch.int32), "request_output_len": torch.tensor([[3]])}
        ),
        InferenceRequest(
            3, {"input_ids": torch.tensor([[5, 999]]), "request_output_len": torch.tensor([[3]])}
        ),
        InferenceRequest(4, {"input_ids": torch.tensor([[5]]), "request_output_len": torch.tensor([[0]])}),
        InferenceRequest(
            5,
            {
                "input_ids": torch.tensor([[5]]),
                "request_output_len": torch.tensor([[2]]),
                "foo": torch.tensor([1]),
            },
        ),
    ]
    results = generate_or_fail(bad, make_config(), model=tiny_model)
    assert "missing mandatory input tensor 'request_output_len'" in results[1].error
    assert "prompt is empty" in results[2].error
    assert "outside the vocabulary" in results[3].error
    assert "request_output_len: must be at least 1, got 0" in results[4].error
    assert "unknown input tensor 'foo'" in results[5].error


def test_prompt_longer_than_model_maximum_is_rejected(tiny_model):
    results = generate_or_fail(
        [InferenceRequest.from_values(1, prompt(3000), 2)],
        make_config(kv_cache={"max_tokens": 8192}, engine={"max_num_tokens": 4096}),
        model=tiny_model,
    )
    assert "longer than the model's maximum of 2048" in results[1].error


def test_streaming_yields_the_non_streamed_tokens_one_step_at_a_time(tiny_model):
    client = ScriptedClient()
    with start(tiny_model, client):
        client.push(
            InferenceRequest.from_values(1, prompt(9), 12, streaming=True),
            InferenceRequest.from_values(2, prompt(9), 12),
        )
        client.wait_finals(2)
    streamed = [t for rid, t, f, e in client.responses if rid == 1]
    assert len(streamed) == 12 and all(t["output_ids"].shape == (1, 1) for t in streamed)
    assert [t["output_ids"][0, 0].item() for t in streamed] == client.finals_for(2)[0][0]["output_ids"][
        0
    ].tolist()
    assert [f for rid, t, f, e in client.responses if rid == 1] == [False] * 11 + [True]


def test_sampling_with_a_seed_is_reproducible_and_independent_of_the_batch(tiny_model):
    fields = {"temperature": 0.9, "runtime_top_p": 0.95, "runtime_top_k": 50, "random_seed": 1234}
    alone = generate_or_fail(
        [InferenceRequest.from_values(1, prompt(7), 20, **fields)], make_config(), model=tiny_model
    )
    crowd = [InferenceRequest.from_values(1, prompt(7), 20, **fields)] + [
        InferenceRequest.from_values(i, prompt(5 + i, i), 15, temperature=1.0, random_seed=i)
        for i in range(2, 9)
    ]
    batched = generate_or_fail(crowd, make_config(), model=tiny_model)
    assert alone[1].output_ids == batched[1].output_ids
    other_seed = generate_or_fail(
        [InferenceRequest.from_values(1, prompt(7), 20, **{**fields, "random_seed": 99})],
        make_config(),
        model=tiny_model,
    )
    assert other_seed[1].output_ids != alone[1].output_ids


def test_shutdown_with_cancel_ends_every_active_request(tiny_model):
    client = ScriptedClient()
    manager = start(tiny_model, client, kv_cache={"max_tokens": 8192})
    client.push(*[InferenceRequest.from_values(i, prompt(6, i), 1500) for i in range(4)])
    wait_until(
        lambda: manager.kv_cache_manager.num_requests >= 4,
        lambda: f"{manager.kv_cache_manager.num_requests} of requests 0-3 hold blocks",
    )
    manager.shutdown(cancel=True)
    assert not manager.is_alive()
    reasons = [client.finals_for(i)[0][0]["finish_reason"].item() for i in range(4)]
    assert reasons == [int(FinishReason.CANCELLED)] * 4


def test_get_requests_is_told_how_many_it_may_return(tiny_model):
    client = ScriptedClient()
    asked: list[int] = []
    original = client.get_requests

    def spy(max_new: int):
        asked.append(max_new)
        return original(max_new)

    client.get_requests = spy  # type: ignore[method-assign]
    with start(tiny_model, client, engine={"max_batch_size": 2}):
        client.push(*[InferenceRequest.from_values(i, prompt(4, i), 3) for i in range(5)])
        client.wait_finals(5)
    assert max(asked) == 2 and min(asked) == 0


def test_an_object_that_is_not_a_request_fails_alone_and_its_neighbours_complete(tiny_model, tiny_reference):
    client = ScriptedClient()
    with start(tiny_model, client):
        client.push(
            {"request_id": 7, "input_ids": [5, 6]}, object(), InferenceRequest.from_values(8, prompt(6), 4)
        )
        client.wait_finals(2, timeout=HANG_S)
    ((_, error),) = client.finals_for(7)
    assert "request 7" in error or "dict" in error, error
    ((tensors, error8),) = client.finals_for(8)
    assert error8 == ""
    assert tensors["output_ids"][0].tolist() == hf_greedy(tiny_reference, prompt(6), 4)


def test_a_raising_logits_post_processor_ends_only_its_own_request(tiny_model, tiny_reference):
    def broken(request_id, logits, tokens):
        raise RuntimeError("user bug")

    bad = InferenceRequest(
        1,
        {
            "input_ids": torch.tensor([prompt(5)], dtype=torch.int32),
            "request_output_len": torch.tensor([[4]], dtype=torch.int32),
        },
        logits_post_processor=broken,
    )
    good = InferenceRequest.from_values(2, prompt(7, 3), 5)
    client = ScriptedClient()
    with start(tiny_model, client):
        client.push(bad, good)
        client.wait_finals(2, timeout=HANG_S)
    ((tensors1, error1),) = client.finals_for(1)
    assert "logits_post_processor failed" in error1 and "user bug" in error1
    assert tensors1["finish_reason"].tolist() == [int(FinishReason.ERROR)]
    ((tensors2, error2),) = client.finals_for(2)
    assert error2 == ""
    assert tensors2["output_ids"][0].tolist() == hf_greedy(tiny_reference, prompt(7, 3), 5)


def test_generate_past_its_timeout_stops_the_engine_and_names_the_unfinished_requests():
    """A request the engine has not finished by the timeout is named in the error (a scheduling bug shows
    up as one that never runs), and the engine is stopped rather than left running."""
    from bm.batch_manager import generate
    from bm.engine.execution.fake_executor import FakeExecutor
    from bm.engine.requests.request import Request

    config = make_config(
        engine={"max_batch_size": 2, "max_seq_len": 200_000}, kv_cache={"max_tokens": 200_064}
    )
    with pytest.raises(
        TimeoutError, match=r"requests \[0\] got no final response within 0 s \(0 of 1 finished\)"
    ):
        generate([Request(0, [5, 6, 7], 100_000)], config, executor=FakeExecutor(64), timeout=0)
