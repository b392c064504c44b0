"""LoRA adapters in the packed forward: every adapter of the batch, and the base model, in one pass.

Each targeted linear layer keeps the loaded adapters stacked by slot: ``A`` as ``[slots * rank, in]`` and
``B`` as ``[slots * rank, out]`` (lower ranks padded with zeros, the adapter's scaling folded into B). A
forward hook adds ``((x @ A.T) * mask) @ B`` where ``mask[t]`` keeps only the rank columns of token t's
adapter slot (zero for a base-model token): the adapter is gathered per token, as in S-LoRA/Punica, with
two matmuls per layer whatever the mix, and only over the span of slots the batch uses. A batch with no
adapter token runs the hooks as no-ops.

The seed's form of an adapter is ``lora_config`` rows ``[module_id, layer_idx, D]`` and ``lora_weights``
rows ``A [D, Hi]`` then ``B [Ho, D]``, flattened row-major. :func:`read_peft_adapter` converts a directory
saved by the ``peft`` library to it.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bm.engine.request import LORA_MODULE_NAMES, LORA_MODULES, LoraSpec, RequestError

# Module id -> the HF names it maps to, as ``parent.leaf`` suffixes (TensorRT-LLM's default mapping for
# Llama-style models first, then other families' spellings of the same projection).
HF_MODULES: dict[str, tuple[str, ...]] = {
    "attn_q": ("self_attn.q_proj", "attn.q_proj"),
    "attn_k": ("self_attn.k_proj", "attn.k_proj"),
    "attn_v": ("self_attn.v_proj", "attn.v_proj"),
    "attn_qkv": ("self_attn.qkv_proj", "attention.query_key_value", "self_attention.query_key_value"),
    "attn_dense": ("self_attn.o_proj", "attn.o_proj", "self_attn.dense", "attention.dense"),
    "mlp_h_to_4h": ("mlp.gate_proj", "mlp.fc1", "mlp.dense_h_to_4h"),
    "mlp_4h_to_h": ("mlp.down_proj", "mlp.fc2", "mlp.dense_4h_to_h"),
    "mlp_gate": ("mlp.up_proj",),
}


def find_lora_targets(model: nn.Module) -> dict[tuple[int, int], nn.Linear]:
    """(module id, layer index) -> the model's linear layer for it."""
    targets: dict[tuple[int, int], nn.Linear] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), None)
        if layer is None:
            continue
        suffix = ".".join(parts[-2:])
        for module_name, spellings in HF_MODULES.items():
            if suffix in spellings:
                targets.setdefault((LORA_MODULES[module_name], layer), module)
    return targets


@dataclass
class _Stack:
    a: torch.Tensor  # [slots * rank, in]
    b: torch.Tensor  # [slots * rank, out] (B transposed, scaled)


@dataclass
class _Batch:
    """The adapter mix of one forward: columns ``lo*rank:hi*rank`` of every stack, masked per token."""

    lo: int
    hi: int
    mask: torch.Tensor  # [1, T, (hi - lo) * rank]


class LoraLayers:
    """Loaded adapters by slot, stacked per targeted layer, and the hooks that apply them."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.dtype = dtype
        self.device = device
        self.targets = find_lora_targets(model)
        self.stacks: dict[tuple[int, int], _Stack] = {}
        self.rank = 0
        self.num_slots = 0
        self.active: _Batch | None = None
        self._hooks: list[Any] = []

    # -- checks (at admission) ------------------------------------------------------------------------

    def check(self, spec: LoraSpec) -> None:
        """Refuse an adapter this model cannot run, naming the row and the module."""
        present = sorted({LORA_MODULE_NAMES[m] for m, _ in self.targets})
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
            row = spec.weights[i]
            if len(row) < width:
                raise RequestError(
                    f"lora_weights: row {i} ({name}, layer {layer}, adapter_size {size}) has {len(row)} "
                    f"values; it needs D x Hi + Ho x D = {size} x {target.in_features} + "
                    f"{target.out_features} x {size} = {width} (longer rows are padding)"
                )
            try:
                values = torch.as_tensor(row[:width], dtype=torch.float32)
            except (TypeError, ValueError):
                raise RequestError(f"lora_weights: row {i} must hold numbers") from None
            if not bool(torch.isfinite(values).all()):
                raise RequestError(f"lora_weights: row {i} holds a non-finite value")

    # -- loading --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def load(self, slot: int, spec: LoraSpec) -> None:
        """Write ``spec`` into ``slot`` of every stack (zeroing the slot where it targets nothing)."""
        rank = max(size for _, _, size in spec.config)
        self._grow(max(self.num_slots, slot + 1), max(self.rank, rank))
        r = self.rank
        for stack in self.stacks.values():
            stack.a[slot * r : (slot + 1) * r].zero_()
            stack.b[slot * r : (slot + 1) * r].zero_()
        for i, (module, layer, size) in enumerate(spec.config):
            key = (module, layer)
            target = self.targets[key]
            stack = self.stacks.get(key) or self._new_stack(key, target)
            d_in, d_out = target.in_features, target.out_features
            row = torch.as_tensor(spec.weights[i][: size * (d_in + d_out)], dtype=torch.float32)
            a = row[: size * d_in].view(size, d_in)
            b = row[size * d_in :].view(d_out, size)
            stack.a[slot * r : slot * r + size] = a.to(self.device, self.dtype)
            stack.b[slot * r : slot * r + size] = b.t().to(self.device, self.dtype)

    def _new_stack(self, key: tuple[int, int], target: nn.Linear) -> _Stack:
        rows = self.num_slots * self.rank
        stack = _Stack(
            torch.zeros(rows, target.in_features, dtype=self.dtype, device=self.device),
            torch.zeros(rows, target.out_features, dtype=self.dtype, device=self.device),
        )
        self.stacks[key] = stack
        self._hooks.append(target.register_forward_hook(_hook(weakref.ref(self), stack)))
        return stack

    def _grow(self, num_slots: int, rank: int) -> None:
        if num_slots == self.num_slots and rank == self.rank:
            return
        for stack in self.stacks.values():
            for name in ("a", "b"):
                old = getattr(stack, name)
                width = old.shape[1]
                new = torch.zeros(num_slots, rank, width, dtype=self.dtype, device=self.device)
                if self.rank:
                    new[: self.num_slots, : self.rank] = old.view(self.num_slots, self.rank, width)
                setattr(stack, name, new.view(num_slots * rank, width))
        self.num_slots, self.rank = num_slots, rank

    def close(self) -> None:
        """Remove the hooks (the model is shared with other engines in tests and tools)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # -- per forward ----------------------------------------------------------------------------------

    def begin(self, slots_per_segment: Sequence[tuple[int, int]]) -> None:
        """``(slot or -1, number of tokens)`` per segment of the coming forward, in order."""
        used = [s for s, _ in slots_per_segment if s >= 0]
        if not used:
            self.active = None
            return
        lo, hi, r = min(used), max(used) + 1, self.rank
        token_slots = torch.tensor(
            [s for s, n in slots_per_segment for _ in range(n)], dtype=torch.long, device=self.device
        )
        column_slots = torch.arange(lo * r, hi * r, device=self.device) // r
        mask = (token_slots[:, None] == column_slots[None, :]).to(self.dtype)
        self.active = _Batch(lo, hi, mask[None])

    def end(self) -> None:
        self.active = None


