"""The library's mapping from vLLM's names to bm's, listed once here: each vLLM name is accepted and lands
on the bm engine field or config key it names, and a run vLLM accepts is accepted as written."""

from __future__ import annotations

import pytest

import bm
from bm.llm_config import ENGINE_ARGS, OWN_ARGS, build_config
from bm.llm_params import SAMPLING_FIELDS

# vLLM SamplingParams name: (a value vLLM accepts, the bm engine request field, the value it gets there)
SAMPLING = {
    "n": (4, "num_return_sequences", 4),
    "max_tokens": (7, "request_output_len", 7),
    "temperature": (0.7, "temperature", 0.7),
    "top_p": (0.9, "runtime_top_p", 0.9),
    "top_k": (40, "runtime_top_k", 40),
    "min_p": (0.05, "min_p", 0.05),
    "seed": (1234, "random_seed", 1234),
    "stop": (["ab"], "stop_words_list", [[100, 101]]),  # the byte tokenizer's ids of "ab"
    "stop_token_ids": ([7], "stop_words_list", [[7]]),
    "bad_words": (["c"], "bad_words_list", [[102]]),
    "ignore_eos": (True, "end_id", None),  # no end token: set on the request by LLM, see below
    "min_tokens": (3, "min_length", 3),
    "repetition_penalty": (1.1, "repetition_penalty", 1.1),
    "presence_penalty": (0.5, "presence_penalty", 0.5),
    "frequency_penalty": (0.25, "frequency_penalty", 0.25),
    "logprobs": (5, "top_logprobs", 5),
    "logit_bias": ({"9": -5}, "logit_bias", {9: -5.0}),
    "structured_outputs": ({"choice": ["yes", "no"]}, "guided_decoding", ("choice", '["yes", "no"]')),
    "guided_decoding": ({"regex": "[a-z]+"}, "guided_decoding", ("regex", "[a-z]+")),
    "response_format": ({"type": "json_object"}, "guided_decoding", ("json_object", "")),
}

# vLLM LLM(...) keyword: (a value vLLM accepts, the bm config key, the value it gets there)
ENGINE = {
    "max_model_len": (512, "engine.max_seq_len", 512),
    "gpu_memory_utilization": (0.5, "kv_cache.free_memory_fraction", 0.5),
    "dtype": ("bfloat16", "model.dtype", "bfloat16"),
    "max_num_seqs": (8, "engine.max_batch_size", 8),
    "max_num_batched_tokens": (1024, "engine.max_num_tokens", 1024),
    "enable_prefix_caching": (True, "kv_cache.enable_block_reuse", True),
    "enable_chunked_prefill": (True, "engine.enable_chunked_context", True),
    "tokenizer": ("some/dir", "model.tokenizer", "some/dir"),
    "block_size": (16, "kv_cache.tokens_per_block", 16),
    "enforce_eager": (True, "model.cuda_graphs", "off"),
}
# vLLM LLM(...) keywords LLM reads itself: seed seeds sampling (test_llm_contract.py), and
# tensor_parallel_size must be the ranks this one process runs in (1), since LLM starts none.
OWN = {"seed": 3, "tensor_parallel_size": 1}


def test_the_sampling_mapping_is_the_one_the_library_uses_and_each_name_lands_on_its_engine_field():
    assert {name: field for name, (_v, field, _w) in SAMPLING.items()} == SAMPLING_FIELDS
    from bm.runtime.tokenizer import ByteTokenizer

    for name, (value, field, want) in SAMPLING.items():
        fields = bm.SamplingParams(**{name: value}).request_fields(ByteTokenizer().encode_word)
        if name == "ignore_eos":
            assert "end_id" not in fields  # the LLM leaves end_id unset: no end token
            continue
        got = fields[field]
        if field == "guided_decoding":
            got = (got.kind, got.text)
        if name == "logprobs":
            assert fields["return_log_probs"] is True
        assert got == want, name


