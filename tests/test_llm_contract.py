"""bm.LLM's contract with a vLLM user: bad parameters raise before anything runs, and n, log probs, logit
bias, min-p, seeds, structured outputs, tools and the tokenizer come in vLLM's names and shapes."""

from __future__ import annotations

import math

import pytest
import torch

import bm

KV = {"max_tokens": 4096, "tokens_per_block": 8}


@pytest.fixture(scope="module")
def llm() -> bm.LLM:
    return bm.LLM(model="tiny-random", device="cpu", kv_cache=KV)


INVALID = [
    ({"max_tokens": 0}, "max_tokens: must be at least 1, got 0"),
    ({"max_tokens": -1}, "max_tokens: must be at least 1, got -1"),
    ({"max_tokens": 2.5}, "max_tokens: expected an integer"),
    ({"temperature": -1}, "temperature: -1.0 is out of range; allowed >= 0"),
    ({"temperature": "0.5"}, 'temperature: expected a finite number, got "0.5"'),
    ({"logprobs": 21}, "logprobs: must be at most 20, got 21"),
    ({"logprobs": -1}, "logprobs: must be at least 0"),
    ({"logprobs": True}, "logprobs: expected a count of top log probs"),
    ({"n": 0}, "n: must be at least 1, got 0"),
    ({"top_p": 0.0}, r"top_p: 0.0 is out of range; allowed \(0, 1\]"),
    ({"top_k": -2}, "top_k: must be at least 0"),
    ({"min_p": 1.5}, r"min_p: 1.5 is out of range; allowed \[0, 1\]"),
    ({"seed": -1}, "seed: must be at least 0"),
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\]: 101.0 is out of range"),
    ({"stop": [""]}, "stop: expected non-empty strings"),
    ({"ignore_eos": "yes"}, "ignore_eos: expected True or False"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "guided_decoding: expected one of"),
    ({"best_of": 3}, r"best_of: 3 > n \(1\) is not supported: bm returns every sample.*ask n=3"),
    ({"n": 2, "best_of": 1}, r"best_of: must be at least n \(2\), got 1"),
    ({"prompt_logprobs": 21}, "prompt_logprobs: must be at most 20, got 21"),
    ({"prompt_logprobs": True}, r"prompt_logprobs: expected an integer in \[0, 20\]"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens: expected true or false"),
    (
        {"skip_special_tokens": False, "spaces_between_special_tokens": False},
        "spaces_between_special_tokens: False is not honoured when special tokens are written",
    ),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output: expected true or false"),
]


@pytest.mark.parametrize(("fields", "message"), INVALID, ids=[next(iter(f)) + repr(f) for f, _ in INVALID])
def test_llm_generate_raises_on_invalid_sampling_params(llm, monkeypatch, fields, message):
    """Each bad value raises one ValueError subclass naming the field, when the parameters are built and
    again when generate is handed parameters changed since: never an empty answer, and nothing runs."""
    with pytest.raises(bm.InvalidParameterError, match=f"SamplingParams.{message}"):
        bm.SamplingParams(**fields)
    params = bm.SamplingParams(temperature=0, max_tokens=3)
    for name, value in fields.items():
        setattr(params, name, value)
    monkeypatch.setattr(llm, "session", lambda *a: pytest.fail("an engine ran for invalid parameters"))
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hi", "there"], [bm.SamplingParams(temperature=0, max_tokens=3), params])


def test_what_only_the_model_can_judge_raises_before_any_prompt_of_the_batch_runs(llm, monkeypatch):
    monkeypatch.setattr(llm, "session", lambda *a: pytest.fail("an engine ran for invalid parameters"))
    vocab = llm.loaded.vocab_size
    with pytest.raises(bm.InvalidParameterError, match=f"prompt 1: logit_bias: token id {vocab} is outside"):
        llm.generate(
            [[5], [6]],
            [bm.SamplingParams(temperature=0), bm.SamplingParams(temperature=0, logit_bias={vocab: 1.0})],
        )
    with pytest.raises(
        bm.InvalidParameterError, match=r"prompt 0: max_tokens: .* lower max_tokens to at most"
    ):
        llm.generate([[5, 6]], bm.SamplingParams(temperature=0, max_tokens=10**6))
    with pytest.raises(
        bm.InvalidParameterError, match=r"prompt 0: stop: token id outside the vocabulary \[0, \d+\) in word"
    ):
        llm.generate([[5, 6]], bm.SamplingParams(temperature=0, stop_token_ids=[vocab]))


