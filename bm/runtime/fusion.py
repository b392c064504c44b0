"""A decoder layer's elementwise chains as single C passes, inside bm forwards only.

transformers' eager Llama-family layers spend, per layer and forward, seven torch operations on each
RMSNorm, fourteen on rotary embedding (query and key) and two on SiLU(gate) * up. On SmolLM2-135M's
shape (30 layers) the torch profiler put these at about 8% of a run, most of it dispatch at decode
sizes and repeated trips to memory at prefill sizes. bm replaces each chain by one call into
``native/elementwise.c`` (bm.runtime.native.ElementwiseKernels):

* RMSNorm modules whose ``forward`` is, line for line, transformers' Llama RMSNorm (the copies in Mistral,
  Qwen2/3, SmolLM3, Granite, ... match; Gemma's ``1 + weight`` and every other variant do not);
* MLP modules whose ``forward`` is Llama's gated MLP and whose activation is SiLU: ``silu(g) * u`` in one
  pass after the model's own (packed, LoRA-wrapped) gate and up linears, or, where those are bm's packed
  GEMMs with nothing wrapped around them and the build is AVX-512, gate, up and SiLU in one GEMM pass
  (docs/cpu-kernels.md, "fused epilogues");
* the modeling module's ``apply_rotary_pos_emb`` where it is Llama's, for [1, heads, tokens, d] queries
  and keys with one row of cos/sin per token (the packed batch bm runs).
* decoder layers whose ``forward`` is Llama's, around a fused post-attention norm: the residual add after
  attention and that norm become one pass (``add_rms_norm``), bitwise the add then the norm; the last
  residual add rides on the down projection's GEMM where the MLP's fused pass runs.

On a CUDA model the same four chains run as Triton kernels (bm.runtime.triton.elementwise), in the
model's dtype with transformers' roundings; the decoder layer's last residual add stays a torch add there.

Each replacement computes the same formula (rotary and the products bit for bit; RMSNorm's mean and
SiLU's exp differ from torch's by float rounding; in bfloat16 every intermediate torch rounds is
rounded too) and runs only inside a bm forward, on tensors its kernels take (float32 CPU for the C
passes, and bfloat16 in their AVX-512 build; CUDA for the Triton ones): the same module called by
anything else (``generate()`` in the oracle tests) runs transformers' code. Which modules match is
decided by comparing source text, not class names, so a new architecture that copies Llama's code is
covered and one that changes a line is left alone.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

from bm.runtime.attention import in_bm_forward
from bm.runtime.native import ElementwiseKernels, elementwise_kernels
from bm.runtime.prepack import fusable_gemm, has_forward_hooks
from bm.runtime.triton import triton_available

_ROTARY_NAME = "apply_rotary_pos_emb"


def source_body(fn: Callable) -> str | None:
    """``fn``'s source without decorators or its first line's indentation; None where unavailable: what
    decides whether a module runs transformers' Llama code (here and in bm.runtime.fused_projections)."""
    try:
        lines = inspect.getsource(inspect.unwrap(fn)).splitlines()
    except (OSError, TypeError):
        return None
    while lines and lines[0].lstrip().startswith("@"):
        lines.pop(0)
    indent = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
    return "\n".join(line[indent:] for line in lines)


@cache
def _reference_bodies() -> dict[str, str | None]:
    from transformers.models.llama import modeling_llama as llama

    return {
        "rms_norm": source_body(llama.LlamaRMSNorm.forward),
        "mlp": source_body(llama.LlamaMLP.forward),
        "rotary": source_body(llama.apply_rotary_pos_emb),
        "decoder_layer": source_body(llama.LlamaDecoderLayer.forward),
    }


@cache
def _matches(fn: Callable, kind: str) -> bool:
    reference = _reference_bodies()[kind]
    return reference is not None and source_body(fn) == reference


