"""The attention adapters are matched on transformers' call signatures, not just class names: a changed
signature refuses the model at load, naming the class and the tested range, and leaves it unchanged."""

from __future__ import annotations

import importlib
import re
import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bm.runtime import UnsupportedAttentionError
from bm.runtime.model_families import (
    _ADAPTERS,
    TESTED_TRANSFORMERS,
    adapt_attention_modules,
    check_adapter_signature,
)
from bm.runtime.model_loader import describe_model


def _tiny_mpt() -> torch.nn.Module:
    config = AutoConfig.for_model("mpt", d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _with_extra_keyword(model: torch.nn.Module, name: str) -> type:
    """Swap each ``name`` module's class for a fake of the same name whose forward takes one more keyword,
    as a transformers release that changed the call would."""
    original = next(type(m) for m in model.modules() if type(m).__name__ == name)

    def forward(
        self, hidden_states, position_bias, cache=None, attention_mask=None, new_flag=False, **kwargs
    ):
        return original.forward(self, hidden_states, position_bias, cache, attention_mask, **kwargs)

    fake = types.new_class(name, (original,), exec_body=lambda ns: ns.update(forward=forward))
    for module in model.modules():
        if type(module) is original:
            module.__class__ = fake
    return fake


def test_adapted_class_with_an_extra_keyword_is_refused_naming_class_and_tested_range():
    model = _tiny_mpt()
    fake = _with_extra_keyword(model, "MptAttention")
    with pytest.raises(UnsupportedAttentionError) as refused:
        check_adapter_signature(fake)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("MptAttention.forward(") and "new_flag" in message
    assert f"transformers{TESTED_TRANSFORMERS}" in message


def test_refused_model_is_left_unadapted_and_describe_model_refuses_it():
    model = _tiny_mpt()
    _with_extra_keyword(model, "MptAttention")
    with pytest.raises(UnsupportedAttentionError, match=re.escape("MptAttention.forward(")):
        describe_model(model, None, "mpt")
    assert not any(getattr(m, "_bm_adapted", False) for m in model.modules())


def test_installed_transformers_signatures_are_ones_the_adapters_accept():
    """Every adapted class that still defines its method on the installed transformers is accepted, so a
    release that changes one fails here (and in `make test-latest`) before it reaches a user."""
    model = _tiny_mpt()
    assert adapt_attention_modules(model) == 2
    for name, adapter in _ADAPTERS.items():
        family = name[: -len("Attention")].lower()
        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        if adapter.method in vars(cls):
            assert check_adapter_signature(cls) is adapter, name


def test_adapted_mpt_generates_in_hf_after_deepcopy():
    """The adapter passes HF's own call through unchanged (the 5.24 `cache` keyword broke this)."""
    import copy

    model = _tiny_mpt()
    adapt_attention_modules(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    expected = _tiny_mpt().generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(copy.deepcopy(model).generate(ids, max_new_tokens=4, do_sample=False), expected)
