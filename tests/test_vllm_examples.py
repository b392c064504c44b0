"""vLLM's offline examples, run as a vLLM user writes them with only the import renamed.

Each example below follows the shape of one of vLLM's offline-inference examples (basic generation,
batched chat, several samples per prompt, log probs, structured outputs, beam search, LoRA, token
prompts), written here for a tiny random-weight checkpoint this module saves with its own tokenizer and
chat template. Outputs are checked for vLLM's shape, and greedy ones token for token against HF
``generate()`` on the same request alone (the project's oracle)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from bm import (
    LLM,
    BeamSearchParams,
    GuidedDecodingParams,
    LoRARequest,
    SamplingParams,
    TokensPrompt,
)
from tests.conftest import hf_generate, hf_greedy, reference_model

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    """A checkpoint directory as vLLM would be pointed at: config, safetensors, a tokenizer with a chat
    template (byte-level, one id per byte, filling the model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # byte-level BPE without merges: 3 special tokens and one id per byte fill the model's 259 ids
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab |= {ch: 3 + i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    assert len(vocab) == tiny_model.vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    fast.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("vllm_example_model")
    reference_model(tiny_model).save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, device="cpu", enable_lora=True)


@pytest.fixture(scope="module")
def reference(llm):
    return reference_model(llm.loaded)


def hf_tokens(reference, llm, prompt_ids, max_tokens):
    """HF greedy generate() on one prompt, stopping at the model's end token as bm does by default."""
    return hf_greedy(reference, prompt_ids, max_tokens, end_id=llm.loaded.eos_token_id)


def test_basic_generation(llm, reference):
    prompts = [
        "Hello, my name is",
        "The largest planet is",
        "Water boils at",
        "My favourite colour is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt == prompt
        generated_text = output.outputs[0].text
        assert isinstance(generated_text, str) and 1 <= len(output.outputs[0].token_ids) <= 16

    greedy = SamplingParams(temperature=0, max_tokens=12)
    outputs = llm.generate(prompts, greedy)
    tokenizer = llm.get_tokenizer()
    for output in outputs:
        assert output.prompt_token_ids == tokenizer.encode(output.prompt)
        assert output.outputs[0].token_ids == hf_tokens(reference, llm, output.prompt_token_ids, 12)


def test_batched_chat(llm, reference):
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a short line about the sea."},
    ]
    conversations = [conversation for _ in range(4)]
    sampling_params = SamplingParams(temperature=0, max_tokens=10)
    outputs = llm.chat(conversations, sampling_params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert len(outputs) == 4
    for output in outputs:
        assert output.prompt == rendered and output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == hf_tokens(reference, llm, ids, 10)


def test_n_samples_per_prompt(llm):
    prompts = ["Once upon a time", "In a galaxy far away"]
    sampling_params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=8, seed=42)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        assert len(output.outputs) == 3
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    again = llm.generate(prompts, sampling_params)
    assert [[c.token_ids for c in o.outputs] for o in again] == [
        [c.token_ids for c in o.outputs] for o in outputs
    ]


def test_log_probs(llm, reference):
    prompts = ["The quick brown fox"]
    sampling_params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1)
    outputs = llm.generate(prompts, sampling_params)
    output = outputs[0]
    completion = output.outputs[0]
    assert completion.token_ids == hf_tokens(reference, llm, output.prompt_token_ids, 6)
    assert len(completion.logprobs) == len(completion.token_ids)
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert position[token_id].rank == 1  # greedy: the chosen token is the most likely
        assert len(position) == 2 and all(lp.rank is not None for lp in position.values())
        assert all(lp.decoded_token is not None for lp in position.values())
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(output.prompt_token_ids)
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs, strict=True)), abs=1e-4
    )


def test_structured_outputs(llm):
    pytest.importorskip("llguidance")
    guided_decoding_params = GuidedDecodingParams(choice=["Positive", "Negative"])
    sampling_params = SamplingParams(guided_decoding=guided_decoding_params)
    outputs = llm.generate(
        prompts="Classify this sentiment: bm is wonderful!", sampling_params=sampling_params
    )
    assert outputs[0].outputs[0].text in ("Positive", "Negative")

    regex = GuidedDecodingParams(regex=r"[a-z]{3,8}@[a-z]{3,6}\.com\n")
    sampling_params = SamplingParams(guided_decoding=regex, stop=["\n"], max_tokens=30)
    outputs = llm.generate("Write an email address: ", sampling_params)
    assert re.fullmatch(r"[a-z]{3,8}@[a-z]{3,6}\.com", outputs[0].outputs[0].text)


def test_beam_search(llm, reference):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    outputs = llm.beam_search([{"prompt": "The sky is"}, {"prompt": "Rivers flow"}], params)
    tokenizer = llm.get_tokenizer()
    for output, text in zip(outputs, ["The sky is", "Rivers flow"], strict=True):
        assert len(output.sequences) == 3
        ids = tokenizer.encode(text)
        hf = hf_generate(
            reference, ids, 8, num_beams=3, num_return_sequences=3, eos_token_id=llm.loaded.eos_token_id
        )
        eos = llm.loaded.eos_token_id
        for sequence, hf_ids in zip(output.sequences, hf.tolist(), strict=True):
            beam = hf_ids[len(ids) :]
            beam = beam[: beam.index(eos) + 1] if eos in beam else beam  # HF pads beams that ended early
            assert sequence.tokens == ids + beam
            assert sequence.text == tokenizer.decode(sequence.tokens, skip_special_tokens=True)
            assert sequence.finish_reason == ("stop" if beam[-1] == eos else "length")
    written = llm.beam_search(
        [{"prompt": "Hi"}], BeamSearchParams(beam_width=2, max_tokens=4, skip_special_tokens=False)
    )
    for sequence in written[0].sequences:
        assert sequence.text == tokenizer.decode(sequence.tokens, skip_special_tokens=False)


@pytest.fixture(scope="module")
def lora_path(llm, tmp_path_factory):
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(reference_model(llm.loaded)), config)
    folder = tmp_path_factory.mktemp("sql_lora")
    model.save_pretrained(folder)
    return str(folder), model.eval()


def test_lora(llm, lora_path):
    path, peft_model = lora_path
    sampling_params = SamplingParams(temperature=0, max_tokens=10, logprobs=1, prompt_logprobs=1)
    prompts = ["[user] Write a query for the table: ", "[user] Count the rows: "]
    outputs = llm.generate(prompts, sampling_params, lora_request=LoRARequest("sql-lora", 1, path))
    for output in outputs:
        want = hf_greedy(peft_model, output.prompt_token_ids, 10, end_id=llm.loaded.eos_token_id)
        assert output.outputs[0].token_ids == want
        assert output.lora_request.lora_name == "sql-lora"


def test_token_prompts(llm, reference):
    prompt_token_ids = [[6, 40, 73, 80], [9, 10, 11, 12, 13]]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for ids, output in zip(prompt_token_ids, outputs, strict=True):
        assert output.prompt is None and output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == hf_tokens(reference, llm, ids, 8)