def fusion_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused chains cannot be used here, or None when they can."""
    if device.type == "cuda":
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the fused elementwise Triton kernels take float32, bfloat16 and float16, not {dtype}"
        if not triton_available():
            return "the fused elementwise kernels on CUDA are Triton kernels, and triton is not installed"
        return None
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return (
            "fused elementwise kernels are float32 or bfloat16 CPU code, or CUDA code; "
            f"the model is {dtype} on {device}"
        )
    kernels = elementwise_kernels()
    if kernels is None:
        return "bm's C kernels could not be built here (no C compiler, or BM_NATIVE_KERNELS=0)"
    if dtype not in kernels.dtypes:
        return f"bm's {kernels.isa} build of the fused elementwise kernels is float32 only (bf16: AVX-512)"
    return None


def kernels_for(device: torch.device) -> ElementwiseKernels | Any | None:
    """The chains' kernels for a model on ``device``: Triton's on CUDA, bm's C passes on CPU."""
    if device.type == "cuda":
        from bm.runtime.triton.elementwise import TritonElementwise

        return TritonElementwise("cuda")
    return elementwise_kernels()


def should_fuse(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """``on`` fuses wherever supported (raising where not), ``auto`` where supported, ``off`` never."""
    return switched_on("model.fused_elementwise", mode, lambda: fusion_supported(device, dtype))


def switched_on(key: str, mode: str, why_not: Callable[[], str | None]) -> bool:
    """An ``auto | on | off`` speed knob against whether its path serves this model (``why_not()``: the
    reason it cannot, or None): ``on`` wherever it can and an error naming ``key`` where it cannot,
    ``auto`` where it can, ``off`` never."""
    if mode == "off":
        return False
    reason = why_not()
    if reason and mode == "on":
        raise ValueError(f"{key} is on, but {reason}; set it to auto or off")
    return reason is None


def fuse_elementwise(model: nn.Module, kernels: ElementwiseKernels | Any | None = None) -> dict[str, int]:
    """Install the fused chains on every matching module of ``model``; returns how many of each.
    ``kernels``: those of the model's device (:func:`kernels_for`) unless given."""
    if kernels is None:
        kernels = kernels_for(next(model.parameters()).device)
    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0, "decoder_layer": 0}
    if kernels is None:
        return counts
    modeling_modules = set()
    for module in model.modules():
        modeling_modules.add(type(module).__module__)
        forward = type(module).forward
        if isinstance(module.forward, _FusedForward):
            continue
        if _matches(forward, "rms_norm") and hasattr(module, "variance_epsilon"):
            module.forward = _FusedRMSNorm(module, kernels)
            counts["rms_norm"] += 1
        elif _matches(forward, "mlp") and _is_silu(getattr(module, "act_fn", None)):
            module.forward = _FusedMLP(module, kernels)
            counts["mlp"] += 1
    for module in model.modules():  # after the norms: a layer is fused only around a fused norm
        norm = getattr(module, "post_attention_layernorm", None)
        if (
            not isinstance(module.forward, _FusedForward)
            and _matches(type(module).forward, "decoder_layer")
            and isinstance(getattr(norm, "forward", None), _FusedRMSNorm)
        ):
            module.forward = _FusedDecoderLayer(module, kernels)
            counts["decoder_layer"] += 1
    for name in sorted(modeling_modules):
        namespace = sys.modules.get(name)
        rotary = getattr(namespace, _ROTARY_NAME, None)
        if isinstance(rotary, _FusedRotary):
            rotary.use(kernels)
            counts["rotary"] += 1
        elif rotary is not None and _matches(rotary, "rotary"):
            # The modeling module's global: its attention layers look it up by name on every call.
            setattr(namespace, _ROTARY_NAME, _FusedRotary(rotary, kernels))
            counts["rotary"] += 1
    return counts