def _hook(layers: weakref.ref, stack: _Stack):
    """The forward hook of one targeted layer; it holds its owner weakly, so an engine that goes away
    leaves an inert hook rather than its adapters pinned in memory."""

    def apply(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        owner = layers()
        batch = owner.active if owner is not None else None
        if batch is None:
            return None
        r = owner.rank
        cols = slice(batch.lo * r, batch.hi * r)
        xa = F.linear(args[0], stack.a[cols]) * batch.mask
        return output + torch.matmul(xa, stack.b[cols])

    return apply


# -- PEFT directories -----------------------------------------------------------------------------------


def task_id_for_directory(path: str | Path) -> int:
    """A stable task id for an adapter directory (its resolved path), below 2**63."""
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def read_peft_adapter(path: str | Path) -> tuple[list[list[int]], torch.Tensor]:
    """A ``peft`` LoRA directory as the seed's ``(lora_config rows, lora_weights [rows, D*Hi + Ho*D])``.

    The adapter's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) is folded into B, so the seed
    form carries no alpha. Raises ValueError naming the file and what is wrong.
    """
    from safetensors.torch import load_file

    root = Path(path)
    config_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    for p in (config_path, weights_path):
        if not p.is_file():
            raise ValueError(
                f"lora_dir {str(root)!r}: {p.name} is missing (expected a directory saved by peft)"
            )
    config = json.loads(config_path.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"lora_dir {str(root)!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("fan_in_fan_out", "rank_pattern", "alpha_pattern", "use_dora"):
        if config.get(key):
            raise ValueError(f"lora_dir {str(root)!r}: adapters with {key} are not supported")
    tensors = load_file(str(weights_path))
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                by_module.setdefault(key.split(marker)[0], {})[part] = value
    unknown = [k for k in tensors if ".lora_A." not in k and ".lora_B." not in k]
    if unknown:
        raise ValueError(f"lora_dir {str(root)!r}: unsupported tensor {unknown[0]!r} (only lora_A / lora_B)")
    rows: list[tuple[list[int], torch.Tensor]] = []
    for name, pair in sorted(by_module.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"lora_dir {str(root)!r}: {name} lacks lora_A or lora_B")
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), None)
        suffix = ".".join(parts[-2:])
        module = next((m for m, spellings in HF_MODULES.items() if suffix in spellings), None)
        if layer is None or module is None:
            raise ValueError(f"lora_dir {str(root)!r}: no TensorRT-LLM LoRA module matches {name!r}")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        rank = a.shape[0]
        alpha = config.get("lora_alpha", rank)
        scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)
        rows.append(([LORA_MODULES[module], layer, rank], torch.cat([a.flatten(), (b * scale).flatten()])))
    if not rows:
        raise ValueError(f"lora_dir {str(root)!r}: the adapter holds no LoRA weights")
    # The seed's form is one tensor: shorter rows (modules differ in Hi, Ho) are padded with zeros.
    width = max(len(w) for _, w in rows)
    weights = torch.zeros(len(rows), width)
    for i, (_, w) in enumerate(rows):
        weights[i, : len(w)] = w
    return [c for c, _ in rows], weights
