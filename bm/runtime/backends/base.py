"""The attention-backend interface: what a way of computing paged attention implements.

:class:`~bm.runtime.model_runner.ModelRunner` owns the model and the KV tensors and holds one backend,
chosen once when it is built (:func:`bm.runtime.backends.backend_class`). Per forward it asks the
backend for the packed inputs and the backend's own metadata (:meth:`AttentionBackend.prepare`), runs
the model with that metadata current, and every attention layer hands its queries, keys and values to
:meth:`AttentionBackend.forward_layer` (through :func:`bm.runtime.attention.paged_attention_forward`).

A new backend (a library kernel such as FlashInfer's or FlashAttention's, issue 40) implements:

- ``name`` (what ``BM_ATTENTION`` and the reports call it) and :meth:`~AttentionBackend.serves`
  (whether it can run a loaded model: device, installed packages, head sizes);
- :meth:`~AttentionBackend.prepare`: the forward's token ids, positions, kept-logits rows and its own
  metadata type ``M`` from the engine's work items (a library's plan, its page tables, ...), one per
  attention window where layers differ (:class:`PerLayer`, :class:`WindowPlan`);
- :meth:`~AttentionBackend.store_kv` and :meth:`~AttentionBackend.attend` for one layer (a
  :class:`~bm.runtime.attention.LayerCall`), or :meth:`~AttentionBackend.forward_layer` where its
  library stores and attends in one call;
- optionally :meth:`~AttentionBackend.try_static_decode` and
  :meth:`~AttentionBackend.static_decode_sizes`, where it replays decode-only steps over static buffers
  (CUDA graphs); the warm-up runs each size it names before the clock.

It must give what the others give: every feature the model uses (attention windows with sink tokens and
released blocks, soft-capping, ALiBi, sink logits, grouped query heads) or a :meth:`serves` that says
no, and greedy outputs equal to HF ``generate()`` on each request alone (the oracle tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from bm.engine.execution.protocol import WorkItem
from bm.runtime.attention import LayerCall
from bm.runtime.kv_quant import NO_SCALES
from bm.runtime.model_loader import LoadedModel

M = TypeVar("M")  # a backend's metadata for one forward
W = TypeVar("W")  # a backend's metadata for the layers of one attention window


@dataclass(frozen=True)
class WindowPlan:
    """Which window each attention layer has, and which windows keep blocks in a pool of their own."""

    windows: dict[int, int | None]  # layer_idx -> window (None: full attention), in layer order
    sink_tokens: int
    pooled: frozenset[int]

    @property
    def default(self) -> int | None:
        """The first attention layer's window (every layer's, unless the layout is mixed)."""
        return self.windows[min(self.windows)]

    def sinks(self, window: int | None) -> int:
        """Sink tokens of the layers with ``window`` (a layer without a window has none)."""
        return self.sink_tokens if window is not None else 0


@dataclass(slots=True)
class PerLayer(Generic[W]):
    """A backend's metadata for each attention window of one forward, looked up by layer: the layers with
    the first layer's window read ``default``, the others (another window, or a pool of their own) theirs."""

    default: W
    others: dict[int, W] = field(default_factory=dict)

    @classmethod
    def by_window(cls, plan: WindowPlan, metadata: dict[int | None, W]) -> PerLayer[W]:
        """From one metadata per distinct window of ``plan``."""
        default = plan.default
        others = {layer: metadata[w] for layer, w in plan.windows.items() if w != default}
        return cls(metadata[default], others)

    def for_layer(self, layer: int) -> W:
        return self.others.get(layer, self.default) if self.others else self.default


@dataclass(slots=True)
class ForwardInputs(Generic[M]):
    """One packed forward's inputs on the device, and the backend's metadata for its attention."""

    input_ids: torch.Tensor  # [1, T] int64: every scheduled token, request after request
    positions: torch.Tensor  # [1, T] int64
    logits_index: torch.Tensor  # [num_kept] int64: the packed rows whose logits the forward returns
    metadata: M


@dataclass(frozen=True)
class InputFill:
    """Input tokens still on the device (overlap scheduling): packed rows ``rows`` of the forward's
    ``input_ids`` take ``values``, which the previous launch sampled and never copied to the host."""

    rows: torch.Tensor  # [n] int64, on the device
    values: torch.Tensor  # [n] int64, on the device

    def apply(self, input_ids: torch.Tensor) -> None:
        """Write the tokens into ``input_ids`` (``[T]`` or ``[1, T]``), in stream order, no sync."""
        input_ids.view(-1).index_copy_(0, self.rows, self.values)


