"""The library's mapping from vLLM's names to bm's, listed once here: each vLLM name is accepted and lands
on the bm engine field or config key it names, and a run vLLM accepts is accepted as written."""

from __future__ import annotations

import dataclasses

import pytest

import bm
from bm.config.vllm import VLLM_UNSUPPORTED
from bm.llm_config import ENGINE_ARGS, OWN_ARGS, build_config
from bm.llm_params import OUTPUT_FIELDS, SAMPLING_FIELDS, VLLM_SAMPLING_ONLY

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
    # the prompt's logits, made log probs by LLM; refused beside enable_prefix_caching=True, whose cached
    # positions are never computed (test_llm_contract.py)
    "prompt_logprobs": (3, "return_context_logits", True),
}

# vLLM SamplingParams names that set no engine field: they shape what LLM returns (test_llm_contract.py
# pins each): a value bm honours, and one it refuses with the message's start.
OUTPUT = {
    "best_of": (1, 2, "best_of: 2 > n (1) is not supported"),  # bm returns every sample it draws
    "skip_special_tokens": (True, "no", "skip_special_tokens: expected true or false"),
    "spaces_between_special_tokens": (False, 1, "spaces_between_special_tokens: expected true or false"),
    "include_stop_str_in_output": (True, None, "include_stop_str_in_output: expected true or false"),
}

# vLLM SamplingParams names bm has no counterpart for: (a value that asks for what bm does anyway,
# accepted; a value that asks for more, refused naming the bm way).
SAMPLING_ONLY = {
    "logits_processors": (None, [print], "logit_bias, bad_words, min_tokens or structured_outputs"),
    "allowed_token_ids": (None, [5, 6], "structured_outputs"),
    "truncate_prompt_tokens": (None, 8, "get_tokenizer().encode(text)[-N:]"),
    "detokenize": (True, False, "read token_ids"),
    "use_beam_search": (False, True, "llm.beam_search(prompts, BeamSearchParams("),
    "length_penalty": (1.0, 0.8, "BeamSearchParams(beam_width=..., max_tokens=..., length_penalty="),
    "extra_args": (None, {"x": 1}, "drop it"),
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
    # ./ : a path, not a hub id org/name (which the config looks up in the local Hugging Face cache)
    "tokenizer": ("./some/dir", "model.tokenizer", "./some/dir"),
    "block_size": (16, "kv_cache.tokens_per_block", 16),
    "kv_cache_dtype": ("fp8", "kv_cache.dtype", "fp8_e4m3"),  # vLLM's fp8 is e4m3
    "quantization": ("int8", "model.quantization", "int8"),
    "enforce_eager": (True, "model.cuda_graphs", "off"),
}
# vLLM LLM(...) keywords LLM reads itself: seed seeds sampling (test_llm_contract.py), and
# tensor_parallel_size must be the ranks this one process runs in (1), since LLM starts none.
OWN = {
    "seed": 3,
    "tensor_parallel_size": 1,
    "enable_lora": True,
    "max_loras": 2,  # peft_cache.max_adapters
    "max_lora_rank": 8,
    "generation_config": "vllm",
}
# model_config=PATH (a config JSON, random weights) is pinned in test_llm_vllm_types.py.

# vLLM LLM(...) keywords bm has no knob for: (a value that asks for what bm does anyway, accepted; a
# value that asks for more, refused naming the bm way).
ENGINE_ONLY = {
    "trust_remote_code": (False, True, "runs no code from a checkpoint"),
    "pipeline_parallel_size": (1, 2, "bm run --tensor-parallel N"),
    "swap_space": (0, 4, "'scheduler_policy': 'max_utilization'"),
    "cpu_offload_gb": (0, 2, "kv_cache={'max_tokens': N}"),
    "download_dir": (None, "/tmp/hub", "model=DIR"),
    "revision": (None, "main", "model=DIR"),
    "tokenizer_revision": (None, "main", "tokenizer=DIR"),
    "load_format": ("safetensors", "gguf", "model=DIR"),
    "tokenizer_mode": ("auto", "mistral", "drop it"),
    "skip_tokenizer_init": (False, True, "lists of token ids"),
    "scheduling_policy": ("fcfs", "priority", "engine={'scheduler_policy': NAME}"),
    "speculative_config": (None, {"method": "ngram"}, "engine={'speculative'"),
}


