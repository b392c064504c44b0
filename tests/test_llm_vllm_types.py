"""vLLM's types and keywords through bm.LLM: LoRA requests, prompt dicts, beam search, chat keywords,
dtype names, defaults, request ids and metrics; each refusal one InvalidParameterError naming the field.

Oracle: greedy tokens equal HF ``generate()`` on the same request alone (a PeftModel for an adapter,
``num_beams`` for beam search)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import bm
from bm.cpu_isa import cpu_features, native_bf16
from tests.conftest import hf_generate, hf_greedy, reference_model

KV = {"max_tokens": 4096, "tokens_per_block": 8}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm() -> bm.LLM:
    return bm.LLM(model="tiny-random", device="cpu", kv_cache=KV, enable_lora=True)


@pytest.fixture(scope="module")
def adapter(tiny_reference, tmp_path_factory):
    """A peft adapter with random non-zero weights, saved; (directory, PeftModel)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(7)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(tiny_reference), config)
    path = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(path)
    return path, model.eval()


def test_a_lora_request_gives_the_tokens_peft_generates_and_none_gives_the_base_models(llm, adapter):
    path, peft_model = adapter
    lora = bm.LoRARequest("sql", 1, str(path))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = bm.SamplingParams(max_tokens=6, **GREEDY)
    adapted = llm.generate(prompts, params, lora_request=lora)
    mixed = llm.generate(prompts, params, lora_request=[None, lora])
    base = reference_model(llm.loaded)
    for prompt, out in zip(prompts, adapted, strict=True):
        assert out.token_ids == hf_greedy(peft_model, prompt, 6) and out.lora_request == lora
    assert mixed[0].token_ids == hf_greedy(base, prompts[0], 6)
    assert mixed[1].token_ids == adapted[1].token_ids
    assert adapted[0].token_ids != mixed[0].token_ids  # the adapter changed the answer


def test_chat_takes_a_lora_request_too(llm, adapter):
    path, peft_model = adapter
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "abc"}]
    out = llm.chat(
        messages,
        bm.SamplingParams(max_tokens=4, **GREEDY),
        lora_request=bm.LoRARequest("a", 1, str(path)),
        chat_template=template,
    )[0]
    assert out.prompt == "abc"
    assert out.token_ids == hf_greedy(peft_model, llm.tokenizer.encode("abc"), 4)


def test_a_lora_request_without_enable_lora_is_refused_naming_the_flag(adapter):
    plain = bm.LLM(model="tiny-random", device="cpu", kv_cache=KV)
    with pytest.raises(bm.InvalidParameterError, match=r"LLM\(\.\.\., enable_lora=True\)"):
        plain.generate([[5, 6]], lora_request=bm.LoRARequest("a", 1, str(adapter[0])))


def test_lora_ids_paths_and_ranks_are_judged_as_vllm_judges_them(llm, adapter, tmp_path):
    path = str(adapter[0])
    with pytest.raises(bm.InvalidParameterError, match="lora_int_id: expected an integer >= 1"):
        bm.LoRARequest("a", 0, path)
    llm.generate([[5]], bm.SamplingParams(max_tokens=1), lora_request=bm.LoRARequest("a", 3, path))
    with pytest.raises(bm.InvalidParameterError, match="lora_int_id: 3 already names the adapter"):
        llm.generate([[5]], lora_request=bm.LoRARequest("b", 3, str(tmp_path)))
    with pytest.raises(
        bm.InvalidParameterError, match=r"LoRARequest.lora_path: .*adapter_config.json is missing"
    ):
        llm.generate([[5]], lora_request=bm.LoRARequest("b", 4, str(tmp_path)))
    narrow = bm.LLM(model="tiny-random", device="cpu", kv_cache=KV, enable_lora=True, max_lora_rank=2)
    with pytest.raises(bm.InvalidParameterError, match=r"rank 4, above LLM\(max_lora_rank=2\)"):
        narrow.generate([[5]], lora_request=bm.LoRARequest("a", 1, path))
    with pytest.raises(bm.InvalidParameterError, match="lora_request: 1 given for 2 prompts"):
        llm.generate([[5], [6]], lora_request=[bm.LoRARequest("a", 3, path)])


def test_text_and_token_prompts_as_classes_and_dicts_mix_in_one_list(llm):
    params = bm.SamplingParams(max_tokens=3, **GREEDY)
    ids = llm.tokenizer.encode("abc")
    outs = llm.generate(
        [bm.TextPrompt(prompt="abc"), {"prompt": "abc"}, bm.TokensPrompt(prompt_token_ids=ids), ids, "abc"],
        params,
    )
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["abc", "abc", None, None, "abc"]
    assert all(o.prompt_token_ids == ids for o in outs)
    with pytest.raises(bm.InvalidParameterError, match=r"prompt\['multi_modal_data'\]: bm runs text-only"):
        llm.generate({"prompt": "abc", "multi_modal_data": {"image": 1}})


