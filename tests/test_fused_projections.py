"""Stacked projections (bm.runtime.fused_projections): q/k/v as one GEMM and gate/up as one GEMM inside
bm forwards, over one stored copy of the weights, with the model's values unchanged everywhere else.

bm stacks them on CUDA models in 16-bit dtypes only; :func:`fuse_projections` itself runs anywhere, so
these tests stack the tiny models on the CPU in float32."""

from __future__ import annotations

import copy
import io
import pickle
import types

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    OlmoConfig,
    Qwen2Config,
    Qwen3Config,
)

from bm.batch_manager import InferenceRequest
from bm.batch_manager.offline import generate
from bm.config import ConfigError, load_config
from bm.runtime import fused_projections as fp
from bm.runtime import load_model
from bm.runtime.attention import ShapeProbe, forward_context
from bm.runtime.fused_projections import (
    _StackedAttention,
    _StackedFusedMLP,
    _StackedMLP,
    fuse_projections,
    should_fuse_projections,
    unfuse_projections,
)
from bm.runtime.fusion import _FusedMLP, fuse_elementwise
from bm.runtime.model_loader import ModelConfig, describe_model
from bm.runtime.native import elementwise_kernels
from tests.conftest import hf_generate, make_config, random_prompts

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}


def in_bm_forward():
    return forward_context(ShapeProbe(), {})


