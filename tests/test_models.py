"""Any Hugging Face causal LM that routes attention through AttentionInterface runs through bm unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from bm.batch_manager import InferenceRequest
from bm.config import ModelConfig
from bm.runtime import UnsupportedAttentionError, load_model
from bm.runtime.model_loader import describe_model
from bm.runtime.model_runner import ModelRunner, work_item
from tests.conftest import hf_greedy, make_config, random_prompts, reference_model
from tests.engine_wait import generate_or_fail

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)  # fmt: skip

ARCHITECTURES = {
    "qwen2": {},  # q/k/v biases
    "mistral": {"sliding_window": 48},  # a native window on every layer: blocks behind it are released
    "gemma": {"head_dim": 16},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},  # learned positions
    "gpt_neox": {"num_key_value_heads": None},  # ignores num_key_value_heads: shapes are probed
    # its decoder layer drops **kwargs before attention: the batch metadata must not travel as a kwarg
    "stablelm": {},
    "gemma2": {"head_dim": 16, "attn_logit_softcapping": 3.0},  # soft-capped attention scores
}


def build(model_type: str):
    extra = ARCHITECTURES[model_type]
    base = {} if model_type == "gpt2" else dict(SMALL)
    if model_type == "gpt2":
        base = {"vocab_size": 300, "initializer_range": 0.2}
    kwargs = {**base, **{k: v for k, v in extra.items() if v is not None}}
    if extra.get("num_key_value_heads", 0) is None:
        kwargs.pop("num_key_value_heads", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs)).eval()
    return describe_model(model, None, model_type)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_other_architectures_match_hf_generate(model_type):
    loaded = build(model_type)
    ref = reference_model(loaded)
    specs = random_prompts(seed=3, count=8, vocab=300, max_prompt=30, max_output=12)
    results = generate_or_fail(
        [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)],
        make_config(engine={"max_num_tokens": 64}),
        model=loaded,
        check_integrity=True,
    )
    for i, (prompt, max_new) in enumerate(specs):
        assert results[i].error == ""
        assert results[i].output_ids == hf_greedy(ref, prompt, max_new), f"{model_type} request {i}"


def test_native_sliding_window_model_matches_hf_beyond_its_window():
    """Mistral's window (48) becomes the engine's attention window: sequences may outgrow it."""
    loaded = build("mistral")
    ref = reference_model(loaded)
    g = torch.Generator().manual_seed(4)
    specs = [(torch.randint(3, 300, (n,), generator=g).tolist(), m) for n, m in ((40, 30), (70, 12), (5, 60))]
    results = generate_or_fail(
        [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)],
        make_config(engine={"max_num_tokens": 128}),
        model=loaded,
        check_integrity=True,
    )
    for i, (prompt, max_new) in enumerate(specs):
        assert results[i].error == ""
        assert results[i].output_ids == hf_greedy(ref, prompt, max_new), f"request {i}"


def test_a_model_that_bypasses_attention_interface_without_an_adapter_is_refused_by_class():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "xglm", vocab_size=300, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128
    )
    with pytest.raises(UnsupportedAttentionError, match=r"inline \(its attention classes: XGLMAttention\)"):
        describe_model(AutoModelForCausalLM.from_config(cfg), None, "xglm")


def test_paged_attention_outside_a_runner_forward_names_the_runner_not_the_model(tiny_model):
    """Calling a model set to bm's attention directly is the caller's doing; the message says so."""
    runner = ModelRunner(tiny_model, num_blocks=4, tokens_per_block=8, max_seq_len=32)
    with pytest.raises(UnsupportedAttentionError, match=r"outside a bm forward.*ModelRunner\.forward"):
        runner.model(input_ids=torch.tensor([[5, 6]]), use_cache=False)


def test_packed_forward_matches_unpacked_logits(tiny_model, tiny_reference):
    """Whole prompts, a chunk on top of a cached prefix, and single tokens, all in one forward."""
    runner = ModelRunner(tiny_model, num_blocks=64, tokens_per_block=4, max_seq_len=256)
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(3, 259, (n,), generator=g).tolist() for n in (23, 9, 1))
    first = runner.forward([work_item(a, 0, list(range(6)), True), work_item(b[:5], 0, [6, 7, 8], False),
                            work_item(c, 0, [9], True)])  # fmt: skip
    second = runner.forward([work_item(b[5:], 5, [6, 7, 8], True), work_item([7], 23, list(range(6)), True)])
    with torch.no_grad():
        ref = [tiny_reference(torch.tensor([x])).logits[0, -1] for x in (a, c, b, [*a, 7])]
    got = [first[0], first[1], second[0], second[1]]
    for want, have in zip(ref, got, strict=True):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)


def test_checkpoint_directory_with_tokenizer_loads_and_generates(tmp_path, tiny_model):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)}, "[UNK]": 29}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    ref = reference_model(tiny_model)
    ref.save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text())}))
    loaded = load_model(ModelConfig(path=str(tmp_path), device="cpu"))
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode("abc")
    results = generate_or_fail([InferenceRequest.from_values(1, ids, 6)], make_config(), model=loaded)
    assert results[1].output_ids == hf_greedy(ref, ids, 6)