def test_log_probs_come_back_in_vllms_shape_with_ranks_and_the_cumulative_log_prob(llm):
    out = llm.generate(
        [[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    )[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in position and position[token].rank == 1  # greedy: the chosen one is the top one
        ranked = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert [lp.logprob for lp in ranked] == sorted((lp.logprob for lp in ranked), reverse=True)
        assert all(lp.decoded_token == llm.tokenizer.decode([t]) for t, lp in position.items())
    chosen = [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs, strict=True)]
    assert completion.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)
    # logprobs=0: only the chosen token's, as in vLLM
    zero = llm.generate(
        [[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    )[0]
    assert [list(p) for p in zero.logprobs] == [[t] for t in zero.token_ids]
    assert zero.outputs[0].cumulative_logprob == pytest.approx(completion.cumulative_logprob, abs=1e-4)


def test_n_returns_n_completion_outputs_per_prompt(llm):
    params = bm.SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True, logprobs=1)
    first, second = llm.generate([[5, 6, 7], [9, 10]], params)
    for out in (first, second):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 5 and len(c.logprobs) == 5 for c in out.outputs)
        assert all(c.text == llm.tokenizer.decode(c.token_ids) for c in out.outputs)
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the samples differ
    again = llm.generate([[5, 6, 7]], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]  # seeded


def test_logit_bias_and_min_p_steer_sampling(llm):
    greedy = llm.generate([[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[
        0
    ].token_ids
    forced = bm.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={42: 100.0})
    assert llm.generate([[5, 6, 7]], forced)[0].token_ids == [42] * 4
    # min_p=1 keeps only the most likely token: sampling at any temperature is then greedy
    for seed in range(3):
        only_top = bm.SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.5, min_p=1.0, seed=seed)
        assert llm.generate([[5, 6, 7]], only_top)[0].token_ids == greedy


def test_min_p_drops_tokens_below_the_fraction_of_the_top_ones_probability():
    from bm.runtime.sampler import Sampler
    from bm.scheduling.request import Sampling

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = Sampler().probabilities(logits, Sampling(temperature=1.0, min_p=0.25))
    kept = probs[0] > 0
    assert kept.tolist() == [True, True, True, False]  # 0.05 < 0.25 x 0.5
    assert probs[0, :3].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95])


