"""Route attention of models with their own attention classes through bm's paged attention.

Most transformers models call the function registered in ``AttentionInterface``; bloom, mpt and falcon
(and gptj and codegen before transformers 5.24) compute attention inline in their attention modules. For
those, the module's projections, head splitting and rotary embeddings stay theirs; only the attention
itself (scores, mask, softmax, values) is handed to :func:`bm.runtime.attention.paged_attention_forward`,
with ALiBi slopes attached to the module where the model biases scores by distance.

An adapted module runs its original code, with the arguments it was given, whenever no bm forward is in
progress, so a copy of the model (the tests' HF reference, for one) still computes attention as
transformers does.

These adapters rest on transformers' private call signatures, which change between releases (MPT's
``past_key_values`` became ``cache`` in 5.24). So each adapter lists the signatures it was written for,
and a class whose method matches none of them is refused at load with one line naming the class and the
tested transformers range, instead of breaking HF or bm at run time. A class that no longer has the
method at all (gptj's ``_attn`` from 5.24 on) calls ``AttentionInterface`` instead and needs no adapter;
:func:`bm.runtime.attention.probe_kv_shapes` refuses a model whose attention never reaches bm.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bm.runtime.attention import ALIBI_ATTR, UnsupportedAttentionError, in_bm_forward, paged_attention_forward

_ADAPTED_FLAG = "_bm_adapted"
# The transformers releases whose attention signatures the adapters below were checked against (the model
# matrix in tests/model_matrix.py passes on them). Raise the upper end after `make test-latest` passes.
TESTED_TRANSFORMERS = ">=5.0,<=5.24"


def _paged(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float):
    """``q`` [1, heads, T, d], ``k``/``v`` [1, kv_heads, T, d] -> [1, T, heads, d]."""
    out, _ = paged_attention_forward(module, q, k, v, None, scaling=scaling)
    return out


def _bloom_slopes(heads: int) -> torch.Tensor:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # The bias at the second position of an unpadded row is each head's slope times one: the slopes, bit
    # for bit, from the function every 5.x release has (the private helper 5.24 uses is missing in 5.17).
    return build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1].contiguous()


def _mpt_slopes(heads: int, alibi_bias_max: float) -> torch.Tensor:
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    # MPT's bias at key j for the last query is slope * (j - last): two positions give -slope.
    return -build_mpt_alibi_tensor(heads, 2, alibi_bias_max)[:, 0, 0].float()


def _bloom_forward(self, hidden_states, residual, *args, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add

    if not in_bm_forward():
        return type(self).forward(self, hidden_states, residual, *args, **kwargs)
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # [1, heads, T, d] each
    out = _paged(self, q, k, v, self.inv_norm_factor)
    out = self.dense(out.reshape(out.shape[0], out.shape[1], -1))
    return dropout_add(out, residual, self.hidden_dropout, self.training), None


def _mpt_forward(self, hidden_states, *args, **kwargs):
    if not in_bm_forward():
        return type(self).forward(self, hidden_states, *args, **kwargs)
    batch, length = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (x.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2) for x in qkv.chunk(3, 2))
    out = _paged(self, q, k, v, self.softmax_scale)
    return self.out_proj(out.reshape(batch, length, -1)), None


def _falcon_forward(self, hidden_states, alibi, *args, **kwargs):
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    if not in_bm_forward():
        return type(self).forward(self, hidden_states, alibi, *args, **kwargs)
    batch, length, _ = hidden_states.shape
    fused = self.query_key_value(hidden_states)
    d = self.head_dim
    if self.new_decoder_architecture:  # grouped: per kv head, its query heads then one key and one value
        qkv = fused.view(batch, length, -1, self.num_heads // self.num_kv_heads + 2, d)
        q = qkv[:, :, :, :-2].flatten(2, 3)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
    else:
        q, k, v = self._split_heads(fused)  # multi-query: one key and value head
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [1, heads, T, d]
    if alibi is None:
        cos, sin = kwargs["position_embeddings"]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = _paged(self, q, k, v, self.inv_norm_factor)
    return self.dense(out.reshape(batch, length, -1)), None


def _rotary_attn(self, query, key, value, *args, **kwargs):
    """gptj/codegen: ``_attn`` receives rotated [1, heads, T, d] queries and keys; return its shape."""
    if not in_bm_forward():
        return type(self)._attn(self, query, key, value, *args, **kwargs)
    out = _paged(self, query, key, value, 1.0 / float(self.scale_attn))
    return out.transpose(1, 2), None


def _falcon_slopes(module: torch.nn.Module, config: Any) -> torch.Tensor | None:
    # Falcon adds the bias before scaling: (q.k + alibi) * inv_norm, so its slopes are scaled too.
    return _bloom_slopes(module.num_heads) * module.inv_norm_factor if config.alibi else None


Slopes = Callable[[torch.nn.Module, Any], "torch.Tensor | None"]


@dataclass(frozen=True)
class _Adapter:
    """One attention class bm takes over: which method, the signatures it was written for, and how."""

    method: str
    # Each accepted signature as parameter names, ``**kwargs`` written as "**" (see _signature_of).
    signatures: tuple[tuple[str, ...], ...]
    replacement: Callable
    slopes: Slopes


_BLOOM = ("self", "hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache")
_FALCON = ("self", "hidden_states", "alibi", "attention_mask", "position_ids", "layer_past", "use_cache")
_ROTARY = (("self", "query", "key", "value", "attention_mask"),)

# attention class name -> its adapter. The signatures are those of transformers 5.0 to 5.24.
_ADAPTERS: dict[str, _Adapter] = {
    "BloomAttention": _Adapter(
        "forward",
        ((*_BLOOM, "output_attentions", "cache_position"), (*_BLOOM, "output_attentions", "**")),
        _bloom_forward,
        lambda m, c: _bloom_slopes(m.num_heads),
    ),
    "MptAttention": _Adapter(
        "forward",
        (
            ("self", "hidden_states", "position_bias", "past_key_values", "attention_mask", "cache_position"),
            ("self", "hidden_states", "position_bias", "past_key_values", "attention_mask", "**"),
            ("self", "hidden_states", "position_bias", "cache", "attention_mask", "**"),
        ),
        _mpt_forward,
        lambda m, c: _mpt_slopes(m.n_heads, c.attn_config.alibi_bias_max) if c.attn_config.alibi else None,
    ),
    "FalconAttention": _Adapter(
        "forward",
        (
            (*_FALCON, "output_attentions", "cache_position", "position_embeddings"),
            (*_FALCON, "output_attentions", "position_embeddings", "**"),
        ),
        _falcon_forward,
        _falcon_slopes,
    ),
    "GPTJAttention": _Adapter("_attn", _ROTARY, _rotary_attn, lambda m, c: None),
    "CodeGenAttention": _Adapter("_attn", _ROTARY, _rotary_attn, lambda m, c: None),
}


def _signature_of(fn: Callable) -> tuple[str, ...]:
    """A method's parameters as names, ``*args`` as "*" and ``**kwargs`` as "**" (their names vary)."""
    names = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            names.append("*")
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            names.append("**")
        else:
            names.append(p.name)
    return tuple(names)


