"""Random-weight models (bm.runtime.random_weights): built on the meta device, each parameter drawn once,
seeded, on the target device, with the buffers and ties a plain ``from_config`` build has."""

from __future__ import annotations

import logging
import re
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, LlamaRMSNorm

from bm.config import ModelConfig
from bm.runtime import load_model
from bm.runtime import random_weights as rw
from bm.runtime.default_model import TINY_LLAMA_CONFIG
from bm.runtime.model_loader import random_model
from tests.model_matrix import MATRIX

aten = torch.ops.aten
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]
CONSTANT_FILLS = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
GEMMA_NORMS = (r"norm\.weight$", 0, 2)  # ones_ in the base class, then zeros_ (the norm scales by 1 + w)
# Parameters a family's own _init_weights writes twice, the second write replacing the first whole, as
# (name pattern, draws, constant fills). The count is transformers' (from_pretrained writes a missing
# weight the same way), not bm's: every other parameter is written exactly once.
WRITTEN_TWICE_BY_TRANSFORMERS = {
    "gemma": [GEMMA_NORMS],
    "gemma2": [GEMMA_NORMS],
    "gemma3_text": [GEMMA_NORMS],
    "nemotron": [(r"norm\.(weight|bias)$", 0, 2)],  # the base class's LayerNorm init, then its own
    "phimoe": [(r"router\.weight$", 2, 0)],  # nn.Linear's draw, then the router's own
    "gpt2": [(r"c_proj\.weight$", 2, 0)],  # Conv1D's draw, then GPT-2's residual scaling by 1/sqrt(2N)
    # FalconLinear (every projection): nn.Linear's draw, then Falcon's own, with the same std
    "falcon": [(r"(query_key_value|dense|dense_h_to_4h|dense_4h_to_h)\.weight$", 2, 0)],
}


def matrix_config(name: str) -> PretrainedConfig:
    entry = next(e for e in MATRIX if e.name == name)
    return AutoConfig.for_model(entry.model_type, **entry.hf_config())


def tiny_llama(**overrides) -> PretrainedConfig:
    return AutoConfig.for_model(**{**TINY_LLAMA_CONFIG, **overrides})


def plain_build(
    config: PretrainedConfig, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.nn.Module:
    """The way bm built random models before: torch and transformers both drawing on the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def storage(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


class InitWrites(TorchDispatchMode):
    """Every random draw (ops tagged nondeterministic_seeded) and constant fill on a real device, by the
    storage it wrote; meta tensors (the model as first built) are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[str, int]] = []
        self.whole_fills: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        written = args[0] if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) else out
        if isinstance(written, torch.Tensor) and written.device.type != "meta":
            if torch.Tag.nondeterministic_seeded in func.tags:
                self.draws.append(storage(written))
            elif func in CONSTANT_FILLS:
                whole = written.numel() * written.element_size() == written.untyped_storage().nbytes()
                if whole:
                    self.whole_fills.append(storage(written))
        return out


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_gives_bitwise_the_same_weights_on_the_device_and_another_seed_differs(device):
    config = tiny_llama()
    a, b, c = (random_model(config, torch.float32, device, seed) for seed in (0, 0, 1))
    assert {p.device.type for p in a.parameters()} == {device}
    assert {t.device.type for t in a.buffers()} == {device}
    for (name, x), y, z in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name
        if "norm" not in name and "inv_freq" not in name:  # constants are the same for every seed
            assert not torch.equal(x, z), name