def unfuse_elementwise(model: nn.Module, rotary: bool = False) -> None:
    """Give ``model``'s modules their own forwards back. The rotary global of their modeling modules
    stays unless ``rotary`` (outside a bm forward it is transformers' function anyway, and other models
    of the same family may share it); an A/B inside bm forwards needs it back too."""
    namespaces = set()
    for module in model.modules():
        namespaces.add(type(module).__module__)
        if isinstance(module.forward, _FusedForward):
            del module.forward
    for name in namespaces if rotary else ():
        namespace = sys.modules.get(name)
        fused = getattr(namespace, _ROTARY_NAME, None)
        if isinstance(fused, _FusedRotary):
            setattr(namespace, _ROTARY_NAME, fused.__wrapped__)


def _is_silu(act: object) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return type(act) is SiLUActivation


class _FusedForward:
    """A module's forward replaced inside bm forwards; its own otherwise. Copies and pickles rebuild it
    around the copied module (the kernels are a process-wide handle, never copied)."""

    def __init__(self, module: nn.Module, kernels: ElementwiseKernels) -> None:
        self._module = module
        self._own = types.MethodType(type(module).forward, module)
        self._kernels = kernels

    def __deepcopy__(self, memo: dict) -> _FusedForward:
        import copy

        return type(self)(copy.deepcopy(self._module, memo), self._kernels)

    def __reduce__(self):
        return (_rebuild, (type(self), self._module, getattr(self._kernels, "device_type", "cpu")))


def _rebuild(cls: type[_FusedForward], module: nn.Module, device_type: str = "cpu") -> Callable:
    kernels = kernels_for(torch.device(device_type))
    return cls(module, kernels) if kernels else types.MethodType(type(module).forward, module)


class _FusedRMSNorm(_FusedForward):
    """An RMSNorm's forward: one C pass inside a bm forward, the module's own otherwise."""

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self._module.weight
        if not (in_bm_forward() and self._kernels.accepts(hidden_states, weight)):
            return self._own(hidden_states)
        return self._kernels.rms_norm(hidden_states, weight.detach(), float(self._module.variance_epsilon))


