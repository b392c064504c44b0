"""LoRA adapters as data: the model linear each TensorRT-LLM module id names, and peft directories.

An adapter names its targets by TensorRT-LLM's module ids (``attn_q``, ``mlp_4h_to_h``, ...; bm.engine's
``LORA_MODULES``) and layer index; :func:`find_lora_targets` finds each one's ``nn.Linear`` in a Hugging
Face model, whatever the family calls it. :func:`read_peft_adapter` reads a directory saved by the
``peft`` library into the seed's form (``lora_config`` rows and ``lora_weights``), and
:func:`task_id_for_directory` gives such a directory a stable task id. :mod:`bm.runtime.lora` applies
the loaded adapters inside the packed forward.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from bm.engine.requests.model_inputs import LORA_MODULES

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
