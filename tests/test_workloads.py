"""Every dataset format parses from a small fixture written here; bad input names the row and the field."""

from __future__ import annotations

import json

import pytest

from bm.config import ConfigError, config_from_dict
from bm.workloads import DatasetError, detect_kind, load_workload
from tests.conftest import REPO

VOCAB = 100


def encode(text: str) -> list[int]:
    """One token per word: token counts a reader can check by eye."""
    return [len(word) % VOCAB for word in text.split()]


def load(path=None, **values):
    bench = config_from_dict({"bench": {"dataset": str(path) if path else None, **values}}).bench
    return load_workload(bench, vocab_size=VOCAB, encode=encode)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_bm_jsonl_with_text_ids_output_aliases_arrival_times_and_fields(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "prompt": "one two three", "max_tokens": 4, "arrival_time": 0.0},
            {"input_ids": [5, 6], "request_output_len": 2, "temperature": 0.5, "arrival_time": 1.5},
            {"prompt": "no length given", "arrival_time": 2.0},
        ],
    )
    w = load(path, output_len=7)
    assert w.kind == "bm" and [r.ok for r in w.requests] == [True] * 3
    a, b, c = w.requests
    assert a.user_id == "a" and a.input_ids == encode("one two three") and a.max_tokens == 4
    assert b.input_ids == [5, 6] and b.max_tokens == 2 and b.fields == {"temperature": 0.5}
    assert c.max_tokens == 7 and [r.arrival_time for r in w.requests] == [0.0, 1.5, 2.0]


def test_bm_jsonl_bad_rows_keep_their_place_with_an_error_naming_line_and_field(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "fine", "max_tokens": 2},
            '{"prompt": ',
            {"max_tokens": 3},
            {"prompt": "x", "max_tokens": 0},
            {"input_ids": [1, 2], "output_tokens": -4},
        ],
    )
    w = load(path)
    errors = [r.error for r in w.requests]
    assert errors[0] is None
    assert errors[1].startswith("line 2: malformed JSON")
    assert errors[2].startswith("line 3: missing prompt: give 'prompt'")
    assert errors[3] == "line 4: max_tokens: must be at least 1, got 0"
    assert errors[4] == "line 5: output_tokens: must be at least 1, got -4"


def test_trtllm_bench_jsonl(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"task_id": 0, "input_ids": [7, 8, 9], "output_tokens": 5},
            {"task_id": 1, "prompt": "hello there", "output_tokens": 3},
            {"task_id": 2, "input_ids": [1]},
        ],
    )
    assert detect_kind(path) == "trtllm"
    w = load(path)
    a, b, c = w.requests
    assert (a.user_id, a.input_ids, a.max_tokens) == (0, [7, 8, 9], 5)
    assert b.input_ids == encode("hello there") and b.max_tokens == 3
    assert c.error.startswith("line 3: missing field 'output_tokens'")


def test_sharegpt_first_turn_is_the_prompt_second_turn_gives_the_output_length(tmp_path):
    data = [
        {
            "id": "x",
            "conversations": [
                {"from": "human", "value": "hi there you"},
                {"from": "gpt", "value": "a b c d"},
            ],
        },
        {"id": "y", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "z", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    assert detect_kind(path) == "sharegpt"
    w = load(path)
    assert w.num_skipped == 1 and len(w.requests) == 2
    first, bad = w.requests
    assert first.user_id == "x" and first.input_ids == encode("hi there you") and first.max_tokens == 4
    assert bad.error == "entry 2: conversations[1].value: the text is empty"


def test_text_datasets_need_a_tokenizer(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "words here"}])
    bench = config_from_dict({"bench": {"dataset": str(path)}}).bench
    with pytest.raises(DatasetError, match="no tokenizer"):
        load_workload(bench, vocab_size=VOCAB, encode=None)


AZURE = (
    "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\r\n"
    "2023-11-16 18:15:46.6805900,374,44\r\n"
    "2023-11-16 18:15:47.1805900,40,0\r\n"
    "2023-11-16 18:15:48.6805900,80,12\r\n"
)