def test_the_sampling_mapping_is_the_one_the_library_uses_and_each_name_lands_on_its_engine_field():
    assert {name: field for name, (_v, field, _w) in SAMPLING.items()} == SAMPLING_FIELDS
    # every parameter of SamplingParams is a vLLM name listed here: on an engine field or on the output
    assert (
        {f.name for f in dataclasses.fields(bm.SamplingParams)}
        == set(SAMPLING) | set(OUTPUT)
        == set(SAMPLING_FIELDS) | set(OUTPUT_FIELDS)
    )
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


def test_the_output_names_take_the_values_bm_honours_and_refuse_the_rest_naming_the_field():
    for name, (honoured, refused, message) in OUTPUT.items():
        assert getattr(bm.SamplingParams(**{name: honoured}), name) == honoured
        with pytest.raises(bm.InvalidParameterError) as raised:
            bm.SamplingParams(**{name: refused})
        assert str(raised.value).startswith(f"SamplingParams.{message}"), raised.value


def test_an_unknown_sampling_keyword_raises_a_value_error_naming_it_and_the_nearest_name():
    """Issue 41: a mistyped SamplingParams keyword raised TypeError, unlike every other bad parameter."""
    with pytest.raises(
        bm.InvalidParameterError,
        match=r"SamplingParams\(temprature=...\): unknown parameter; did you mean 'temperature'\?",
    ):
        bm.SamplingParams(temprature=0.5)
    with pytest.raises(ValueError, match="did you mean 'max_tokens'"):
        bm.SamplingParams(max_token=5)
    with pytest.raises(
        bm.InvalidParameterError, match=r"StructuredOutputsParams\(regexp=...\).*did you mean 'regex'"
    ):
        bm.StructuredOutputsParams(regexp="[a-z]+")


def test_a_vllm_sampling_name_bm_lacks_is_refused_with_the_bm_way_unless_it_asks_for_what_bm_does():
    assert set(SAMPLING_ONLY) == set(VLLM_SAMPLING_ONLY)
    for name, (inert, refused, fix) in SAMPLING_ONLY.items():
        assert bm.SamplingParams(max_tokens=3, **{name: inert}) == bm.SamplingParams(max_tokens=3), name
        with pytest.raises(bm.InvalidParameterError) as raised:
            bm.SamplingParams(**{name: refused})
        message = str(raised.value)
        assert message.startswith(f"SamplingParams({name}={refused!r}): a vLLM parameter bm does not take")
        assert fix in message, message
    # the backend vLLM calls 'guidance' is llguidance, bm's: accepted; another is refused
    assert bm.StructuredOutputsParams(regex="a", backend="guidance").spec() == {"regex": "a"}
    with pytest.raises(bm.InvalidParameterError, match="llguidance"):
        bm.StructuredOutputsParams(regex="a", backend="xgrammar")


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
    assert set(OWN) | {"model_config"} == set(OWN_ARGS)
    llm = bm.LLM("tiny-random", device="cpu", **OWN)
    assert llm.seed == 3 and llm.config.peft_cache.max_adapters == 2
    assert llm.options.enable_lora and llm.options.max_lora_rank == 8
    assert llm.options.generation_config == "vllm"


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


def test_a_vllm_engine_argument_bm_lacks_is_refused_with_the_bm_way_unless_it_asks_for_what_bm_does(
    no_model_load,
):
    assert set(ENGINE_ONLY) == set(VLLM_UNSUPPORTED)
    plain = build_config("tiny-random", None, {})
    for name, (inert, refused, fix) in ENGINE_ONLY.items():
        assert build_config("tiny-random", None, {name: inert}) == plain, name  # nothing to set
        with pytest.raises(bm.InvalidParameterError) as raised:
            bm.LLM("tiny-random", **{name: refused})
        message = str(raised.value)
        assert message.startswith(f"LLM({name}={refused!r}): a vLLM parameter bm does not take"), message
        assert fix in message, message


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
        trust_remote_code=False,
        quantization=None,
        swap_space=0,
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
        best_of=2,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        include_stop_str_in_output=False,
        detokenize=True,
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
