"""LoRA adapters in the packed forward: every adapter of the batch, and the base model, in one pass.

The executor orders a forward's items by adapter slot, so each adapter's tokens are one row range of the
packed batch; :meth:`LoraLayers.begin` records those ranges once per forward, and every targeted linear
layer adds ``(x[range] @ A.T) @ B.T`` into the same rows of its output, in place, for each range: a
segmented GEMM as in Punica's SGMV, where each token meets only its own adapter, at that adapter's rank,
and base-model tokens cost nothing. Modules that read one input (q/k/v, gate/up) share one ``x @ A.T``
GEMM per range. The adapter's scaling is folded into B. A batch with no adapter token leaves every layer
as it was.

In float32 on the CPU, where bm's compiled kernel is available (``native/lora_delta.c``), each targeted
layer instead makes one call that adds every adapter row's delta in place (Punica's BGMV idea): done
with torch ops, the delta cost about 90 small ops per decode forward of the benchmark model, and their
dispatch, not their arithmetic, was most of LoRA's cost. The torch paths serve other devices and dtypes.

The seed's form of an adapter is ``lora_config`` rows ``[module_id, layer_idx, D]`` and ``lora_weights``
rows ``A [D, Hi]`` then ``B [Ho, D]``, flattened row-major
(:func:`bm.runtime.lora_adapters.read_peft_adapter` converts a directory saved by the ``peft`` library
to it).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bm.engine.requests.model_inputs import LORA_MODULE_NAMES, LORA_MODULES, LoraSpec
from bm.engine.requests.request import RequestError
from bm.runtime.lora_adapters import find_lora_targets
from bm.runtime.native import LoraDeltaKernel, LoraDeltaWeights, lora_delta_kernel

# Modules of one layer that read the same input: their A matrices are stacked, so the input meets the
# adapter once (one GEMM per adapter segment for q, k and v together; one for gate and up).
_SHARED_INPUT = (("attn_q", "attn_k", "attn_v"), ("mlp_h_to_4h", "mlp_gate"))
_FAMILY = {LORA_MODULES[name]: i for i, names in enumerate(_SHARED_INPUT) for name in names}
# The masked path is taken while (adapter tokens) x (loaded slots) stays within this many rows.
MASKED_PATH_ROWS = 512


@dataclass(slots=True)
class _Plan:
    """One slot's adapter in one group, as views of the group's storage: ``a`` holds the rows the adapter
    uses (its targeted members' A, stacked, each at its own rank: no padding is ever multiplied) and
    ``cols[m]`` is member m's ``(first, last)`` columns of ``x @ a.T`` with its scaled ``B.T``, or None
    where the adapter leaves member m alone."""

    a: torch.Tensor  # [rows, in]
    cols: list[tuple[int, int, torch.Tensor] | None]


class _Group:
    """The targeted linears of one layer that read one input, and every slot's adapter for them."""

    def __init__(self, members: list[nn.Linear], native: bool = False) -> None:
        self.members = members
        self.native = native  # keep the compiled kernel's view of the storage (``kernel_weights``)
        self.in_features = members[0].in_features
        # storage, by slot: A rows [slots, len(members) * rank, in], each member's B.T [slots, rank, out]
        self.a = torch.empty(0)
        self.b: list[torch.Tensor] = []
        # the masked path's views: every member's A at full rank, member-major
        # ([members * slots * rank, in]), and each member's B.T as [slots * rank, out]
        self.a_wide = torch.empty(0)
        self.b_wide: list[torch.Tensor] = []
        # by slot: (rows used, per member (first row, size) or None); None: the adapter skips the group
        self.layout: list[tuple[int, list[tuple[int, int] | None]] | None] = []
        self.plans: list[_Plan | None] = []
        # the compiled kernel's view: per member, A [slots, rank, in] (``a_wide``), B.T [slots, rank, out]
        # (``b``) and the rank each slot uses ([members, slots]; 0 where the adapter skips the member)
        self.ranks = torch.zeros(len(members), 0, dtype=torch.int64)
        self.kernel_weights: list[LoraDeltaWeights] = []
        # this forward's input and its ``x @ a.T`` per adapter segment (members after the first reuse it)
        self.x: torch.Tensor | None = None
        self.xa: list[torch.Tensor | None] = []

    def allocate(self, num_slots: int, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """Grow the storage to ``num_slots`` slots of ``rank`` rows per member, keeping what is loaded."""
        a = torch.zeros(num_slots, len(self.members) * rank, self.in_features, dtype=dtype, device=device)
        b = [torch.zeros(num_slots, rank, m.out_features, dtype=dtype, device=device) for m in self.members]
        if self.a.numel():
            slots, rows = self.a.shape[:2]
            a[:slots, :rows] = self.a
            for new, old in zip(b, self.b, strict=True):
                new[:slots, : old.shape[1]] = old
        self.a, self.b = a, b
        self.layout += [None] * (num_slots - len(self.layout))
        self.plans = [self._plan(slot) for slot in range(num_slots)]
        wide = torch.zeros(len(self.members), num_slots, rank, self.in_features, dtype=dtype, device=device)
        for slot in range(num_slots):
            self._widen(slot, wide)
        self.a_wide = wide.view(-1, self.in_features)
        self.b_wide = [m.view(num_slots * rank, -1) for m in b]
        ranks = torch.zeros(len(self.members), num_slots, dtype=torch.int64)
        ranks[:, : self.ranks.shape[1]] = self.ranks
        self.ranks = ranks
        if self.native:
            self.kernel_weights = [
                LoraDeltaWeights(wide[i], b[i], ranks[i]) for i in range(len(self.members))
            ]

    def _widen(self, slot: int, wide: torch.Tensor) -> None:
        """Copy ``slot``'s A rows into the member-major layout of the masked path."""
        wide[:, slot].zero_()
        layout = self.layout[slot]
        if layout is None:
            return
        for i, member in enumerate(layout[1]):
            if member is not None:
                first, size = member
                wide[i, slot, :size] = self.a[slot, first : first + size]

    def _plan(self, slot: int) -> _Plan | None:
        layout = self.layout[slot]
        if layout is None:
            return None
        rows, members = layout
        cols = [
            None if m is None else (m[0], m[0] + m[1], self.b[i][slot, : m[1]]) for i, m in enumerate(members)
        ]
        return _Plan(self.a[slot, :rows], cols)

    def load(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Member index -> (A [size, in], B.T [size, out]) of the adapter in ``slot`` (none: it skips the
        group); the slot's old rows are zeroed first."""
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        members: list[tuple[int, int] | None] = [None] * len(self.members)
        row = 0
        for i, (a, bt) in sorted(weights.items()):
            size = a.shape[0]
            self.a[slot, row : row + size] = a
            self.b[i][slot, :size] = bt
            members[i] = (row, size)
            row += size
        self.layout[slot] = (row, members) if row else None
        self.ranks[:, slot] = torch.tensor([0 if m is None else m[1] for m in members], dtype=torch.int64)
        self.plans[slot] = self._plan(slot)
        self._widen(slot, self.a_wide.view(len(self.members), len(self.layout), -1, self.in_features))


class LoraLayers:
    """Loaded adapters by slot, grouped per layer by shared input, and the layer wrappers that apply them.

    A forward's tokens arrive grouped by adapter slot (the executor orders its items so), and
    :meth:`begin` turns them into segments ``(slot, first, last)``, once for every layer and module. Each
    targeted layer then adds ``(x[seg] @ A.T) @ B.T`` into its own output rows of each segment (Punica's
    segmented GEMM): base-model tokens are never touched and a token meets only its own adapter's
    weights, at its own rank."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.dtype = dtype
        self.device = device
        self.targets = find_lora_targets(model)
        self.groups: dict[tuple[int, int], _Group] = {}  # (layer, family or -1 - module id) -> group
        self._member: dict[tuple[int, int], tuple[_Group, int]] = {}  # (module id, layer) -> its place
        self.rank = 0
        self.num_slots = 0
        self.segments: list[tuple[int, int, int]] = []  # this forward's (slot, first token, end)
        self.masks: dict[int, torch.Tensor] = {}  # masked path: group size -> [rows, size * slots * rank]
        self.masked_rows = (0, 0)
        # The compiled kernel (fp32 on the CPU): every adapter row of a forward in one call per layer.
        self.kernel: LoraDeltaKernel | None = (
            lora_delta_kernel() if device.type == "cpu" and dtype == torch.float32 else None
        )
        self.token_slots: tuple[int, torch.Tensor] | None = None  # kernel path: (first row, slot per row)
        self._ref = weakref.ref(self)
        self._adapted: list[nn.Linear] = []  # layers whose forward applies this object's adapters
        # an engine that goes away without close() still gives the shared model its layers back
        self._finalizer = weakref.finalize(self, _detach, self._adapted, self._ref)

    # -- checks (at admission) ------------------------------------------------------------------------

    def check(self, spec: LoraSpec) -> None:
        """Refuse an adapter this model cannot run, naming the row and the module."""
        present = sorted({LORA_MODULE_NAMES[m] for m, _ in self.targets})
        widths: list[int] = []
        is_tensor = isinstance(spec.weights, torch.Tensor) and spec.weights.dim() == 2
        row_length = spec.weights.shape[1] if is_tensor else None
        for i, (module, layer, size) in enumerate(spec.config):
            target = self.targets.get((module, layer))
            name = LORA_MODULE_NAMES[module]
            if target is None:
                raise RequestError(
                    f"lora_config: row {i} targets {name} (module id {module}) of layer {layer}, which this "
                    f"model lacks; its LoRA modules are {', '.join(present)} in layers "
                    f"0..{max((lay for _, lay in self.targets), default=-1)}"
                )
            width = size * (target.in_features + target.out_features)
            widths.append(width)
            length = row_length if row_length is not None else len(spec.weights[i])
            if length < width:
                raise RequestError(
                    f"lora_weights: row {i} ({name}, layer {layer}, adapter_size {size}) has {length} "
                    f"values; it needs D x Hi + Ho x D = {size} x {target.in_features} + "
                    f"{target.out_features} x {size} = {width} (longer rows are padding)"
                )
        if is_tensor:
            # one pass over the whole tensor (every request of a task may carry it): the values that
            # matter are each row's first ``width``; the padding after them is never read
            values = spec.weights.detach().to("cpu", torch.float32)
            if bool(torch.isfinite(values.sum())):
                # every value is finite (a NaN or an infinity anywhere makes the sum one): a single
                # read, which matters when every request of a task carries the whole tensor
                return
            used = torch.arange(values.shape[1]) < torch.tensor(widths)[:, None]
            bad = (used & ~torch.isfinite(values)).any(dim=1).nonzero()
            if bad.numel():
                raise RequestError(f"lora_weights: row {int(bad[0, 0])} holds a non-finite value")
            return
        for i, width in enumerate(widths):
            row = spec.weights[i]
            try:
                values = torch.as_tensor(row[:width], dtype=torch.float32)
            except (TypeError, ValueError):
                raise RequestError(f"lora_weights: row {i} must hold numbers") from None
            if not bool(torch.isfinite(values).all()):
                raise RequestError(f"lora_weights: row {i} holds a non-finite value")

    # -- loading --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def load(self, slot: int, spec: LoraSpec) -> None:
        """Write ``spec`` into ``slot`` of every group (clearing the slot where it targets nothing)."""
        by_group: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for i, (module, layer, size) in enumerate(spec.config):
            group, member = self._place(module, layer)
            target = self.targets[(module, layer)]
            d_in, d_out = target.in_features, target.out_features
            row = torch.as_tensor(spec.weights[i][: size * (d_in + d_out)], dtype=torch.float32)
            a = row[: size * d_in].view(size, d_in).to(self.device, self.dtype)
            bt = row[size * d_in :].view(d_out, size).t().to(self.device, self.dtype)
            by_group.setdefault(id(group), {})[member] = (a, bt)
        rank = max(size for _, _, size in spec.config)
        if slot >= self.num_slots or rank > self.rank:
            self.num_slots, self.rank = max(self.num_slots, slot + 1), max(self.rank, rank)
            for group in self.groups.values():
                group.allocate(self.num_slots, self.rank, self.dtype, self.device)
        for group in self.groups.values():
            group.load(slot, by_group.get(id(group), {}))

    def _place(self, module: int, layer: int) -> tuple[_Group, int]:
        """The group and member index of a targeted module, making its group (and wrapping its layers) on first use."""
        place = self._member.get((module, layer))
        if place is not None:
            return place
        family = _FAMILY.get(module)
        if family is None:
            keys = [(module, layer)]
            group_key = (layer, -1 - module)
        else:
            names = _SHARED_INPUT[family]
            keys = [(LORA_MODULES[n], layer) for n in names if (LORA_MODULES[n], layer) in self.targets]
            group_key = (layer, family)
        group = _Group([self.targets[k] for k in keys], native=self.kernel is not None)
        if self.num_slots:
            group.allocate(self.num_slots, self.rank, self.dtype, self.device)
        self.groups[group_key] = group
        for i, key in enumerate(keys):
            self._member[key] = (group, i)
            linear = self.targets[key]
            _attach(linear, (self._ref, group, i))
            self._adapted.append(linear)
        return group, self._member[(module, layer)][1]

    def close(self) -> None:
        """Give the layers back their own forward (the model is shared with other engines in tests and
        tools)."""
        self._finalizer()

    # -- per forward ----------------------------------------------------------------------------------

    def begin(self, slots_per_segment: Sequence[tuple[int, int]]) -> None:
        """``(slot or -1, number of tokens)`` per item of the coming forward, in order: consecutive items
        of one slot become one segment (a row range; base-model rows belong to none).

        Where every segment is short (generation steps: a token or a few per request), one GEMM per
        segment costs more in calls than in arithmetic, so the forward takes the masked path instead:
        the adapter rows meet every loaded adapter in one GEMM, a per-token mask keeps each token's own
        adapter's columns (exact zeros elsewhere), and one more GEMM per module applies B. It is chosen
        while the wasted rows stay small (``tokens x slots <= MASKED_PATH_ROWS``).

        With the compiled kernel, every forward instead gets one slot per row, made here once for all
        layers, and each layer makes one kernel call."""
        segments: list[tuple[int, int, int]] = []
        offset = 0
        for slot, n in slots_per_segment:
            if slot >= 0:
                if segments and segments[-1][0] == slot and segments[-1][2] == offset:
                    segments[-1] = (slot, segments[-1][1], offset + n)
                else:
                    segments.append((slot, offset, offset + n))
            offset += n
        self.segments = segments
        self.masks = {}
        self.token_slots = None
        if not segments:
            return
        first, last = segments[0][1], segments[-1][2]
        masked = len(segments) > 1 and (last - first) * self.num_slots <= MASKED_PATH_ROWS
        if self.kernel is None and not masked:
            return
        # each token's adapter slot from the first adapter token to the last (-1: base model)
        slots = [-1] * (last - first)
        for slot, lo, hi in segments:
            slots[lo - first : hi - first] = [slot] * (hi - lo)
        if self.kernel is not None:
            self.token_slots = (first, torch.tensor(slots, dtype=torch.int64))
            return
        token_slots = torch.tensor(slots, device=self.device)
        column_slots = torch.arange(self.num_slots * self.rank, device=self.device) // self.rank
        mask = (token_slots[:, None] == column_slots[None, :]).to(self.dtype)
        self.masks = {g: mask.repeat(1, g) for g in {len(group.members) for group in self.groups.values()}}
        self.masked_rows = (first, last)

    def end(self) -> None:
        self.segments = []
        self.masks = {}
        self.token_slots = None
        for group in self.groups.values():
            group.x, group.xa = None, []

    def apply(self, group: _Group, member: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add member ``member``'s adapter delta into ``out`` for every adapter segment, in place."""
        if self.token_slots is not None and out.is_contiguous() and out.dtype == torch.float32:
            first, slots = self.token_slots
            self.kernel(
                x if x.is_contiguous() else x.contiguous(), out, first, slots, group.kernel_weights[member]
            )
            return
        rows = out.view(-1, out.shape[-1])
        if self.masks:
            first, last = self.masked_rows
            if group.x is not x:  # the group's first member this forward: one x @ A for all members
                xa = F.linear(x.reshape(-1, x.shape[-1])[first:last], group.a_wide)
                group.xa, group.x = xa.mul_(self.masks[len(group.members)]), x
            width = self.num_slots * self.rank
            rows[first:last].addmm_(group.xa[:, member * width : (member + 1) * width], group.b_wide[member])
            return
        segments = self.segments
        if group.x is not x:  # the group's first member this forward: x @ A.T for all of its members
            flat = x.reshape(-1, x.shape[-1])
            plans = group.plans
            group.xa = [
                None if plans[slot] is None else F.linear(flat[lo:hi], plans[slot].a)
                for slot, lo, hi in segments
            ]
            group.x = x
        for (slot, lo, hi), xa in zip(segments, group.xa, strict=True):
            if xa is None:
                continue
            cols = group.plans[slot].cols[member]
            if cols is not None:
                first, last, bt = cols
                rows[lo:hi].addmm_(xa[:, first:last], bt)


def _lora_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A targeted layer's forward: its own, then each live owner's adapter delta added in place.

    It replaces the module's ``forward`` (as a bound method, so a deep copy of the model rebinds it to
    the copy's layer) rather than being a forward hook: a module with hooks takes torch's slow call
    path, which costs more per generation step than the delta itself. Owners are held weakly."""
    inner = self._bm_lora_inner  # the forward it had (a packed GEMM: bm.runtime.prepack), or its class's
    out = inner(x) if inner is not None else type(self).forward(self, x)
    for ref, group, member in self._bm_lora:
        owner = ref()
        if owner is not None and owner.segments:
            owner.apply(group, member, x, out)
    return out


def _attach(linear: nn.Linear, entry: tuple[weakref.ref, _Group, int]) -> None:
    if "_bm_lora" not in linear.__dict__:
        linear._bm_lora = []
        linear._bm_lora_inner = linear.__dict__.get("forward")
        linear.forward = types.MethodType(_lora_forward, linear)
    linear._bm_lora.append(entry)


def _detach(linears: list[nn.Linear], ref: weakref.ref) -> None:
    """Drop ``ref``'s entries (and dead owners'); a layer left with none gets its own forward back."""
    for linear in linears:
        entries = linear.__dict__.get("_bm_lora")
        if entries is None:
            continue
        entries[:] = [e for e in entries if e[0] is not ref and e[0]() is not None]
        if not entries:
            inner = linear._bm_lora_inner
            del linear._bm_lora, linear._bm_lora_inner
            if inner is None:
                del linear.forward
            else:
                linear.forward = inner
    linears.clear()