def test_the_engine_argument_mapping_is_the_one_the_library_uses_and_each_lands_on_its_config_key():
    assert {name: key for name, (_v, key, _w) in ENGINE.items() if name != "enforce_eager"} == {
        name: key for name, key in ENGINE_ARGS.items() if key is not None
    }
    for name, (value, key, want) in ENGINE.items():
        config = build_config("tiny-random", None, {name: value})
        section, _, field = key.partition(".")
        assert getattr(getattr(config, section), field) == want, name
    # accepted with nothing to set: bm's bound on top log probs is OpenAI's 20
    assert ENGINE_ARGS["max_logprobs"] is None and build_config("tiny-random", None, {"max_logprobs": 20})


def test_a_bad_engine_argument_raises_naming_the_vllm_name_and_an_unknown_one_the_nearest():
    with pytest.raises(bm.InvalidParameterError, match=r"max_model_len \(engine.max_seq_len\): must be >= 1"):
        build_config("tiny-random", None, {"max_model_len": 0})
    with pytest.raises(bm.InvalidParameterError, match="did you mean 'max_model_len'"):
        bm.LLM("tiny-random", max_model_length=512)
    with pytest.raises(bm.InvalidParameterError, match="did you mean 'gpu_memory_utilization'"):
        bm.LLM("tiny-random", gpu_memory_utilisation=0.8)
    with pytest.raises(bm.InvalidParameterError, match="seed"):
        bm.LLM("tiny-random", seed=-3)
    assert issubclass(bm.InvalidParameterError, ValueError)


def test_the_names_llm_reads_itself_are_listed_and_accepted():
    assert set(OWN) == set(OWN_ARGS)
    llm = bm.LLM("tiny-random", device="cpu", **OWN)
    assert llm.seed == 3


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a model starts loading: a refused keyword must stop LLM before that."""
    import bm.runtime

    monkeypatch.setattr(bm.runtime, "load_model", lambda *a, **k: pytest.fail("a model loaded"))


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_size_above_one_is_refused_before_the_model_loads_naming_bm_run(no_model_load, size):
    """bm.LLM runs in one process and starts no ranks; a split model runs through bm run's ranks (its
    own, or torchrun's), as docs/parallel.md says."""
    with pytest.raises(bm.InvalidParameterError) as raised:
        bm.LLM("tiny-random", tensor_parallel_size=size)
    message = str(raised.value)
    assert message.startswith(f"LLM(tensor_parallel_size={size}): bm.LLM runs in this one process")
    assert f"bm run PROMPTS.jsonl --model MODEL --tensor-parallel {size}" in message
    assert f"torchrun --nproc-per-node {size} -m bm run" in message and "docs/parallel.md" in message
    with pytest.raises(bm.InvalidParameterError, match="expected an integer >= 1"):
        bm.LLM("tiny-random", tensor_parallel_size=0)


def test_a_run_vllm_accepts_is_accepted_as_written():
    """A vLLM script's LLM(...) and SamplingParams(...), every mapped name at once, runs unchanged."""
    llm = bm.LLM(
        model="tiny-random",
        max_model_len=256,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=1,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        block_size=16,
        enforce_eager=True,
        max_logprobs=20,
        seed=0,
        device="cpu",
    )
    assert llm.config.engine.max_seq_len == 256 and llm.config.engine.max_batch_size == 4
    assert llm.config.kv_cache.enable_block_reuse and llm.config.kv_cache.tokens_per_block == 16
    params = bm.SamplingParams(
        n=2,
        max_tokens=6,
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        min_p=0.01,
        seed=7,
        stop=["zz"],
        stop_token_ids=[2],
        bad_words=["q"],
        ignore_eos=False,
        min_tokens=1,
        repetition_penalty=1.05,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        logprobs=2,
        logit_bias={11: 1.5},
    )
    outs = llm.generate(["Hello, my name is", "The future of AI is"], params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello, my name is", "The future of AI is"]
    for out in outs:
        assert len(out.outputs) == 2
        for completion in out.outputs:
            assert 1 <= len(completion.token_ids) <= 6 and completion.finish_reason in ("stop", "length")
            assert len(completion.logprobs) == len(completion.token_ids)
            assert all(3 >= len(position) >= 2 for position in completion.logprobs)
            assert completion.cumulative_logprob <= 0
    assert llm.get_tokenizer() is not None
