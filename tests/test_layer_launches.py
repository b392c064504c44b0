"""How many kernels a step launches per decoder layer on the GPU path (decode, and with a prompt), counted on
the CPU.

A decode step of a small model is dozens of kernels of a few microseconds each per layer, so each launch
costs about as much as it computes (an H100 profile of SmolLM2's 256-row step: 30 layers, elementwise
kernels of 1.5-3 us). The count is a deterministic stand-in for that cost, and it catches a rewrite that
silently stops applying: under the GPU machines' transformers (5.17) the fused decoder layer fell back to
transformers' own code and a layer ran two residual adds where one was meant, which only a GPU profile
showed. ``make test-gpu-stack`` runs this under that transformers too.

What runs: a tiny Llama in bfloat16 with everything the GPU path installs (the Triton elementwise kernels,
q/k/v and gate/up stacked, the Triton attention backend over its static decode buffers), in Triton's
interpreter. Torch operators that would launch a kernel on CUDA are counted with a dispatch mode (views,
allocations and no-op conversions launch nothing), Triton kernels by their launches; one layer's count is
a three-layer forward's less a two-layer one's.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

pytest.importorskip("triton")

from transformers import AutoConfig, AutoModelForCausalLM

from bm.runtime import ModelRunner, work_item
from bm.runtime.backends import ENV_SWITCH
from bm.runtime.fused_projections import fuse_projections
from bm.runtime.fusion import fuse_elementwise
from bm.runtime.model_loader import LoadedModel, describe_model
from bm.runtime.triton.elementwise import TritonElementwise
from tests.op_counts import Operators


def gpu_path_llama(layers: int, monkeypatch) -> LoadedModel:
    """A tiny Llama in bfloat16 with everything the GPU path installs: the Triton elementwise kernels,
    q/k/v and gate/up stacked, the Triton backend's static decode buffers, the cache in the model's
    dtype (set ``ENV_SWITCH`` to ``triton`` for the backend)."""
    config = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    fuse_elementwise(model, TritonElementwise("cpu"))
    assert fuse_projections(model) == {"qkv": layers, "gate_up": layers}
    loaded = describe_model(
        model, None, "tiny", prepack="off", fused_elementwise="off", fused_projections="off"
    )
    loaded.cuda_graphs = "on"  # the static buffers a CUDA graph replays (run eagerly here)
    # the cache in the model's dtype, as on CUDA (a CPU without bm's AVX-512 kernels keeps it in float32)
    monkeypatch.setattr(type(loaded), "kv_dtype", property(lambda self: self.dtype))
    return loaded


def _step_launches(layers: int, monkeypatch, prompt: bool = False) -> Counter:
    """The launches of one step over a ``layers``-layer model: four decode rows, and with ``prompt`` a
    7-token prompt beside them (an eager step: no static buffers serve it)."""
    from triton.runtime.interpreter import InterpretedFunction

    loaded = gpu_path_llama(layers, monkeypatch)
    runner = ModelRunner(loaded, num_blocks=64, tokens_per_block=16, max_seq_len=256)
    items = [work_item([5], 20, [2 * i, 2 * i + 1]) for i in range(4)]
    if prompt:
        items.append(work_item([6] * 7, 0, [8]))
    counts: Counter = Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        with _disable_current_modes():  # the interpreter's own torch calls are not the kernel's launches
            return run(self, *args, **kwargs)

    with torch.inference_mode():
        runner.forward(items, float_logits=False)  # first use: whatever is set up once
        monkeypatch.setattr(InterpretedFunction, "run", counted)
        with Operators(counts):
            runner.forward(items, float_logits=False)
    monkeypatch.setattr(InterpretedFunction, "run", run)
    return counts


def _per_layer(monkeypatch, prompt: bool = False) -> dict[str, int]:
    monkeypatch.setenv(ENV_SWITCH, "triton")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/__init__.py
    two, three = _step_launches(2, monkeypatch, prompt), _step_launches(3, monkeypatch, prompt)
    return {name: three[name] - two[name] for name in three if three[name] != two[name]}


# what every Llama layer launches on the GPU path, whatever the step, besides its attention
LAYER = {
    "aten.linear": 4,  # q/k/v stacked, o, gate/up stacked, down
    "rms_norm_kernel": 2,  # the input norm; the add after attention with the norm after it
    "rotary_store_kv_kernel": 1,  # queries and keys rotated, keys and values stored in the cache
    "silu_mul_kernel": 1,
    "aten.add": 1,  # the residual add after the MLP
}


def test_a_decode_step_launches_eleven_kernels_per_llama_layer_on_the_gpu_path(
    monkeypatch, triton_rotary_on_cpu
):
    # 4 rows x 2 KV heads cannot fill an H100: split-KV, two passes
    assert _per_layer(monkeypatch) == {**LAYER, "split_kv_decode_kernel": 1, "split_kv_combine_kernel": 1}


def test_a_step_with_a_prompt_launches_ten_kernels_per_llama_layer_on_the_gpu_path(
    monkeypatch, triton_rotary_on_cpu
):
    """The eager path runs transformers' forward with bm's rewrites in it: the same kernels, and one
    attention launch for prompt and decode rows together."""
    assert _per_layer(monkeypatch, prompt=True) == {**LAYER, "paged_attention_kernel": 1}
