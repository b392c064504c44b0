"""One GEMM for a layer's q/k/v projections and one for its gate/up pair, inside bm forwards only.

Measured on an H100 (Llama-3.2-1B shape, bfloat16, a decode step of 256 rows): the step ran 113 cuBLAS
GEMMs, 7 per layer, about 1.49 ms of a 4 ms step. The small k and v projections (2048 x 512 each) ran at
about 0.36 TB/s of weight bytes, the gate and up pair at about 2.0, q, o and down at about 1.5: a GEMM
with few output columns cannot fill the GPU. Reading the same input once against the stacked weight of
the projections that share it (q/k/v: [q + 2 kv, hidden]; gate/up: [2 intermediate, hidden]) makes two
GEMMs of the step's five per layer do the work of five.

What is replaced, matched by source text as in :mod:`bm.runtime.fusion`:

* attention modules whose ``forward`` is, line for line, transformers' Llama attention, or its Mistral,
  Qwen2 (sliding-window argument) or Qwen3 (q/k norms) copies: q, k and v come from one ``F.linear``
  (biases too, as Qwen2 has them), split into views; the rest is transformers' code, the rotary through
  the modeling module's ``apply_rotary_pos_emb`` global (so bm's fused rotary still applies) and the
  attention through the registered interface. Where that global is bm's fused rotary and the forward's
  attention backend stores keys and values in the same launch (the Triton backend:
  bm.runtime.attention.rotate_and_store), the queries come rotated from that launch instead, and the
  attention call is told the layer's keys and values are stored;
* gated MLPs whose ``forward`` is Llama's: gate and up from one ``F.linear``, then SiLU(gate) * up (the
  fused elementwise kernel where :mod:`bm.runtime.fusion` installed one: it reads the two halves of the
  [tokens, 2 * intermediate] product in place, by row stride) and the down projection.

Memory is not doubled: the stacked weight is stored once and the projections' own parameters become row
views of it (``param.data`` is set, so each Parameter keeps its identity). ``model.parameters()`` and
``state_dict()`` list the same tensors with the same shapes and values as before, counting every byte
once; HF's own forward (``generate()`` in the oracle tests, anything outside a bm forward) multiplies by
the views and computes what it computed before.

Where: ``model.fused_projections: auto`` fuses CUDA models in float16 and bfloat16 only. A GEMM of another
width may run another cuBLAS kernel, with another summation order, so the fused path is not bitwise
transformers'; a float32 model on a GPU is the project's oracle (bm equals HF ``generate()`` bit for bit)
and keeps transformers' GEMMs. On the CPU bm's packed GEMMs (bm.runtime.prepack) already serve each
projection; :func:`fuse_projections` still works there, which is how the tests pin it.

The stacked path is used only while it computes what the separate projections would: each call checks
that every projection is a plain ``nn.Linear`` called as itself (no LoRA forward, no PEFT wrapper, no
forward hook: a tensor-parallel plan's all-reduce is one) and that its weight and bias are still the views
installed (a weight replaced, or moved by ``.to()``, has another address). Otherwise the module's own
forward runs, as does a call with an HF cache (bm's forwards pass none: its attention keeps the KV; the
cache is ``cache`` in recent transformers and ``past_key_values`` in earlier 5.x, and either is taken). A
weight changed in place changes the stacked tensor with it. Deep copies and pickles of a
fused model copy each projection's weight apart; their first fused call stacks them again (never while a
CUDA graph is being captured).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import types
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from bm.runtime.attention import ATTENTION_NAME, in_bm_forward, rotate_and_store
from bm.runtime.fusion import _FusedMLP, _FusedRotary, source_body, switched_on
from bm.runtime.prepack import has_forward_hooks

STACKED_DTYPES = (torch.float16, torch.bfloat16)


class _Variant(NamedTuple):
    """How a matched attention forward departs from Llama's: q/k norms after the projections, and the
    sliding-window argument of its attention call (None, from ``self.sliding_window``, or the config's)."""

    qk_norm: bool
    sliding: str | None


# reference forwards: (modeling module, attention class) -> the variant their source is
_ATTENTION_REFERENCES = {
    ("llama", "LlamaAttention"): _Variant(False, None),
    ("mistral", "MistralAttention"): _Variant(False, "config"),
    ("qwen2", "Qwen2Attention"): _Variant(False, "attribute"),
    ("qwen3", "Qwen3Attention"): _Variant(True, "attribute"),
}


@cache
def _references() -> dict[str, Any]:
    """Source texts of the attention forwards (each a variant) and of Llama's MLP forward."""
    attention: dict[str, _Variant] = {}
    for (family, name), variant in _ATTENTION_REFERENCES.items():
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        cls = getattr(module, name, None)
        body = source_body(cls.forward) if cls is not None else None
        if body is not None:
            attention.setdefault(body, variant)
    from transformers.models.llama import modeling_llama

    return {"attention": attention, "mlp": source_body(modeling_llama.LlamaMLP.forward)}


@cache
def _attention_variant(fn: Callable) -> _Variant | None:
    body = source_body(fn)
    return None if body is None else _references()["attention"].get(body)


@cache
def _is_llama_mlp(fn: Callable) -> bool:
    reference = _references()["mlp"]
    return reference is not None and source_body(fn) == reference


def projections_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``model.fused_projections`` cannot stack this model's projections, or None when it can."""
    if device.type != "cuda" or dtype not in STACKED_DTYPES:
        return (
            "the stacked q/k/v and gate/up GEMMs are for CUDA models in float16 or bfloat16 (in float32 a "
            f"GPU keeps transformers' own GEMMs, bitwise HF's: the oracle); the model is {dtype} on {device}"
        )
    return None


def should_fuse_projections(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """``on`` stacks wherever supported (raising where not), ``auto`` where supported, ``off`` never."""
    return switched_on("model.fused_projections", mode, lambda: projections_supported(device, dtype))


def fuse_projections(model: nn.Module) -> dict[str, int]:
    """Stack the q/k/v and gate/up projections of every matching module of ``model``, on any device and
    dtype (:func:`should_fuse_projections` decides where bm does it); returns how many of each.

    Run it after :func:`bm.runtime.fusion.fuse_elementwise`: an MLP that already runs the fused SiLU-mul
    kernel keeps it. A module whose projections are wrapped, hooked or do not line up is left as it is."""
    counts = {"qkv": 0, "gate_up": 0}
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, (_StackedAttention, _StackedMLP, _StackedFusedMLP)):
            continue
        variant = _attention_variant(type(module).forward)
        if variant is not None and all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            stacked: Any = _StackedAttention(module, variant)
            kind = "qkv"
        elif _is_llama_mlp(type(module).forward) and all(
            hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")
        ):
            if isinstance(forward, _FusedMLP):
                stacked = _StackedFusedMLP(module, forward._kernels)
            elif forward is None:
                stacked = _StackedMLP(module)
            else:
                continue  # another forward of bm's (or a user's) is installed: leave it
            kind = "gate_up"
        else:
            continue
        if stacked.install():
            module.forward = stacked
            counts[kind] += 1
    return counts


def unfuse_projections(model: nn.Module) -> None:
    """Give the stacked modules their forwards back (the fused elementwise MLP where there was one); the
    parameters stay views of the stacked weights, with the same values, so nothing is copied."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, _StackedFusedMLP):
            module.forward = _FusedMLP(module, forward._kernels)
        elif isinstance(forward, (_StackedAttention, _StackedMLP)):
            del module.forward


def _plain(linear: nn.Module) -> bool:
    """Whether calling ``linear`` computes exactly ``F.linear(x, weight, bias)``: an ``nn.Linear`` (or a
    subclass keeping its forward) with no forward of its own installed (LoRA, a packed GEMM) and no hooks."""
    return (
        isinstance(linear, nn.Linear)
        and type(linear).forward is nn.Linear.forward
        and "forward" not in linear.__dict__
        and not has_forward_hooks(linear)
    )


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class _Stack:
    """The weights (and biases) of linears reading one input, as row blocks of one tensor whose views the
    linears' parameters are; one ``F.linear`` gives all of their outputs."""

    def __init__(self, linears: Sequence[nn.Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.sizes = [linear.out_features for linear in linears]
        self._keys = [(_address(linear.weight), _address(linear.bias)) for linear in linears]

    @classmethod
    def build(cls, linears: Sequence[nn.Linear]) -> _Stack | None:
        """Stack ``linears`` (all plain, one input width, one dtype and device, biases all or none), their
        parameters becoming views of the result; None, with nothing changed, where they do not line up."""
        if not all(_plain(linear) for linear in linears):
            return None
        first = linears[0].weight
        has_bias = linears[0].bias is not None
        for linear in linears:
            weight, bias = linear.weight, linear.bias
            if (
                type(weight.data) is not torch.Tensor  # a sharded DTensor, a quantized weight
                or weight.is_meta
                or weight.dim() != 2
                or weight.shape != (linear.out_features, first.shape[1])
                or (weight.dtype, weight.device) != (first.dtype, first.device)
                or (bias is not None) != has_bias
                or (
                    bias is not None
                    and (type(bias.data) is not torch.Tensor or bias.shape != weight.shape[:1])
                )
                or (bias is not None and (bias.dtype, bias.device) != (first.dtype, first.device))
            ):
                return None
        with torch.no_grad():
            weight = _stacked([linear.weight for linear in linears])
            bias = _stacked([linear.bias for linear in linears]) if has_bias else None
            try:
                row = 0
                for linear in linears:
                    rows = linear.out_features
                    linear.weight.data = weight[row : row + rows]
                    if bias is not None:
                        linear.bias.data = bias[row : row + rows]
                    row += rows
            except RuntimeError:  # e.g. inference tensors: the projections keep (or got) equal values
                return None
        return cls(linears, weight, bias)

    def serves(self, linears: Sequence[nn.Linear]) -> bool:
        """Whether one GEMM over the stack still computes what calling ``linears`` would."""
        return all(
            _plain(linear)
            and (_address(linear.weight), _address(linear.bias)) == key
            and linear.weight.shape[0] == size
            for linear, key, size in zip(linears, self._keys, self.sizes, strict=True)
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _stacked(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, or a view of the storage they already share where they lie in it one after
    the other (a model stacked before, saved and loaded with ``torch.save``): no copy then."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    shape, strides = (rows, *first.shape[1:]), first.stride()
    offset = first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for part in parts:
        if (
            not part.is_contiguous()
            or part.untyped_storage().data_ptr() != storage
            or (part.storage_offset() != offset)
        ):
            return torch.cat([p.detach() for p in parts])
        offset += part.numel()
    return first.detach().as_strided(shape, strides)


class _Stacked:
    """A module's forward with some of its projections as one GEMM inside bm forwards; its own otherwise.
    The stack is built when installed; a deep copy or a pickle builds it again on its first fused call."""

    _names: tuple[str, ...] = ()

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._own = types.MethodType(type(module).forward, module)
        self._stack: _Stack | None = None
        self._pending = True  # not stacked yet in this copy of the model

    def install(self) -> bool:
        """Stack the projections now; whether they could be."""
        self._stack = _Stack.build([getattr(self._module, name) for name in self._names])
        self._pending = self._stack is None
        return self._stack is not None

    def _current(self, x: torch.Tensor) -> _Stack | None:
        """The stack, where this call inside a bm forward may use it; else None (the own forward runs)."""
        if not in_bm_forward() or torch.is_grad_enabled():
            return None
        linears = [getattr(self._module, name) for name in self._names]
        if self._pending and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.install()
        stack = self._stack
        return stack if stack is not None and stack.serves(linears) else None

    def __deepcopy__(self, memo: dict) -> _Stacked:
        return type(self)(copy.deepcopy(self._module, memo), *self._init_args())

    def __reduce__(self):
        return (_rebuild, (type(self), self._module, *self._init_args()))

    def _init_args(self) -> tuple:
        return ()


def _rebuild(cls: type[_Stacked], module: nn.Module, *args: Any) -> _Stacked:
    return cls(module, *args)


class _StackedAttention(_Stacked):
    """A Llama-family attention forward with q, k and v from one GEMM; otherwise transformers' code."""

    _names = ("q_proj", "k_proj", "v_proj")

    def __init__(self, module: nn.Module, variant: _Variant) -> None:
        super().__init__(module)
        self._variant = variant
        # the modeling module's globals, as the forward's source reads them (its rotary may be bm's)
        own = inspect.unwrap(type(module).forward)
        self._globals = own.__globals__
        # the fourth parameter is the HF cache: ``cache`` in recent transformers, ``past_key_values``
        # in earlier 5.x releases (5.17 on the GPU machines); the rest of the source is the same
        self._cache_name = list(inspect.signature(own).parameters)[4]

    def _init_args(self) -> tuple:
        return (self._variant,)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        # the cache under whichever name this transformers gives it, positional or not; a bm forward
        # passes none (bm's attention keeps the KV), and a call with one runs the module's own forward
        cache = args[0] if args else kwargs.get(self._cache_name)
        stack = None if cache is not None or len(args) > 1 else self._current(hidden_states)
        if stack is None:
            return self._own(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != self._cache_name}
        m, g = self._module, self._globals
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, m.head_dim)
        q, k, v = (t.view(hidden_shape) for t in stack(hidden_states))
        if self._variant.qk_norm:
            q, k = m.q_norm(q), m.k_norm(k)
        query_states, key_states, value_states = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        cos, sin = position_embeddings
        rotated = self._rotate_and_store(q, k, v, cos, sin)
        if rotated is not None:  # keys rotated and stored with the values: attention reads the cache
            query_states = rotated.transpose(0, 1)[None]
            kwargs["kv_stored"] = True
        else:
            query_states, key_states = g["apply_rotary_pos_emb"](query_states, key_states, cos, sin)

        attention_interface: Callable = g["ALL_ATTENTION_FUNCTIONS"].get_interface(
            m.config._attn_implementation, g["eager_attention_forward"]
        )
        if self._variant.sliding == "attribute":
            kwargs["sliding_window"] = m.sliding_window
        elif self._variant.sliding == "config":
            kwargs["sliding_window"] = getattr(m.config, "sliding_window", None)
        attn_output, attn_weights = attention_interface(
            m,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not m.training else m.attention_dropout,
            scaling=m.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = m.o_proj(attn_output)
        return attn_output, attn_weights

    def _rotate_and_store(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """The rotated queries ``[T, heads, d]`` where the forward's attention rotates them and stores the
        rotated keys with the values in one launch (bm.runtime.attention.rotate_and_store, the Triton
        backend's), else None. Only for Llama's rotary, which bm's fused rotary stands in for in the
        modeling module (:class:`bm.runtime.fusion._FusedRotary`: its source matched), over ``q``/``k``/``v``
        ``[1, T, heads, d]`` and ``cos``/``sin`` ``[1, T, d]``, with bm's attention registered."""
        m = self._module
        tokens, d = q.shape[1], q.shape[3]
        if (
            not isinstance(self._globals.get("apply_rotary_pos_emb"), _FusedRotary)
            or m.config._attn_implementation != ATTENTION_NAME
            or q.shape[0] != 1
            or cos.shape != (1, tokens, d)
            or sin.shape != cos.shape
        ):
            return None
        return rotate_and_store(m, q[0], k[0], v[0], cos[0], sin[0])


class _StackedMLP(_Stacked):
    """Llama's gated MLP with gate and up from one GEMM, its activation as the module has it (the model
    runs without bm's fused elementwise kernels)."""

    _names = ("gate_proj", "up_proj")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        stack = self._current(x)
        if stack is None:
            return self._own(x)
        m = self._module
        gate, up = stack(x)
        return m.down_proj(m.act_fn(gate) * up)


class _StackedFusedMLP(_FusedMLP):
    """bm's fused elementwise MLP (bm.runtime.fusion) with gate and up from one GEMM; the SiLU-mul kernel
    reads the halves of the product in place. Copies and pickles rebuild it as :class:`_FusedMLP` does."""

    def __init__(self, module: nn.Module, kernels: Any) -> None:
        super().__init__(module, kernels)
        self._stacked = _StackedMLP(module)  # holds the stack; its own forward is never called

    def install(self) -> bool:
        """Stack gate and up now; whether they could be."""
        return self._stacked.install()

    def _gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stack = self._stacked._current(x)
        if stack is None:
            return super()._gate_up(x)
        gate, up = stack(x)
        return gate, up