@dataclass(frozen=True)
class BackendSetup:
    """What a backend is built from (once per runner)."""

    loaded: LoadedModel
    kv_caches: list[torch.Tensor | None]  # by layer_idx: [2, kv_heads, num_blocks, tokens_per_block, d]
    plan: WindowPlan
    tokens_per_block: int
    max_seq_len: int
    # the runner's model call: logits of the kept rows, in the model's dtype, with the inputs'
    # metadata current (a backend replaying static buffers calls it to run or capture the model)
    run_model: Callable[[ForwardInputs[Any]], torch.Tensor]


class AttentionBackend(ABC, Generic[M]):
    """Paged attention for one runner: builds each forward's metadata, and computes each layer."""

    name: ClassVar[str]

    def __init__(self, setup: BackendSetup) -> None:
        self.kv_caches = setup.kv_caches
        self.plan = setup.plan
        self.device = setup.loaded.device
        self.tokens_per_block = setup.tokens_per_block
        # an fp8 cache's per-layer key and value scales: the checkpoint's, else 1.0 (bm.runtime.kv_quant)
        self.kv_scales = {
            layer: setup.loaded.kv_scales.get(layer, NO_SCALES) for layer in setup.loaded.kv_shapes
        }

    @classmethod
    @abstractmethod
    def serves(cls, loaded: LoadedModel) -> bool:
        """Whether this backend can run ``loaded`` where it is (device, installed packages, head sizes)."""

    @abstractmethod
    def prepare(self, items: Sequence[WorkItem]) -> ForwardInputs[M]:
        """The packed inputs of one forward over ``items`` (in order) and this backend's metadata for it."""

    @abstractmethod
    def store_kv(self, metadata: M, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the forward's new keys and values ``[kv_heads, T, d]`` into ``layer``'s cache."""

    @abstractmethod
    def attend(self, metadata: M, call: LayerCall) -> torch.Tensor:
        """Every query of ``call`` attending its own sequence's keys (the new ones stored already): the
        output ``[T, heads, d]``. The call's keys and values are the new tokens' (a whole prompt may
        attend them directly instead of reading the cache)."""

    def forward_layer(self, metadata: M, call: LayerCall) -> torch.Tensor:
        """One attention layer of the forward: store (unless the layer stored already: ``kv_stored``),
        then attend. A backend whose kernel does both in one call overrides this."""
        if not call.kv_stored:
            self.store_kv(metadata, call.layer, call.key, call.value)
        return self.attend(metadata, call)

    def try_static_decode(
        self, items: Sequence[WorkItem], fill: InputFill | None = None
    ) -> torch.Tensor | None:
        """Logits of a decode-only step run over static buffers (a replayed CUDA graph), in the model's
        dtype and valid until the next static step (the runner copies them where asked), or None where
        this backend has none or they do not serve this step (the runner then runs it eagerly).
        ``fill``: input tokens to take from the device once the buffers are written."""
        return None

    def static_decode_sizes(self, max_batch_size: int) -> tuple[int, ...]:
        """The decode batch sizes :meth:`try_static_decode` captures for steps of up to ``max_batch_size``
        requests (the warm-up runs each once, before the clock); empty where decode steps run eagerly."""
        return ()


def kept_rows(item: WorkItem, offset: int) -> range:
    """The packed rows whose logits a forward returns for a work item starting at ``offset``: every row
    with ``keep_all``, the drafts' and the last with drafts, the last when it samples. One definition for
    every backend."""
    n = len(item.token_ids)
    if item.keep_all:
        return range(offset, offset + n)
    if item.num_draft:
        return range(offset + n - 1 - item.num_draft, offset + n)
    return range(offset + n - 1, offset + n) if item.sample else range(0)


def all_kept_rows(items: Sequence[WorkItem]) -> list[int]:
    """Packed indices whose logits a forward over ``items`` returns (as ModelRunner.forward documents)."""
    keep: list[int] = []
    offset = 0
    for item in items:
        keep.extend(kept_rows(item, offset))
        offset += len(item.token_ids)
    return keep