def check_adapter_signature(cls: type) -> _Adapter | None:
    """The adapter for ``cls``, or None when bm need not adapt it; refuses a changed signature.

    None for a class bm has no adapter for, and for one that no longer defines the adapted method (it then
    calls ``AttentionInterface`` like any other model). A signature the adapter was not written for
    raises :class:`UnsupportedAttentionError` naming the class and the tested transformers range.
    """
    adapter = _ADAPTERS.get(cls.__name__)
    if adapter is None or adapter.method not in vars(cls):
        return None
    found = _signature_of(getattr(cls, adapter.method))
    if found not in adapter.signatures:
        import transformers

        raise UnsupportedAttentionError(
            f"{cls.__name__}.{adapter.method}({', '.join(found[1:])}) is not the signature bm's adapter was "
            f"written for (tested with transformers{TESTED_TRANSFORMERS}; this is {transformers.__version__}): "
            f"install a tested transformers, or use another model"
        )
    return adapter


def adapt_attention_modules(model: torch.nn.Module) -> int:
    """Adapt every attention module bm knows to take over; returns how many were adapted.

    Idempotent. The replacement is an instance attribute wrapping the class's own method, so the class
    (shared with any other copy of the model) is left alone. Each class's signature is checked once,
    before any module is changed, so a refused model is left as it was.
    """
    adapters = {cls: check_adapter_signature(cls) for cls in {type(m) for m in model.modules()}}
    config = model.config.get_text_config()
    count = 0
    for module in model.modules():
        adapter = adapters[type(module)]
        if adapter is None or getattr(module, _ADAPTED_FLAG, False):
            continue
        setattr(module, adapter.method, _Bound(adapter.replacement, module))
        alibi = adapter.slopes(module, config)
        if alibi is not None:
            setattr(module, ALIBI_ATTR, alibi.to(next(model.parameters()).device))
        setattr(module, _ADAPTED_FLAG, True)
        count += 1
    return count


class _Bound:
    """A method bound to its module by reference, that ``copy.deepcopy`` re-binds to the copy."""

    def __init__(self, fn: Callable, module: torch.nn.Module) -> None:
        self.fn = fn
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _Bound:
        return _Bound(self.fn, copy.deepcopy(self.module, memo))
