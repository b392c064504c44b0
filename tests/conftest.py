"""Shared fixtures: tiny random-weight models (nothing downloaded) and the HF reference for the oracle."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from bm.config import BmConfig, config_from_dict
from bm.runtime import LoadedModel, load_model
from bm.runtime.model_loader import ModelConfig
from bm.runtime.weight_quant import expand_linears

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def make_config(**sections) -> BmConfig:
    """A config for tests: CPU, a small explicit cache, everything else default unless given."""
    data = {"model": {"device": "cpu"}, "kv_cache": {"max_tokens": 4096, "tokens_per_block": 8}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_dict(data)


@pytest.fixture
def threads():
    """Sets torch's (and so bm's kernels') thread count for one test, then puts it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def triton_rotary_on_cpu():
    """For a test that fuses a model with the Triton kernels on CPU (Triton's interpreter): the modeling
    modules' shared rotary global takes the latest fused model's kernels per device type, so afterwards
    it is handed bm's C kernels back (or transformers' own function, where they do not build), or every
    later test's CPU model would run its rotary in the interpreter."""
    yield
    from bm.runtime.fusion import _FusedRotary
    from bm.runtime.native import elementwise_kernels

    kernels = elementwise_kernels()
    for module in list(sys.modules.values()):
        # the module's own globals only: a lazy module's getattr would import (transformers' would load
        # every model it maps, some needing packages not installed)
        rotary = getattr(module, "__dict__", {}).get("apply_rotary_pos_emb")
        if isinstance(rotary, _FusedRotary):
            if kernels is not None:
                rotary.use(kernels)
            else:
                module.apply_rotary_pos_emb = rotary.__wrapped__


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """The embedded tiny Llama (initializer_range 0.2, so greedy argmax is rarely a near-tie)."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return load_model(ModelConfig(device="cpu", seed=0))


def reference_model(loaded: LoadedModel) -> torch.nn.Module:
    """An independent copy running transformers' own attention and linears, for HF generate(): a
    linear holding a quantized format (int8 on load, a GGUF file's blocks) runs its expanded weight in
    plain torch, as transformers loads the same checkpoint."""
    ref = copy.deepcopy(loaded.model)
    expand_linears(ref, loaded.dtype)
    try:
        ref.set_attn_implementation("sdpa")
    except ValueError:  # e.g. Gemma 2: SDPA cannot soft-cap, transformers runs it eagerly
        ref.set_attn_implementation("eager")
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return ref


def compare_dataset(folder: Path) -> Path:
    """Six token-id requests of 4 to 24 prompt tokens and 3 to 5 outputs: a comparison in seconds."""
    path = folder / "requests.jsonl"
    rows = [{"input_ids": [5 + i, 17, 33 + i, 9] * (i + 1), "max_tokens": 3 + (i % 3)} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_reference(tiny_model: LoadedModel) -> torch.nn.Module:
    return reference_model(tiny_model)


def hf_generate(ref: torch.nn.Module, prompt: list[int], max_new_tokens: int, **kwargs):
    """HF generate() on one request alone, deterministic (no sampling, no end token unless given)."""
    with torch.no_grad():
        return ref.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            **{"do_sample": False, "pad_token_id": 0, "eos_token_id": None, **kwargs},
        )


def hf_greedy(
    ref: torch.nn.Module, prompt: list[int], max_new_tokens: int, end_id: int | None = None
) -> list[int]:
    """HF generate() on one request alone: the oracle bm's greedy output must equal."""
    out = hf_generate(ref, prompt, max_new_tokens, eos_token_id=end_id)
    return out[0, len(prompt) :].tolist()


def random_prompts(seed: int, count: int, vocab: int, max_prompt: int, max_output: int):
    """(prompt, output_len) pairs of mixed lengths from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    specs = []
    for _ in range(count):
        n = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        m = int(torch.randint(1, max_output + 1, (1,), generator=g))
        specs.append((torch.randint(3, vocab, (n,), generator=g).tolist(), m))
    return specs