def tiny(family: str = "llama", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = dict(
        vocab_size=64, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=10, max_position_embeddings=64, initializer_range=0.2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(CONFIGS[family](**{**fields, **overrides})).eval()


def logits(model: torch.nn.Module, ids: torch.Tensor, bm: bool = True) -> torch.Tensor:
    with torch.no_grad():
        if not bm:
            return model(ids).logits
        with in_bm_forward():  # as bm's runner calls it: bm's attention keeps the KV, no HF cache
            return model(ids, use_cache=False).logits


def count_stack_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    call = fp._Stack.__call__
    monkeypatch.setattr(fp._Stack, "__call__", lambda self, x: calls.append(len(self.sizes)) or call(self, x))
    return calls


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("elementwise", [False, True])
def test_stacked_model_gives_the_unstacked_logits_inside_a_bm_forward(family, elementwise, monkeypatch):
    """Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Mistral, with bm's fused elementwise kernels
    (their SiLU-mul reads the halves of the gate/up product in place) and without. On this CPU in
    float32 the stacked GEMMs give the separate GEMMs' bits; the logits were bitwise equal with the
    fused kernels, and within 2e-6 without (torch's SiLU takes another CPU kernel for a strided input)."""
    if elementwise and elementwise_kernels() is None:
        pytest.skip("bm's C kernels do not build here")
    model = tiny(family)
    if elementwise:
        fuse_elementwise(model)
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(1))
    expected = logits(model, ids)
    assert fuse_projections(model) == {"qkv": 2, "gate_up": 2}
    calls = count_stack_calls(monkeypatch)
    got = logits(model, ids)
    assert sorted(set(calls)) == [2, 3] and len(calls) == 4  # every layer's two stacks ran
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    mlp_type = _StackedFusedMLP if elementwise else _StackedMLP
    assert all(isinstance(layer.mlp.forward, mlp_type) for layer in model.model.layers)
    if elementwise:
        assert torch.equal(got, expected)


def _attention_with_the_cache_named(name: str) -> type:
    """transformers' Llama attention with its cache parameter under ``name``: earlier 5.x releases (5.17,
    on the GPU machines) call it ``past_key_values`` where recent ones call it ``cache``. Built from the
    installed source, renamed, so the test follows whichever transformers is installed."""
    import inspect
    import textwrap

    from transformers.models.llama import modeling_llama as llama

    source = textwrap.dedent(inspect.getsource(inspect.unwrap(llama.LlamaAttention.forward)))
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))  # no renaming
    current = list(inspect.signature(llama.LlamaAttention.forward).parameters)[4]
    source = source.replace(f"{current}:", f"{name}:").replace(f"{current}.update", f"{name}.update")
    source = source.replace(f"if {current} is not None", f"if {name} is not None")
    source = source.replace(", kwargs=kwargs)", ")")  # update()'s extra argument, recent releases only
    namespace: dict = {}
    exec(compile(source, "<renamed>", "exec"), vars(llama), namespace)
    return type(f"Attention_{name}", (llama.LlamaAttention,), {"forward": namespace["forward"]})


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_stacked_attention_takes_the_cache_under_either_name_transformers_gives_it(name):
    """A layer calls its attention with the cache as a keyword (``past_key_values=None`` in 5.17): the
    stacked forward must neither pass it twice to the module's own forward (a TypeError, which ended the
    H100 run's bf16 check) nor hand it to the attention interface; with no cache it stacks, with one it
    runs the module's own forward."""
    model = tiny("llama")
    attention = model.model.layers[0].self_attn
    attention.__class__ = _attention_with_the_cache_named(name)
    hidden = torch.randn(1, 5, 40, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(5)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    with torch.no_grad():
        expected, _ = attention(hidden, rotary, None, **{name: None})
        stacked = _StackedAttention(attention, fp._Variant(False, None))
        assert stacked.install()
        attention.forward = stacked
        outside, _ = attention(hidden, rotary, None, **{name: None})  # outside a bm forward: its own
        with in_bm_forward():
            inside, _ = attention(hidden, rotary, None, **{name: None})
            positional, _ = attention(hidden, rotary, None, None)

        class Cache:
            def update(self, key, value, layer, *args, **kwargs):
                self.seen = layer
                return key, value

        cache = Cache()
        with in_bm_forward():
            attention(hidden, rotary, None, **{name: cache})
    assert cache.seen == attention.layer_idx  # the own forward ran, with the cache
    for got in (outside, inside, positional):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_greedy_tokens_through_the_engine_are_the_same_with_projections_stacked_and_not(monkeypatch):
    """The embedded tiny Llama through bm.batch_manager.offline.generate (bm's paged attention, chunked and
    batched prompts, decode steps): stacking changes no token."""
    specs = random_prompts(seed=7, count=8, vocab=250, max_prompt=40, max_output=12)
    requests = [InferenceRequest.from_values(i, p, n) for i, (p, n) in enumerate(specs)]
    config = make_config(engine={"max_batch_size": 4, "max_num_tokens": 64})
    # prepack off: bm's packed CPU GEMMs replace the projections' forwards, which stacking leaves alone
    loaded = load_model(ModelConfig(device="cpu", seed=0, prepack="off"))
    separate = generate(copy.deepcopy(requests), config, model=loaded)
    assert loaded.fused_projections == {}  # auto: CUDA in 16-bit only
    assert fuse_projections(loaded.model) == {"qkv": 2, "gate_up": 2}
    calls = count_stack_calls(monkeypatch)
    stacked = generate(requests, config, model=loaded)
    assert calls
    for rid, result in separate.items():
        assert result.ok, result.error
        assert stacked[rid].output_ids == result.output_ids, f"request {rid}"


def test_hf_forward_and_generate_on_a_stacked_model_give_the_bits_of_the_model_before():
    """Outside bm forwards transformers' own code runs on the projections, whose weights are now row views
    of the stacked tensors: the same values, the same bits."""
    model = tiny("qwen2")  # biases too
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    before = logits(model, ids, bm=False)
    tokens = hf_generate(model, ids[0].tolist(), 12)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    assert torch.equal(logits(model, ids, bm=False), before)
    assert torch.equal(hf_generate(model, ids[0].tolist(), 12), tokens)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages the parameters live in (views of one storage counted once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def test_stacking_keeps_one_copy_of_the_weights():
    """The stacked tensors are the projections' storage: no second copy, and model.parameters() counts
    the same elements as before (each view once)."""
    model = tiny("qwen2")
    numel, nbytes = sum(p.numel() for p in model.parameters()), storage_bytes(model)
    fuse_projections(model)
    assert sum(p.numel() for p in model.parameters()) == numel
    assert storage_bytes(model) == nbytes
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    stack = attn.forward._stack
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert linear.weight.untyped_storage().data_ptr() == stack.weight.untyped_storage().data_ptr()
        assert linear.bias.untyped_storage().data_ptr() == stack.bias.untyped_storage().data_ptr()
    assert (
        mlp.up_proj.weight.untyped_storage().data_ptr()
        == mlp.forward._stack.weight.untyped_storage().data_ptr()
    )
    # stacking again (after unfuse_projections) finds the views in place and copies nothing
    unfuse_projections(model)
    assert "forward" not in vars(attn)
    fuse_projections(model)
    assert attn.forward._stack.weight.data_ptr() == stack.weight.data_ptr()


def test_a_lora_forward_or_a_hook_on_a_projection_sends_the_module_through_its_own_forward():
    """LoRA (bm.runtime.lora) installs a forward on the linear, a tensor-parallel plan a forward hook: the
    stacked GEMM would skip either, so the module runs its own forward, which calls the projections."""
    model = tiny()
    fuse_projections(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    h = torch.randn(1, 7, 40)
    emb = model.model.rotary_emb(h, torch.arange(7)[None])
    with torch.no_grad(), in_bm_forward():
        plain_attn, plain_mlp = attn(h, emb, None)[0], mlp(h)

        def lora_like(self, x):  # as bm.runtime.lora._lora_forward: the layer's own output, then a delta
            return torch.nn.Linear.forward(self, x) + 0.5

        attn.k_proj.forward = types.MethodType(lora_like, attn.k_proj)
        got = attn(h, emb, None)[0]
        assert torch.equal(got, attn.forward._own(h, emb, None)[0]) and not torch.equal(got, plain_attn)
        del attn.k_proj.forward
        assert torch.equal(attn(h, emb, None)[0], plain_attn)  # stacked again once it is gone

        handle = mlp.up_proj.register_forward_hook(lambda module, args, out: out * 2)
        got = mlp(h)
        assert torch.equal(got, mlp.forward._own(h)) and not torch.equal(got, plain_mlp)
        handle.remove()

        wrapped = attn.q_proj  # a PEFT-style wrapper module in place of the linear
        attn.q_proj = torch.nn.Sequential(wrapped)
        assert torch.equal(attn(h, emb, None)[0], attn.forward._own(h, emb, None)[0])
        attn.q_proj = wrapped
        assert attn.forward._current(h) is not None


def test_peft_lora_on_a_stacked_model_computes_the_adapted_model():
    peft = pytest.importorskip("peft")
    model = tiny()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    torch.manual_seed(9)
    adapted = peft.get_peft_model(copy.deepcopy(model), config).eval()
    expected = logits(adapted, ids)
    assert not torch.allclose(logits(model, ids), expected)  # the adapter changes the logits
    fuse_projections(model)
    torch.manual_seed(9)
    stacked = peft.get_peft_model(model, config).eval()
    torch.testing.assert_close(logits(stacked, ids), expected, rtol=1e-5, atol=1e-5)


def test_a_weight_replaced_after_stacking_is_noticed_and_one_changed_in_place_is_followed():
    model = tiny()
    fuse_projections(model)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    h = torch.randn(1, 5, 40)
    emb = model.model.rotary_emb(h, torch.arange(5)[None])
    with torch.no_grad(), in_bm_forward():
        attn.v_proj.weight.mul_(3)  # through the view: the stacked tensor changes with it
        assert attn.forward._current(h) is not None
        torch.testing.assert_close(attn(h, emb, None)[0], attn.forward._own(h, emb, None)[0])
        attn.q_proj.weight = torch.nn.Parameter(torch.randn(40, 40))  # a new tensor: not the view
        assert attn.forward._current(h) is None
        assert torch.equal(attn(h, emb, None)[0], attn.forward._own(h, emb, None)[0])
        mlp.gate_proj.weight.data = mlp.gate_proj.weight.data.clone()  # .data replaced (as .to() does)
        assert mlp.forward._current(h) is None
        assert torch.equal(mlp(h), mlp.forward._own(h))


def test_deepcopy_pickle_and_torch_save_of_a_stacked_model_stack_again_on_first_use():
    """A copy's projections get weights of their own (a deep copy clones each Parameter; a pickle writes
    each view with its whole storage); its first fused call stacks them again, back to one copy."""
    model = tiny()
    if elementwise_kernels() is not None:
        fuse_elementwise(model)  # the stacked MLP is then a fused elementwise MLP, rebuilt as those are
    fuse_projections(model)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(4))
    expected = logits(model, ids)
    nbytes = storage_bytes(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), saved):
        attn, mlp = clone.model.layers[0].self_attn, clone.model.layers[0].mlp
        assert isinstance(attn.forward, _StackedAttention) and attn.forward._module is attn
        assert mlp.forward._module is mlp
        assert attn.q_proj.weight.data_ptr() != model.model.layers[0].self_attn.q_proj.weight.data_ptr()
        assert torch.equal(logits(clone, ids), expected)
        assert storage_bytes(clone) == nbytes  # stacked again: each weight stored once
        storage = attn.q_proj.weight.untyped_storage().data_ptr()
        assert attn.v_proj.weight.untyped_storage().data_ptr() == storage
        assert torch.equal(logits(clone, ids, bm=False), logits(model, ids, bm=False))


def test_modules_that_are_not_llama_code_are_left_alone():
    """Olmo's attention clamps q/k/v (clip_qkv): another forward, so nothing is stacked there; its MLP is
    Llama's and is."""
    torch.manual_seed(0)
    config = OlmoConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, clip_qkv=2.0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    assert fuse_projections(model) == {"qkv": 0, "gate_up": 1}
    assert "forward" not in vars(model.model.layers[0].self_attn)


def test_projections_that_do_not_line_up_are_not_stacked():
    """Stacking needs one input width, one dtype and biases on all or none; anything else keeps the
    module's own forward and its weights untouched."""
    model = tiny()
    first, second = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    first.k_proj = torch.nn.Linear(48, 20, bias=False)  # another input width
    second.v_proj = torch.nn.Linear(40, 20, bias=True)  # a bias where q and k have none
    mlp = model.model.layers[0].mlp
    mlp.up_proj.to(torch.float64)
    left = [first.q_proj, first.k_proj, first.v_proj, second.q_proj, second.k_proj, mlp.gate_proj]
    weights = [linear.weight.data_ptr() for linear in left]
    assert fuse_projections(model) == {"qkv": 0, "gate_up": 1}  # the second layer's MLP only
    assert "forward" not in vars(first) and "forward" not in vars(second) and "forward" not in vars(mlp)
    assert [linear.weight.data_ptr() for linear in left] == weights


def test_unfuse_gives_back_the_own_forwards_and_the_fused_elementwise_mlp():
    if elementwise_kernels() is None:
        pytest.skip("bm's C kernels do not build here")
    model = tiny()
    fuse_elementwise(model)
    fuse_projections(model)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.forward, _StackedFusedMLP) and isinstance(mlp.forward, _FusedMLP)
    unfuse_projections(model)
    assert type(mlp.forward) is _FusedMLP
    assert "forward" not in vars(model.model.layers[0].self_attn)