def test_request_ids_are_strings_and_metrics_carry_the_engines_milestones_in_order(llm):
    outs = llm.generate([[5, 6], [7, 8]], bm.SamplingParams(max_tokens=2, **GREEDY))
    ids = [o.request_id for o in outs]
    assert all(isinstance(i, str) for i in ids) and int(ids[1]) == int(ids[0]) + 1
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    assert m.last_token_time == m.finished_time


@pytest.mark.parametrize(("beam_width", "length_penalty"), [(2, 1.0), (3, 0.5)])
def test_beam_search_returns_every_beam_as_hf_beam_search_does(llm, beam_width, length_penalty):
    prompt = [5, 17, 33, 9, 12]
    params = bm.BeamSearchParams(
        beam_width=beam_width, max_tokens=6, ignore_eos=True, length_penalty=length_penalty
    )
    [out] = llm.beam_search([bm.TokensPrompt(prompt_token_ids=prompt)], params)
    ref = reference_model(llm.loaded)
    hf = hf_generate(
        ref, prompt, 6, num_beams=beam_width, num_return_sequences=beam_width, length_penalty=length_penalty
    )
    assert [s.tokens for s in out.sequences] == hf.tolist()
    for seq in out.sequences:
        assert seq.text == llm.tokenizer.decode(seq.tokens)
        with torch.no_grad():  # each beam token's rank under the prefix it extended
            lps = ref(torch.tensor([seq.tokens])).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        for i, position in enumerate(seq.logprobs):
            ((token, lp),) = position.items()
            assert lp.rank == int((lps[i] > lps[i, token]).sum()) + 1
        assert seq.cum_logprob == pytest.approx(
            sum(lp.logprob for p in seq.logprobs for lp in p.values()), abs=1e-4
        )
    assert llm.config.engine.max_beam_width >= beam_width  # raised by the call itself


def test_use_beam_search_and_sampled_beams_point_to_llm_beam_search():
    with pytest.raises(bm.InvalidParameterError, match=r"llm\.beam_search\(prompts, BeamSearchParams\("):
        bm.SamplingParams(use_beam_search=True)
    with pytest.raises(
        bm.InvalidParameterError, match=r"BeamSearchParams.temperature: .*leave temperature at 0"
    ):
        bm.BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)


def test_chat_keywords_reach_the_template_and_prompt_holds_the_rendered_text(llm):
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if not loop.last or not continuing %}"
        "</{{ m['role'] }}>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
        "{% if shout %}!{% endif %}"
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    params = bm.SamplingParams(max_tokens=2, **GREEDY)
    opened = llm.chat(chat, params, chat_template=template, chat_template_kwargs={"shout": True})[0]
    assert opened.prompt == "<user>hi</user><assistant>yo</assistant><assistant>!"
    closed = llm.chat(chat, params, chat_template=template, add_generation_prompt=False)[0]
    assert closed.prompt == "<user>hi</user><assistant>yo</assistant>"
    continued = llm.chat(
        chat, params, chat_template=template, add_generation_prompt=False, continue_final_message=True
    )[0]
    assert continued.prompt == "<user>hi</user><assistant>yo"
    assert continued.prompt_token_ids == llm.tokenizer.encode(continued.prompt)
    with pytest.raises(bm.InvalidParameterError, match="add_generation_prompt=False with it"):
        llm.chat(chat, params, chat_template=template, continue_final_message=True)


