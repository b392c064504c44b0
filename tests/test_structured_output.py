"""Structured output against HF generate(): the same library's mask, applied by a logits processor to one
request alone, gives the same tokens bm gives in a mixed batch with chunking and pausing."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from bm.batch_manager.offline import generate
from bm.engine.requests.request import Request
from bm.engine.requests.structured import GuidedSpec, guided_spec
from bm.runtime import grammar as grammar_module
from bm.runtime.tokenizer import ByteTokenizer
from tests.conftest import hf_generate, hf_greedy, make_config, random_prompts

llguidance = pytest.importorskip("llguidance", reason="structured output needs llguidance (optional extra)")

EOS = ByteTokenizer.eos_token_id
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
SPECS = [
    ("guided_json", SCHEMA),
    ("response_format", {"type": "json_object"}),
    ("guided_regex", "[0-9]{2,4}-[a-z]+"),
    ("guided_choice", ["yes", "no", "maybe not"]),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number"}}}),
]


class LibraryMask(LogitsProcessor):
    """The reference: llguidance's own matcher for one request, fed HF's tokens, masking with its bitmask."""

    def __init__(self, spec, prompt_len: int, vocab: int) -> None:
        tokenizer = grammar_module.ll_tokenizer(llguidance, ByteTokenizer(), vocab, EOS)
        self.matcher = llguidance.LLMatcher(tokenizer, spec.grammar())
        self.prompt_len, self.vocab = prompt_len, vocab

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.prompt_len :].tolist()
        if new:
            assert self.matcher.consume_token(new[-1]), self.matcher.get_error()
        mask = self.matcher.compute_bitmask()
        allowed = torch.tensor([bool(mask[t // 8] >> (t % 8) & 1) for t in range(self.vocab)])
        return scores.masked_fill(~allowed, float("-inf"))


def guided_requests(vocab: int, max_new: int = 24):
    specs = random_prompts(seed=31, count=len(SPECS) * 2, vocab=vocab, max_prompt=40, max_output=4)
    out = []
    for i, (prompt, _) in enumerate(specs):
        key, value = SPECS[i % len(SPECS)]
        out.append(Request(i, prompt, max_new, end_id=EOS, guided_decoding=guided_spec(key, value)))
    return out


def unrelated(vocab: int, start: int) -> list[Request]:
    specs = random_prompts(seed=5, count=4, vocab=vocab, max_prompt=30, max_output=16)
    settings = [{"temperature": 0.9, "random_seed": 3}, {"repetition_penalty": 1.4}, {}, {}]
    return [Request(start + i, p, m, **settings[i]) for i, (p, m) in enumerate(specs)]


@pytest.mark.parametrize(
    ("engine", "kv"),
    [
        ({"enable_chunked_context": True, "max_num_tokens": 16}, {"tokens_per_block": 4}),
        # a cache too small for everyone: max_utilization pauses requests and resumes them later
        (
            {"scheduler_policy": "max_utilization", "enable_chunked_context": True, "max_num_tokens": 24},
            {"tokens_per_block": 4, "max_tokens": 96},
        ),
        ({"max_batch_size": 3}, {"tokens_per_block": 4, "enable_block_reuse": True}),
    ],
)
def test_constrained_greedy_output_equals_hf_with_the_same_librarys_mask(
    tiny_model, tiny_reference, engine, kv
):
    vocab = tiny_model.vocab_size
    requests = guided_requests(vocab)
    results = generate(
        requests + unrelated(vocab, 100), make_config(engine=engine, kv_cache=kv), model=tiny_model
    )
    for req in requests:
        got = results[req.request_id]
        assert got.ok, got.error
        mask = LibraryMask(req.guided_decoding, len(req.input_ids), vocab)
        out = hf_generate(
            tiny_reference,
            req.input_ids,
            req.request_output_len,
            eos_token_id=EOS,
            logits_processor=LogitsProcessorList([mask]),
        )
        expected = out[0, len(req.input_ids) :].tolist()
        if EOS in expected:
            expected = expected[: expected.index(EOS) + 1]
        assert got.output_ids == expected, f"request {req.request_id} ({req.guided_decoding.kind})"
    if engine.get("scheduler_policy") == "max_utilization":
        assert sum(results[r.request_id].num_pauses for r in requests) > 0, "the small cache must pause"


def test_a_mask_allowing_every_token_leaves_greedy_output_equal_to_hf(
    tiny_model, tiny_reference, monkeypatch
):
    """The mask path itself (sync, one bitmask, one torch.minimum) changes nothing where nothing is masked."""
    monkeypatch.setattr(grammar_module.GrammarState, "sync", lambda self, output_ids: "")
    monkeypatch.setattr(
        grammar_module.GrammarRuntime,
        "fill",
        lambda self, states: torch.full((len(states), (self.vocab_size + 31) // 32), -1, dtype=torch.int32),
    )
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=8, count=6, vocab=vocab, max_prompt=30, max_output=20)
    spec = guided_spec("guided_regex", "x*")
    requests = [Request(i, p, m, guided_decoding=spec) for i, (p, m) in enumerate(specs)]
    results = generate(
        requests, make_config(engine={"enable_chunked_context": True, "max_num_tokens": 16}), model=tiny_model
    )
    for i, (prompt, max_new) in enumerate(specs):
        assert results[i].output_ids == hf_greedy(tiny_reference, prompt, max_new)


def test_every_constrained_output_ending_by_the_end_token_follows_its_constraint(tiny_model):
    vocab = tiny_model.vocab_size
    requests = guided_requests(vocab, max_new=80)
    results = generate(requests, make_config(), model=tiny_model)
    tok = ByteTokenizer()
    for req in requests:
        got = results[req.request_id]
        if got.output_ids[-1:] != [EOS]:
            continue
        text = tok.decode(got.output_ids[:-1])
        spec = req.guided_decoding
        if spec.kind == "choice":
            assert text in json.loads(spec.text)
        elif spec.kind in ("json_schema", "json_object"):
            value = json.loads(text)
            jsonschema = pytest.importorskip("jsonschema")
            jsonschema.validate(value, spec.schema)


def test_each_distinct_spec_is_compiled_once_per_run(tiny_model):
    from bm.runtime.executor import TorchExecutor

    executor = TorchExecutor(tiny_model)
    requests = guided_requests(tiny_model.vocab_size, max_new=4)
    generate(requests, make_config(), executor=executor)
    assert executor.grammar.num_compiled == len({r.guided_decoding for r in requests}) == len(SPECS)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("guided_json", {"type": "object", "properties": {"a": {"type": "strin"}}}, "Invalid type: strin"),
        ("guided_regex", "a(b", "invalid regex"),
        ("guided_choice", [], "non-empty list"),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {}}}, "name"),
        ("response_format", {"type": "xml"}, "'xml'"),
    ],
)
def test_an_invalid_constraint_is_that_requests_error_naming_the_problem(tiny_model, key, value, message):
    prompt = [5, 6, 7]
    bad = Request(0, prompt, 4, guided_decoding={"json": value} if key == "guided_json" else None)
    if key != "guided_json":
        from bm.engine.requests.fields import request_field
        from bm.engine.requests.request import RequestError

        with pytest.raises(RequestError, match=message.replace("(", r"\(")):
            request_field("guided_decoding", key, value)
        return
    results = generate([bad, Request(1, prompt, 4)], make_config(), model=tiny_model)
    assert message in results[0].error and results[1].ok


def test_structured_output_refuses_beams_and_drafts(tiny_model):
    spec = guided_spec("guided_choice", ["a", "b"])
    results = generate(
        [
            Request(0, [5, 6], 4, beam_width=2, guided_decoding=spec),
            Request(1, [5, 6], 4, draft_input_ids=[7, 8], guided_decoding=spec),
        ],
        make_config(engine={"max_beam_width": 2}),
        model=tiny_model,
    )
    assert "beam_width > 1" in results[0].error
    assert "drafts are not checked against the grammar" in results[1].error


def test_the_library_and_the_seeds_api_take_structured_output(tiny_model):
    import bm
    from bm.batch_manager import BatchManager, InferenceRequest
    from tests.clients import StaggeredClient

    llm = bm.LLM(model="tiny-random", device="cpu")
    choice = bm.SamplingParams(temperature=0, max_tokens=20, guided_decoding={"choice": ["red", "green"]})
    schema = bm.SamplingParams(
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}}},
    )
    first, second = llm.generate(["Pick one:", "True or false:"], [choice, schema])
    assert first.text in ("red", "green") and first.finish_reason == "stop"
    assert second.text in ("true", "false") and second.finish_reason == "stop"
    with pytest.raises(ValueError, match="not both"):
        bm.SamplingParams(
            temperature=0, response_format={"type": "json_object"}, guided_decoding={"regex": "a"}
        ).request_fields(None)

    seed = InferenceRequest.from_values(0, [5, 6, 7], 12, end_id=EOS, guided_decoding={"choice": ["abc"]})
    client = StaggeredClient([seed])
    with BatchManager(make_config(), client.get_requests, client.send_response, model=tiny_model):
        client.wait_or_fail()
    assert client.results[0].output_ids == [*ByteTokenizer().encode("abc"), EOS]


def test_a_constraint_no_output_satisfies_ends_only_its_own_request(tiny_model, monkeypatch):
    # caught when compiled, even when handed over as a GuidedSpec that skipped the field table
    unchecked = GuidedSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}')
    results = generate(
        [Request(0, [5, 6], 8, guided_decoding=unchecked), Request(1, [5, 6], 8)],
        make_config(),
        model=tiny_model,
    )
    assert "minimum (5) is greater than maximum (1)" in results[0].error and results[1].ok
    # and a step where the mask allows nothing ends that request, not the batch
    monkeypatch.setattr(
        grammar_module.GrammarRuntime,
        "fill",
        lambda self, states: torch.zeros((len(states), (self.vocab_size + 31) // 32), dtype=torch.int32),
    )
    spec = guided_spec("guided_choice", ["a"])
    results = generate(
        [Request(0, [5, 6], 8, guided_decoding=spec), Request(1, [5, 6], 8)], make_config(), model=tiny_model
    )
    assert results[0].error == "structured output: no token can continue the output"
    assert results[1].ok and len(results[1].output_ids) == 8
