"""bm's paged attention, plugged into transformers through its public attention registry.

The model runs one packed, unpadded sequence of tokens (``[1, T]``) that holds every scheduled request:
context chunks and single generation tokens side by side. transformers computes the projections and
rotary embeddings as usual and calls :func:`paged_attention_forward` once per layer, which hands the
layer's queries, keys and values to the attention backend of the forward in progress
(:mod:`bm.runtime.backends`: bm's C kernels and SDPA on the CPU, Triton kernels on a GPU) with that
backend's own metadata for the batch. The metadata does not travel as a forward kwarg: some decoder
layers (stablelm's, for one) drop ``**kwargs`` before calling attention, so the runner makes it current
for the duration of each forward (:func:`forward_context`) and the attention function reads it there.

KV layout per layer: ``[2, num_kv_heads, num_blocks, tokens_per_block, head_dim]``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import AttentionInterface

ATTENTION_NAME = "bm_paged"

# Attention features some models pass per layer that bm does not implement, so a model using them fails
# loudly instead of running with silently different attention. (A native sliding window is honoured by
# the runner instead, per layer: see ModelRunner; soft-capping, ALiBi and sink logits are implemented.)
_UNSUPPORTED_KWARGS = {"sinks": "attention sinks passed as 'sinks'"}
# Set on an attention module by an adapter (bm.runtime.model_families): per query head ALiBi slopes, float32.
ALIBI_ATTR = "bm_alibi_slopes"


class UnsupportedAttentionError(RuntimeError):
    pass


@dataclass(slots=True)
class LayerExtras:
    """Per-layer changes to the scores that some models make; every backend applies them (one fused SDPA
    call cannot express them, so the torch backend writes such scores out)."""

    softcap: float | None  # Gemma 2: scores become softcap * tanh(scores / softcap)
    alibi: torch.Tensor | None  # [heads] slopes: slope * (key - query) is added to each score
    # [heads] float32: gpt-oss's learned sink logit per head, in the softmax's denominator only
    sinks: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return self.softcap is not None or self.alibi is not None or self.sinks is not None


NO_EXTRAS = LayerExtras(None, None)


@dataclass(slots=True)
class LayerCall:
    """One attention layer's call, as transformers made it: what a backend computes per layer."""

    layer: int  # the module's layer_idx: which KV cache and window (None only while probing: refused)
    query: torch.Tensor  # [heads, T, d]
    key: torch.Tensor  # [kv_heads, T, d]: the forward's new keys ...
    value: torch.Tensor  # ... and values
    scaling: float
    extras: LayerExtras
    # the keys (rotated) and values are in the layer's cache already, put there with the queries'
    # rotary by :func:`rotate_and_store`: the backend stores nothing, and ``key`` is not the rotated keys
    kv_stored: bool = False


class LayerAttention(Protocol):
    """What computes a layer's attention during a forward: an attention backend, or the shape probe."""

    def forward_layer(self, metadata: Any, call: LayerCall) -> torch.Tensor:
        """The layer's output ``[T, heads, d]`` for ``call``, with this forward's ``metadata``."""
        ...


_current = threading.local()


@contextmanager
def forward_context(attention: LayerAttention, metadata: Any) -> Iterator[None]:
    """Make ``attention`` with this forward's ``metadata`` what every paged attention call uses until the
    block exits. Per thread, so two runners in two threads never see each other's batch; nested uses
    restore the outer."""
    previous = getattr(_current, "forward", None)
    _current.forward = (attention, metadata)
    try:
        yield
    finally:
        _current.forward = previous


def in_bm_forward() -> bool:
    """Whether a bm forward is in progress on this thread (adapted modules otherwise run their own code)."""
    return getattr(_current, "forward", None) is not None