class _FusedMLP(_FusedForward):
    """A gated SiLU MLP's forward: the model's gate/up/down linears, with ``silu(g) * u`` in one pass.

    Where the three linears are bm's packed GEMMs (no LoRA adapter attached, no bias on gate and up) and
    its build fuses epilogues (AVX-512), gate, up and the activation are one GEMM pass
    (SmallGemmKernel.gated), and the decoder layer's residual add rides on the down projection's:
    the same bits, without writing and reading back the [tokens, intermediate] products.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (in_bm_forward() and self._kernels.accepts(x)):
            return self._own(x)
        return self._mlp(x, None)

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, the decoder layer's last line, inside a bm forward."""
        if not self._kernels.accepts(x, residual):
            return residual + self._module(x)
        return self._mlp(x, residual)

    def _mlp(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        m = self._module
        gate_packed, up_packed = fusable_gemm(m.gate_proj), fusable_gemm(m.up_proj)
        if (
            gate_packed is not None
            and up_packed is not None
            and m.gate_proj.bias is None
            and m.up_proj.bias is None
            and m.gate_proj.out_features % 16 == 0
            and m.up_proj.out_features == m.gate_proj.out_features
        ):
            h = gate_packed[0].gated(x, gate_packed[1], up_packed[1], m.gate_proj.out_features)
        else:
            gate, up = self._gate_up(x)
            fits = self._kernels.accepts(gate, up)
            h = self._kernels.silu_mul(gate, up) if fits else m.act_fn(gate) * up
        down = fusable_gemm(m.down_proj) if residual is not None else None
        if down is None:
            out = m.down_proj(h)
            return out if residual is None else residual + out
        kernel, packed = down
        bias = m.down_proj.bias
        return kernel(h, packed, None if bias is None else bias.detach(), m.down_proj.out_features, residual)

    def _gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up projections of ``x``: the model's two linears here; one GEMM over their stacked
        weight in bm.runtime.fused_projections' subclass (CUDA, 16-bit)."""
        m = self._module
        return m.gate_proj(x), m.up_proj(x)


class _FusedDecoderLayer(_FusedForward):
    """Llama's decoder layer with the residual add after attention and the RMSNorm before the MLP in one C
    pass (bitwise the add then the fused norm), inside a bm forward; the layer's own forward otherwise.
    The add wrote a [tokens, hidden] tensor that the norm read straight back: at prefill sizes a trip to
    memory and a torch dispatch per layer."""

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        m = self._module
        inputs = dict(
            attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=use_cache
        )
        inputs.update(position_embeddings=position_embeddings, **kwargs)
        # the HF cache is ``cache`` in recent transformers and ``past_key_values`` in earlier 5.x (5.17
        # passes ``past_key_values=None`` in every call): only a cache given, under either name, is HF's
        given = cache if cache is not None else kwargs.get("past_key_values")
        if given is not None or not (in_bm_forward() and self._kernels.accepts(hidden_states)):
            return self._own(hidden_states, **inputs)
        residual = hidden_states
        hidden_states, _ = m.self_attn(hidden_states=m.input_layernorm(hidden_states), **inputs)
        norm = m.post_attention_layernorm
        if hidden_states.shape == residual.shape and self._kernels.accepts(
            hidden_states, residual, norm.weight
        ):
            eps = float(norm.variance_epsilon)
            residual, hidden_states = self._kernels.add_rms_norm(
                residual, hidden_states, norm.weight.detach(), eps
            )
        else:
            residual = residual + hidden_states
            hidden_states = norm(residual)
        mlp = getattr(m.mlp, "__dict__", {}).get("forward")
        if (
            isinstance(mlp, _FusedMLP)
            and hidden_states.shape[:-1] == residual.shape[:-1]
            and not has_forward_hooks(m.mlp)  # a hook runs only when the module is called
        ):
            return mlp.with_residual(hidden_states, residual)  # the add rides on the down GEMM
        return residual + m.mlp(hidden_states)


class _FusedRotary:
    """Llama's ``apply_rotary_pos_emb`` inside a bm forward: one C pass per tensor on the CPU, one Triton
    launch for both on the GPU.

    It replaces a modeling module's global, which every model of that family in the process shares, so it
    keeps kernels per device type: the latest fused model's on each (:meth:`use`). Holding one set, a CPU
    model fused first left a CUDA model of the same family in the process with transformers' rotary."""

    def __init__(self, original: Callable, kernels: ElementwiseKernels) -> None:
        self._original = original
        self._by_device: dict[str, Any] = {}
        self.use(kernels)
        self.__wrapped__ = original
        self.__doc__ = original.__doc__

    def use(self, kernels: ElementwiseKernels | Any) -> None:
        """Compute tensors on ``kernels``' device type with them from now on."""
        self._by_device[getattr(kernels, "device_type", "cpu")] = kernels

    def __call__(self, q, k, cos, sin, unsqueeze_dim: int = 1, *args, **kwargs):
        kernels = self._by_device.get(q.device.type)
        if (
            kernels is None
            or args
            or kwargs
            or unsqueeze_dim != 1
            or not in_bm_forward()
            or q.dim() != 4
            or k.dim() != 4
            or q.shape[0] != 1
            or k.shape[0] != 1
            or cos.dim() != 3
            or cos.shape != sin.shape
            or cos.shape[0] != 1
            or cos.shape[1:] != (q.shape[2], q.shape[3])
            or k.shape[2:] != q.shape[2:]
            or not kernels.accepts(q, k, cos, sin)
        ):
            return self._original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        # [1, heads, tokens, d] -> the kernel's [tokens, heads, d] and back (a view, as torch's ops give)
        c, s = cos[0], sin[0]
        qt, kt = q[0].transpose(0, 1), k[0].transpose(0, 1)
        pair = getattr(kernels, "rotary_pair", None)  # the GPU's: both in one launch
        q_out, k_out = pair(qt, kt, c, s) if pair is not None else (
            kernels.rotary(qt, c, s), kernels.rotary(kt, c, s)
        )  # fmt: skip
        return q_out.transpose(0, 1)[None], k_out.transpose(0, 1)[None]