def test_azure_trace_with_bom_and_crlf_gets_synthetic_ids_of_the_given_lengths(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_bytes(AZURE.encode())
    assert detect_kind(path) == "azure"
    w = load(path, trace_timestamps=True)
    a, bad, c = w.requests
    assert a.input_len == len(a.input_ids) == 374 and a.max_tokens == 44
    assert all(3 <= t < VOCAB for t in a.input_ids)
    assert bad.error == "line 3: GeneratedTokens: must be at least 1, got 0"
    assert [r.arrival_time for r in w.requests] == pytest.approx([0.0, 0.5, 2.0])
    assert c.input_len == 80
    again = load(path, trace_timestamps=True)
    assert again.requests[0].input_ids == a.input_ids  # same seed, same tokens


def test_azure_missing_column_names_it(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n")
    with pytest.raises(DatasetError, match="missing column 'GeneratedTokens'"):
        load(path, dataset_kind="azure")


def test_out_of_order_timestamps_are_refused_naming_the_row(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46,3,3\n2023-11-16 18:15:49,3,3\n2023-11-16 18:15:47,3,3\n"
    )
    with pytest.raises(DatasetError, match=r"line 4: timestamp goes backwards .* line 3"):
        load(path, trace_timestamps=True)
    assert len(load(path).requests) == 3  # without --trace-timestamps the order does not matter


def test_mooncake_trace_equal_hash_ids_share_prefix_tokens(tmp_path):
    path = write_jsonl(
        tmp_path / "mooncake.jsonl",
        [
            {"timestamp": 1000, "input_length": 10, "output_length": 2, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": 9, "output_length": 3, "hash_ids": [0, 1, 7]},
            {"timestamp": 3000, "input_length": 0, "output_length": 3},
        ],
    )
    assert detect_kind(path) == "mooncake"
    w = load(path, hash_block_size=4, trace_timestamps=True)
    a, b, bad = w.requests
    assert [r.arrival_time for r in w.requests] == pytest.approx([0.0, 0.5, 2.0])  # ms, from the first row
    assert len(a.input_ids) == 10 and len(b.input_ids) == 9
    assert a.input_ids[:8] == b.input_ids[:8]  # blocks 0 and 1 are shared
    assert bad.error == "line 3: input_length: must be at least 1, got 0"


def test_mooncake_csv_and_missing_timestamp(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text('timestamp,input_length,output_length,hash_ids\n0,4,2,"[3]"\n250,4,2,"[3]"\n')
    w = load(path, hash_block_size=4)
    assert w.kind == "mooncake" and w.requests[0].input_ids == w.requests[1].input_ids
    missing = write_jsonl(tmp_path / "m.jsonl", [{"input_length": 3, "output_length": 2, "hash_ids": []}])
    with pytest.raises(DatasetError, match="line 1: missing field 'timestamp'"):
        load(missing)


def test_hf_dataset_from_a_local_file_and_a_saved_directory(tmp_path):
    rows = [{"question": "what is this", "answer": "a b"}, {"question": "why", "answer": "c"}]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    w = load(path, dataset_kind="hf", prompt_column="question", output_column="answer")
    assert [r.input_ids for r in w.requests] == [encode("what is this"), encode("why")]
    assert [r.max_tokens for r in w.requests] == [2, 1]
    with pytest.raises(DatasetError, match="no column 'prompt'"):
        load(path, dataset_kind="hf")

    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"ids": [4, 5, 6], "n": 3}, {"ids": [7], "n": 0}]).save_to_disk(str(saved))
    assert detect_kind(saved) == "hf"
    w = load(saved, prompt_column="ids", output_column="n")
    assert w.requests[0].input_ids == [4, 5, 6] and w.requests[0].max_tokens == 3
    assert w.requests[1].error == "row 1: n: must be at least 1, got 0"


def test_synthetic_lengths_stay_in_range_and_prefix_groups_share_their_prefix():
    w = load(
        dataset_kind="synthetic",
        num_requests=40,
        input_len=20,
        output_len=10,
        range_ratio=0.5,
        prefix_len=6,
        num_prefix_groups=2,
        seed=3,
    )
    assert len(w.requests) == 40
    for i, r in enumerate(w.requests):
        assert 6 + 10 <= r.input_len <= 6 + 30 and 5 <= r.max_tokens <= 15
        assert r.input_ids[:6] == w.requests[i % 2].input_ids[:6]
    assert w.requests[0].input_ids[:6] != w.requests[1].input_ids[:6]
    fixed = load(dataset_kind="synthetic", num_requests=3, input_len=8, output_len=4)
    assert [(r.input_len, r.max_tokens) for r in fixed.requests] == [(8, 4)] * 3


def test_scaling_caps_num_requests_and_seeded_shuffle(tmp_path):
    rows = [{"id": i, "input_ids": list(range(1, 11)), "max_tokens": 8} for i in range(6)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    w = load(path, input_scale=0.25, output_scale=2.0, max_output_len=12, num_requests=4)
    assert len(w.requests) == 4
    assert [r.input_ids for r in w.requests] == [[1, 2]] * 4 and [r.max_tokens for r in w.requests] == [
        12
    ] * 4
    grown = load(path, input_scale=1.5, max_input_len=14)
    assert grown.requests[0].input_ids == [*range(1, 11), 1, 2, 3, 4]  # repeated, then capped
    order = [r.user_id for r in load(path, shuffle=True, seed=5).requests]
    assert sorted(order) == list(range(6)) and order != list(range(6))
    assert order == [r.user_id for r in load(path, shuffle=True, seed=5).requests]


def test_unknown_kind_and_undetectable_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"bench\.dataset_kind"):
        config_from_dict({"bench": {"dataset_kind": "parquetish"}})
    path = tmp_path / "data.txt"
    path.write_text("hello\n")
    with pytest.raises(DatasetError, match="--dataset-kind"):
        load(path)
    with pytest.raises(DatasetError, match="does not exist"):
        load(tmp_path / "missing.jsonl")


def test_trace_timestamps_on_a_dataset_without_them_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [1], "max_tokens": 1}])
    with pytest.raises(DatasetError, match="line 1: no arrival_time"):
        load(path, trace_timestamps=True)


@pytest.mark.parametrize(
    ("name", "kind", "extra"),
    [
        ("bm-timed.jsonl", "bm", {"trace_timestamps": True}),
        ("trtllm.jsonl", "trtllm", {}),
        ("sharegpt.json", "sharegpt", {}),
        ("azure-sample.csv", "azure", {"trace_timestamps": True}),
        ("mooncake.jsonl", "mooncake", {"trace_timestamps": True}),
        ("hf-qa.jsonl", "hf", {"dataset_kind": "hf", "prompt_column": "question", "output_column": "answer"}),
    ],
)
def test_every_shipped_sample_loads_without_a_bad_row(name, kind, extra):
    w = load(REPO / "datasets" / "bench" / name, **extra)
    assert w.kind == kind and len(w.requests) >= 10
    assert all(r.ok and r.input_ids and r.max_tokens >= 1 for r in w.requests), [r.error for r in w.requests]