def rotate_and_store(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor | None:
    """The layer's queries ``[T, heads, d]`` with Llama's rotary embedding (``cos``/``sin`` ``[T, d]``), and
    its keys, rotated the same way, stored with its ``value`` ``[T, kv_heads, d]`` into the layer's cache,
    where the current forward's attention does all of that in one launch (the Triton backend's
    ``rotate_and_store``); None otherwise, and then nothing was done. After a result, the layer's
    attention call must say so (``kv_stored=True`` among its keyword arguments), or the keys it passes
    would be stored over the rotated ones."""
    current: tuple[LayerAttention, Any] | None = getattr(_current, "forward", None)
    layer = getattr(module, "layer_idx", None)
    fused = None if current is None else getattr(current[0], "rotate_and_store", None)
    if fused is None or layer is None:
        return None
    return fused(current[1], layer, query, key, value, cos, sin)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls per layer (registered as :data:`ATTENTION_NAME`): the current
    forward's attention over the layer's ``query`` [1, heads, T, d] and ``key``/``value`` [1, kv_heads, T, d]."""
    current: tuple[LayerAttention, Any] | None = getattr(_current, "forward", None)
    if current is None:
        raise UnsupportedAttentionError(
            "bm's paged attention ran outside a bm forward: a model set to it runs only inside "
            "ModelRunner.forward (the runner owns the KV cache it writes to)"
        )
    for name, feature in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedAttentionError(
                f"this model uses {feature} ({name!r} in its attention call), which bm does not implement"
            )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    extras = LayerExtras(
        kwargs.get("softcap") or None,
        getattr(module, ALIBI_ATTR, None),
        None if sinks is None else sinks.detach().float().contiguous(),
    )
    attention, metadata = current
    call = LayerCall(
        getattr(module, "layer_idx", None), query[0], key[0], value[0], scaling, extras,
        kv_stored=bool(kwargs.get("kv_stored")),
    )  # fmt: skip
    return attention.forward_layer(metadata, call).to(query.dtype).unsqueeze(0), None


class ShapeProbe:
    """The attention of :func:`probe_kv_shapes`'s forward: records each layer's (kv_heads, head_dim) into
    the forward's metadata (a dict) and computes nothing."""

    def forward_layer(self, metadata: dict[int, tuple[int, int]], call: LayerCall) -> torch.Tensor:
        layer, query, key, value = call.layer, call.query, call.key, call.value
        if not isinstance(layer, int):
            raise UnsupportedAttentionError(
                "the model's attention modules carry no layer_idx; bm needs one per layer"
            )
        if layer in metadata:
            raise UnsupportedAttentionError(
                f"attention layer {layer} runs twice in one forward (shared KV layers)"
            )
        if value.shape[-1] != key.shape[-1] or query.shape[0] % key.shape[0]:
            shapes = [[1, *t.shape] for t in (query, key, value)]
            raise UnsupportedAttentionError(
                f"layer {layer}: query/key/value shapes {shapes[0]}, {shapes[1]}, {shapes[2]} "
                "are not supported (bm needs equal key and value head sizes and grouped query heads)"
            )
        metadata[layer] = (key.shape[0], key.shape[-1])
        return query.new_zeros(query.shape[1], query.shape[0], value.shape[-1])


@torch.inference_mode()
def probe_kv_shapes(model: torch.nn.Module) -> dict[int, tuple[int, int]]:
    """Run one token through the model to learn each layer's (kv_heads, head_dim) as it really is.

    Configs name these differently from model to model (and some ignore ``num_key_value_heads``); the
    shapes the attention function receives are the truth. A model that never calls the registered
    function (one that bypasses ``AttentionInterface``) is refused here rather than run wrongly. Models
    with attention classes of their own must be adapted first (:mod:`bm.runtime.model_families`).
    """
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    device = next(model.parameters()).device
    zero = torch.zeros((1, 1), dtype=torch.long, device=device)
    shapes: dict[int, tuple[int, int]] = {}
    with forward_context(ShapeProbe(), shapes):
        model(
            input_ids=zero,
            position_ids=zero,
            use_cache=False,
            logits_to_keep=torch.zeros(1, dtype=torch.long, device=device),
        )
    if not shapes:
        own = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        named = f" (its attention classes: {', '.join(own)})" if own else ""
        raise UnsupportedAttentionError(
            f"{type(model).__name__} computes attention inline{named} instead of through transformers' "
            "AttentionInterface, and bm has no adapter for it, so bm cannot plug its paged attention in"
        )
    return shapes


def register() -> str:
    """Register bm's attention under one name; safe to call more than once.

    No mask function is registered with it, on purpose: transformers builds masks only for attention
    names its mask interface knows, and returns None at once for others ("custom attention without
    equivalent mask creation"). Registered (as a no-op, until this was found), the name let
    transformers' mask preparation run its packed-sequence check on bm's position ids, whose
    ``.all()`` read a device value on the host: on CUDA a blocking sync in every eager forward, which
    held the host at each prompt step until the step before it had finished, so overlap scheduling
    hid nothing there. Each sequence is masked inside bm's kernels."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