def test_the_callers_random_state_is_left_as_it_was():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    random_model(tiny_llama(), torch.float32, "cpu", seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_dtype_is_the_one_asked_for_with_buffers_as_from_config_makes_them():
    model = random_model(tiny_llama(), torch.bfloat16, "cpu", 0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_the_write_counter_sees_both_draws_of_a_plain_build():
    """The instrument the next test rests on: torch's reset_parameters and transformers' _init_weights."""
    with InitWrites() as writes:
        model = plain_build(tiny_llama())
    draws, fills = Counter(writes.draws), Counter(writes.whole_fills)
    q = storage(model.model.layers[0].self_attn.q_proj.weight)
    norm = storage(model.model.norm.weight)
    assert (draws[q], fills[q]) == (2, 0)
    assert (draws[norm], fills[norm]) == (0, 1)  # transformers' ones_ (RMSNorm's torch.ones is no fill)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", MATRIX, ids=lambda e: e.name)
def test_each_parameter_is_drawn_once_on_the_device_and_nothing_is_drawn_before(entry, device):
    config = AutoConfig.for_model(entry.model_type, **entry.hf_config())
    with InitWrites() as writes:
        model = random_model(config, torch.float32, device, 0)
    params = {storage(p) for p in model.parameters()}  # tied parameters share one storage
    assert set(writes.draws) <= params, "a draw went to a tensor the model does not keep"
    draws, fills = Counter(writes.draws), Counter(writes.whole_fills)
    twice = WRITTEN_TWICE_BY_TRANSFORMERS.get(entry.model_type, [])
    for name, p in model.named_parameters():
        written = (draws[storage(p)], fills[storage(p)])
        rule = next(((d, f) for pattern, d, f in twice if re.search(pattern, name)), None)
        if rule is not None:
            assert written == rule, name
        else:  # drawn once, or (norm weights, biases) set to a constant once: never both, never twice
            assert written in {(1, 0), (0, 1)}, (name, written)


@pytest.mark.parametrize("entry", MATRIX, ids=lambda e: e.name)
def test_buffers_and_ties_are_those_of_a_plain_from_config_build(entry):
    config = AutoConfig.for_model(entry.model_type, **entry.hf_config())
    for dtype in (torch.float32, torch.bfloat16):  # GPT-J's positions are computed in the default dtype
        ours, plain = random_model(config, dtype, "cpu", 0), plain_build(config, dtype)
        expected = dict(plain.named_buffers())
        assert {n for n, _ in ours.named_buffers()} == set(expected)
        for name, buffer in ours.named_buffers():
            assert buffer.dtype == expected[name].dtype, name
            assert torch.equal(buffer, expected[name]), name
        # The same parameters, tied the same way (named_parameters lists a tied one once).
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in plain.named_parameters()]
        assert [(n, p.shape, p.dtype) for n, p in ours.named_parameters(remove_duplicate=False)] == [
            (n, p.shape, p.dtype) for n, p in plain.named_parameters(remove_duplicate=False)
        ]


@pytest.mark.parametrize("name", ["llama", "gemma", "gptj"])  # plain; tied with embed_scale; sinusoids
def test_logits_equal_hf_built_the_plain_way_with_the_same_weights_copied_in(name):
    config = matrix_config(name)
    ours = random_model(config, torch.float32, "cpu", 0).eval()
    plain = plain_build(config).eval()
    plain.load_state_dict(ours.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, plain(ids).logits)


def test_tied_embeddings_stay_one_tensor():
    model = random_model(matrix_config("gemma"), torch.float32, "cpu", 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.std() > 0.1  # drawn (initializer_range 0.2), not left zero


def test_load_model_builds_config_models_this_way():
    loaded = load_model(ModelConfig(device="cpu", seed=3, prepack="off", fused_elementwise="off"))
    expected = random_model(tiny_llama(), torch.float32, "cpu", 3).state_dict()
    assert loaded.model.state_dict().keys() == expected.keys()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_a_family_whose_init_skips_a_parameter_is_built_on_the_device_directly(monkeypatch, caplog):
    """An unwritten parameter would hold whatever the allocator left: that family falls back instead."""
    init_weights = LlamaPreTrainedModel._init_weights

    def skip_norms(self, module):
        if not isinstance(module, LlamaRMSNorm):
            init_weights(self, module)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", skip_norms)
    with caplog.at_level(logging.WARNING, logger="bm"):
        model = random_model(tiny_llama(), torch.float32, "cpu", 0)
    assert "unwritten" in caplog.text and "input_layernorm.weight" in caplog.text
    assert torch.equal(model.model.norm.weight, torch.ones(64))  # RMSNorm's own constructor, on the device


def test_a_meta_build_that_fails_falls_back_to_a_seeded_build_on_the_device(monkeypatch, caplog):
    def fail(*args):
        raise NotImplementedError("cannot run on meta tensors")

    monkeypatch.setattr(rw, "_build_on_meta", fail)
    with caplog.at_level(logging.WARNING, logger="bm"):
        model = random_model(tiny_llama(), torch.float32, "cpu", 5)
    assert "NotImplementedError: cannot run on meta tensors" in caplog.text
    expected = plain_build(tiny_llama(), seed=5)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected.state_dict()[name]), name