@pytest.mark.parametrize(
    ("dtype", "runs_in"),
    [
        ("auto", torch.float32),
        ("float", torch.float32),
        ("float32", torch.float32),
        (torch.float32, torch.float32),
        ("half", torch.float16),
        ("float16", torch.float16),
        # a CPU without bf16 instructions runs it in float32 (bm.config.model.BF16_WITHOUT_CPU_SUPPORT)
        ("bfloat16", torch.float32 if native_bf16(cpu_features()) is False else torch.bfloat16),
    ],
)
def test_vllm_dtype_names_are_accepted(dtype, runs_in):
    llm = bm.LLM(model="tiny-random", device="cpu", kv_cache=KV, dtype=dtype)
    assert llm.loaded.dtype == runs_in
    assert len(llm.generate([[5, 6]], bm.SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_a_dtype_bm_cannot_run_is_refused_naming_the_ones_it_can():
    with pytest.raises(bm.InvalidParameterError, match=r"LLM\(dtype='float64'\): bm runs weights in float32"):
        bm.LLM(model="tiny-random", dtype="float64")


def test_model_as_a_mapping_sets_the_random_weights_seed_as_the_docs_say():
    a = bm.LLM(model={"preset": "tiny-random", "seed": 1}, device="cpu", kv_cache=KV)
    b = bm.LLM(model={"preset": "tiny-random", "seed": 2}, device="cpu", kv_cache=KV)
    wa, wb = (next(x.loaded.model.parameters()) for x in (a, b))
    assert a.config.model.seed == 1 and not torch.equal(wa, wb)


def test_model_config_builds_random_weights_from_a_config_json(tmp_path, tiny_model):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_model.model.config.to_dict()))
    llm = bm.LLM(model_config=str(path), device="cpu", kv_cache=KV)
    assert llm.config.model.config == str(path) and llm.loaded.vocab_size == tiny_model.vocab_size
    assert len(llm.generate([[5, 6]], bm.SamplingParams(max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda llm: llm.generate([[5]], use_tdqm=False), r"LLM.generate\(use_tdqm=...\): unknown parameter"),
        (lambda llm: llm.generate([[5]], priority=[1]), r"LLM.generate\(priority=\[1\]\): a vLLM parameter"),
        (
            lambda llm: llm.chat(
                [{"role": "user", "content": "a"}], chat_template="x", chat_template_kwargs=1
            ),
            r"LLM.chat\(chat_template_kwargs=...\): expected a mapping",
        ),
        (lambda llm: llm.beam_search([[5]], bm.SamplingParams()), r"expected bm.BeamSearchParams"),
        (
            lambda llm: llm.generate([[5]], bm.BeamSearchParams(beam_width=2, max_tokens=2)),
            r"llm.beam_search",
        ),
    ],
)
def test_every_bad_call_raises_invalid_parameter_error_naming_the_field(llm, call, message):
    with pytest.raises(bm.InvalidParameterError, match=message):
        call(llm)


# no controls: decoded on the logits' device; a multi-token bad word: decoded on the host (bm.runtime.decoding)
@pytest.mark.parametrize("controls", [{}, {"bad_words": ["~~"]}], ids=["device_path", "host_path"])
def test_every_returned_logprob_has_its_true_rank_even_outside_the_top_k(llm, controls):
    """A sampled token outside the top 1 gets its rank in the whole vocabulary, counted from the same
    distribution its log probability comes from (temperature 1: the model's log softmax)."""
    prompt = [5, 6, 7]
    params = bm.SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=1, ignore_eos=True, **controls)
    out = llm.generate([prompt], params)[0]
    ref = reference_model(llm.loaded)
    ids = prompt + out.token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    ranks = []
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        want = int((logits[i] > logits[i, token]).sum()) + 1
        assert position[token].rank == want
        assert position[token].logprob == pytest.approx(float(logits[i, token]), abs=1e-4)
        ranks.append(want)
    assert max(ranks) > 1  # some sampled token was outside the top 1


def test_openai_text_parts_reach_the_template_as_text_and_other_parts_are_refused(llm):
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    params = bm.SamplingParams(max_tokens=1, **GREEDY)
    assert llm.chat(parts, params, chat_template=template)[0].prompt == "ab\ncd|"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(bm.InvalidParameterError, match=r"messages\[0\].content: a 'image_url' part"):
        llm.chat(image, params, chat_template=template)
    with pytest.raises(bm.InvalidParameterError, match="chat_template_content_format='openai'"):
        llm.chat(parts, params, chat_template=template, chat_template_content_format="openai")


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_text(llm):
    free = llm.generate([[5, 6, 7]], bm.SamplingParams(max_tokens=8, **GREEDY))[0].outputs[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    stop = free.text[3:5]
    by_string = llm.generate([[5, 6, 7]], bm.SamplingParams(max_tokens=8, stop=[stop, "\x00"], **GREEDY))[0]
    assert by_string.outputs[0].stop_reason == stop and by_string.finish_reason == "stop"
    kept = bm.SamplingParams(max_tokens=8, stop=stop, include_stop_str_in_output=True, **GREEDY)
    assert llm.generate([[5, 6, 7]], kept)[0].text.endswith(stop)
    token = free.token_ids[2]
    by_token = llm.generate([[5, 6, 7]], bm.SamplingParams(max_tokens=8, stop_token_ids=[token], **GREEDY))[0]
    assert by_token.outputs[0].stop_reason == token and by_token.token_ids == free.token_ids[:3]


def test_lora_request_and_beam_params_refuse_unknown_keywords_as_invalid_parameter_errors(adapter):
    with pytest.raises(
        bm.InvalidParameterError, match=r"LoRARequest\(lora_local_path='x'\).*pass lora_path="
    ):
        bm.LoRARequest("a", 1, str(adapter[0]), lora_local_path="x")
    with pytest.raises(bm.InvalidParameterError, match=r"LoRARequest\(lora_nmae=...\): unknown parameter"):
        bm.LoRARequest(lora_nmae="a", lora_int_id=1, lora_path=str(adapter[0]))
    with pytest.raises(
        bm.InvalidParameterError, match=r"BeamSearchParams\(beam_witdh=...\): unknown parameter"
    ):
        bm.BeamSearchParams(beam_witdh=2, max_tokens=3)