def test_llm_seed_seeds_sampling_not_the_weights():
    """LLM(seed=) is vLLM's: the same weights whatever the seed; sampled runs repeat under one seed and
    change under another; two unseeded requests of one batch sample differently."""
    params = bm.SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    runs = {}
    for seed in (3, 3, 4):
        llm = bm.LLM(model="tiny-random", device="cpu", kv_cache=KV, seed=seed)
        greedy = llm.generate([[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[
            0
        ].token_ids
        sampled = [o.token_ids for o in llm.generate([[5, 6, 7], [5, 6, 7]], params)]
        runs.setdefault(seed, []).append((greedy, sampled))
    (greedy3, sampled3), (greedy3b, sampled3b) = runs[3]
    greedy4, sampled4 = runs[4][0]
    assert greedy3 == greedy3b == greedy4  # the weights do not move with seed
    assert sampled3 == sampled3b and sampled3 != sampled4
    assert sampled3[0] != sampled3[1]  # duplicate prompts, different derived seeds


def test_structured_outputs_params_in_vllms_shape(llm):
    pytest.importorskip("llguidance", reason="structured output needs llguidance (optional extra)")
    choice = bm.SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=bm.StructuredOutputsParams(choice=["red", "blue"])
    )
    regex = bm.SamplingParams(
        temperature=0, max_tokens=20, guided_decoding=bm.GuidedDecodingParams(regex="[0-9]{3}")
    )
    first, second = llm.generate(["Pick:", "Digits:"], [choice, regex])
    assert first.text in ("red", "blue") and first.finish_reason == "stop"
    assert len(second.text) == 3 and second.text.isdigit()
    with pytest.raises(bm.InvalidParameterError, match="structured_outputs and response_format"):
        bm.SamplingParams(
            temperature=0, structured_outputs={"regex": "a"}, response_format={"type": "json_object"}
        )


def test_chat_hands_tools_to_the_template_and_get_tokenizer_returns_the_tokenizer(llm):
    template = (
        "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<a>"
    )
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(
        messages, bm.SamplingParams(temperature=0, max_tokens=2), chat_template=template, tools=tools
    )[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("[weather;]<user>Hi<a>")
    plain = llm.chat(
        messages, bm.SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, chat_template=template
    )[0]
    assert plain.prompt_token_ids == llm.tokenizer.encode("<user>Hi<a>")
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("Hello")) == "Hello"


def test_use_tqdm_draws_a_bar_on_a_terminal_and_nothing_elsewhere(llm, monkeypatch, capsys):
    import rich.console

    params = bm.SamplingParams(temperature=0, max_tokens=2)
    llm.generate([[5], [6]], params, use_tqdm=True)
    assert capsys.readouterr().err == ""  # not a terminal: no frames in a log
    monkeypatch.setattr(rich.console.Console, "is_terminal", property(lambda self: True))
    llm.generate([[5], [6]], params, use_tqdm=True)
    assert "2/2" in capsys.readouterr().err
    llm.generate([[5], [6]], params, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_max_tokens_none_runs_to_the_models_length():
    llm = bm.LLM(model="tiny-random", device="cpu", kv_cache=KV, max_model_len=24)
    out = llm.generate([[5, 6, 7, 8]], bm.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 20 and out.finish_reason == "length"
    assert math.isclose(llm.config.engine.max_seq_len, 24)


def test_prompt_logprobs_are_the_models_log_probs_of_each_prompt_token_in_vllms_shape(llm):
    """vLLM's RequestOutput.prompt_logprobs: None for the first token, then each prompt token's log
    probability under the model, its rank in the whole vocabulary, and the k most likely tokens there;
    the same when the prompt is computed in chunks (each chunk's logits are kept)."""
    from tests.conftest import reference_model

    ids = [5, 17, 33, 9, 60, 61, 62, 7, 3, 100, 42, 8, 19, 27, 250, 4, 5, 17, 33, 11]
    with torch.no_grad():
        want = reference_model(llm.loaded)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    chunked = bm.LLM(
        "tiny-random", device="cpu", kv_cache=KV, enable_chunked_prefill=True, max_num_batched_tokens=8
    )
    for model in (llm, chunked):
        out = model.generate([ids], bm.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for row, token, position in zip(want, ids[1:], out.prompt_logprobs[1:], strict=False):
            assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert position[token].rank == int((row > row[token]).sum()) + 1
            assert position[token].decoded_token == llm.tokenizer.decode([token])
            top = row.topk(3)
            assert [position[t].rank for t in top.indices.tolist()] == [1, 2, 3]
            assert [position[t].logprob for t in top.indices.tolist()] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
            assert set(position) == {token, *top.indices.tolist()}
    only_chosen = llm.generate([ids[:3]], bm.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[
        0
    ]
    assert [None if p is None else list(p) for p in only_chosen.prompt_logprobs] == [None, [17], [33]]
    assert llm.generate([ids[:3]], bm.SamplingParams(temperature=0, max_tokens=1))[0].prompt_logprobs is None


def test_prompt_logprobs_beside_prefix_caching_are_every_prompt_positions(llm):
    """A request asking for prompt log probs computes its whole prompt even when its prefix is cached
    (a cached position has no logits), so prefix caching changes nothing in the answer."""
    cached = bm.LLM("tiny-random", device="cpu", kv_cache=KV, enable_prefix_caching=True)
    prompt = list(range(5, 45))
    params = bm.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    # the first computes the prompt's blocks and the second would take them from the cache
    _, again = cached.generate([prompt, prompt], [bm.SamplingParams(temperature=0, max_tokens=2), params])
    [plain] = llm.generate([prompt], params)
    assert len(again.prompt_logprobs) == len(prompt)
    assert again.prompt_logprobs == plain.prompt_logprobs


def test_skip_special_tokens_false_writes_them_as_a_checkpoints_tokenizer_spells_them(tmp_path, tiny_model):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import reference_model

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)}, "[UNK]": 29}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    reference_model(tiny_model).save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    llm = bm.LLM(str(tmp_path), device="cpu", kv_cache=KV)
    forced = {"max_tokens": 3, "ignore_eos": True, "logit_bias": {2: 100.0}}  # </s> each step
    skipped = llm.generate(["abc"], bm.SamplingParams(temperature=0, **forced))[0]
    written = llm.generate(["abc"], bm.SamplingParams(temperature=0, **forced, skip_special_tokens=False))[0]
    assert skipped.token_ids == written.token_ids == [2, 2, 2]
    assert skipped.text == "" and written.text.split() == ["</s>"] * 3


def test_skip_special_tokens_false_is_refused_for_a_tokenizer_with_no_text_for_them(llm, monkeypatch):
    monkeypatch.setattr(llm, "session", lambda *a: pytest.fail("an engine ran for a refused request"))
    with pytest.raises(bm.InvalidParameterError, match=r"skip_special_tokens: False .* has no text for them"):
        llm.generate([[5, 6]], bm.SamplingParams(temperature=0, skip_special_tokens=False))


def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text(llm):
    a = llm.tokenizer.encode("a")
    forced = {"max_tokens": 6, "ignore_eos": True, "logit_bias": {a[0]: 100.0}, "stop": ["aa"]}
    cut = llm.generate([[5, 6]], bm.SamplingParams(temperature=0, **forced))[0]
    kept = llm.generate(
        [[5, 6]], bm.SamplingParams(temperature=0, **forced, include_stop_str_in_output=True)
    )[0]
    assert cut.token_ids == kept.token_ids == a * 2  # the engine stopped on the stop string's tokens
    assert (cut.text, kept.text) == ("", "aa") and cut.finish_reason == kept.finish_reason == "stop"


def test_the_stop_string_found_is_the_first_to_start_and_of_two_starting_there_the_shorter():
    from bm.engine.requests.stopping import finished_text
    from bm.scheduling import FinishReason

    limit = FinishReason.LENGTH
    cut = finished_text("say STOP now END", [1], limit, ["END", "STOP"])
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("say ", "stop", "STOP")
    assert (
        finished_text("say STOP now END", [1], limit, ["END", "STOP"], include_stop_str=True).text
        == "say STOP"
    )
    assert finished_text("xaby", [1], limit, ["aby", "ab"], include_stop_str=True).text == "xab"
    none = finished_text("nothing", [1], limit, ["zz"])
    assert (none.text, none.finish_reason, none.stop_reason) == ("nothing", "length", None)


def test_bm_run_and_bm_llm_write_one_finish_vocabulary_for_the_same_request(llm, tmp_path):
    """One request, two front doors: ``bm run``'s record and ``bm.LLM``'s output carry the same text,
    tokens, ``finish_reason`` (vLLM's words: ``stop``, ``length``) and ``stop_reason`` (the stop
    string, the stop token, or None), whether a stop string, a stop token or the length ended it."""
    import json

    from typer.testing import CliRunner

    from bm.cli.main import app

    prompt = [5, 6, 7]
    greedy = llm.generate([prompt], bm.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[
        0
    ].outputs[0]
    text, ids = greedy.text, greedy.token_ids
    assert len(text) >= 3, "the greedy text is too short to hold a stop string"
    cases = [
        {"max_tokens": 6},  # the length
        {"max_tokens": 6, "stop_token_ids": [ids[2]]},  # a stop token
        {"max_tokens": 6, "stop": [text[1:3]]},  # a stop string
    ]
    lines = tmp_path / "lines.jsonl"
    lines.write_text("".join(json.dumps({"input_ids": prompt, "temperature": 0, **c}) + "\n" for c in cases))
    out = tmp_path / "out"
    args = ["run", str(lines), "--model", "tiny-random", "-o", str(out), "-q", "--set", "model.device=cpu"]
    result = CliRunner().invoke(app, [*args, "--ignore-eos"])
    assert result.exit_code == 0, result.output
    records = sorted(
        (json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()), key=lambda r: r["index"]
    )
    for case, record in zip(cases, records, strict=True):
        ours = llm.generate([prompt], bm.SamplingParams(temperature=0, ignore_eos=True, **case))[0].outputs[0]
        seen = (record["text"], record["output_ids"], record["finish_reason"], record["stop_reason"])
        assert seen == (ours.text, list(ours.token_ids), ours.finish_reason, ours.stop_reason), case
    assert [r["finish_reason"] for r in records] == ["length", "stop", "stop"]
    assert [r["stop_reason"] for r in records] == [None, ids[2], text[1:3]]