def test_fused_projections_modes_stack_only_cuda_16_bit_models():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert should_fuse_projections("auto", cuda, torch.bfloat16)
    assert should_fuse_projections("on", cuda, torch.float16)
    assert not should_fuse_projections("auto", cuda, torch.float32)  # the fp32 oracle keeps HF's GEMMs
    assert not should_fuse_projections("auto", cpu, torch.bfloat16)
    assert not should_fuse_projections("off", cuda, torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"model\.fused_projections is on, but .*float32 on cpu.*auto or off"
    ):
        should_fuse_projections("on", cpu, torch.float32)


def test_fused_projections_on_is_refused_at_load_where_unsupported_and_off_stacks_nothing():
    with pytest.raises(ValueError, match=r"model\.fused_projections is on"):
        load_model(ModelConfig(device="cpu", seed=0, fused_projections="on"))
    loaded = describe_model(tiny(), None, "tiny", prepack="off", fused_projections="off")
    assert loaded.fused_projections == {}
    assert "forward" not in vars(loaded.model.model.layers[0].self_attn)


def test_model_fused_projections_config_takes_auto_on_off_and_yaml_booleans():
    for value, expected in (("auto", "auto"), ("OFF", "off"), (False, "off"), (True, "on")):
        assert load_config(None, {"model.fused_projections": value}).model.fused_projections == expected
    with pytest.raises(ConfigError, match=r"model\.fused_projections: unknown value 'sometimes'"):
        load_config(None, {"model.fused_projections": "sometimes"})
