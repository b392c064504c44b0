"""What changes a request's activations beside its token ids: a prompt-tuning table and a LoRA adapter,
validated into plain values the runtime turns into tensors (no torch here)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from bm.engine.requests.fields import RequestError, check_int, is_number
from bm.engine.requests.request import Request, RequestLimits
from bm.scheduling.controls import Controls


@dataclass(frozen=True)
class PromptTable:
    """A validated prompt-tuning table: ``rows[i]`` is the embedding of prompt id ``vocab_size + i``."""

    rows: tuple[tuple[float, ...], ...]
    key: str  # digest of the values: block reuse only between requests with an identical table


# TensorRT-LLM's LoRA module ids (its LoraModule types), by name; bm maps each to the model's layers.
LORA_MODULES = {
    "attn_qkv": 0,
    "attn_q": 1,
    "attn_k": 2,
    "attn_v": 3,
    "attn_dense": 4,
    "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6,
    "mlp_gate": 7,
}
LORA_MODULE_NAMES = {v: k for k, v in LORA_MODULES.items()}


@dataclass(frozen=True, eq=False)
class LoraSpec:
    """A request's adapter: its task id, and on the first request of a task its weights and config
    (``weights`` stays as given, a list of rows or an array; the runtime checks its widths)."""

    task_id: int
    config: tuple[tuple[int, int, int], ...] | None = None
    weights: Any = None

    @property
    def num_values(self) -> int:
        return sum(len(row) for row in self.weights) if self.weights is not None else 0


@dataclass(frozen=True)
class ModelInputs:
    """What changes a request's activations beside its token ids, as plain values the runtime turns into
    tensors. Blocks computed under different inputs never share a cache entry (:attr:`block_extra_keys`)."""

    prompt_table: PromptTable | None = None
    lora: LoraSpec | None = None

    @property
    def block_extra_keys(self) -> tuple:
        keys: tuple = ()
        if self.prompt_table is not None:
            keys += ("ptable", self.prompt_table.key)
        if self.lora is not None:
            keys += ("lora", self.lora.task_id)
        return keys


def prompt_table(request: Request, limits: RequestLimits) -> PromptTable | None:
    table, size = request.prompt_embedding_table, request.prompt_vocab_size
    if table is None:
        if size is not None:
            raise RequestError(
                "prompt_vocab_size: given without prompt_embedding_table; give the table too or drop it"
            )
        return None
    if not isinstance(table, (list, tuple)) or not table:
        raise RequestError(
            "prompt_embedding_table: expected a non-empty list of rows [num_virtual_tokens, hidden_size]"
        )
    width = limits.hidden_size
    rows = []
    for i, row in enumerate(table):
        if not isinstance(row, (list, tuple)):
            raise RequestError(f"prompt_embedding_table: row {i} is not a list of numbers")
        if width is None:
            width = len(row)
        if len(row) != width:
            raise RequestError(
                f"prompt_embedding_table: row {i} has {len(row)} values; every row needs the model's "
                f"hidden size {width}"
            )
        for v in row:
            if not is_number(v):
                raise RequestError(
                    f"prompt_embedding_table: row {i} holds {v!r}; values must be finite numbers"
                )
        rows.append(tuple(float(v) for v in row))
    if size is not None:
        check_int("prompt_vocab_size", size)
        if size != len(rows):
            raise RequestError(
                f"prompt_vocab_size: {size} does not match prompt_embedding_table's {len(rows)} rows; "
                "give the number of rows (or leave it out)"
            )
    frozen = tuple(rows)
    digest = hashlib.sha256(repr(frozen).encode()).hexdigest()
    return PromptTable(frozen, digest)


def check_prompt_table_request(controls: Controls) -> None:
    """Controls that read the prompt's ids as vocabulary entries have no meaning for virtual tokens."""
    if controls.repetition_penalty != 1.0:
        raise RequestError(
            "repetition_penalty: not supported with prompt_embedding_table (the prompt holds virtual tokens)"
        )
    if controls.no_repeat_ngram_size > 0:
        raise RequestError(
            "no_repeat_ngram_size: not supported with prompt_embedding_table (the prompt holds virtual tokens)"
        )


def lora_spec(request: Request) -> LoraSpec | None:
    task, weights, config = request.lora_task_id, request.lora_weights, request.lora_config
    if task is None:
        if weights is not None or config is not None:
            raise RequestError(
                "lora_task_id: missing; lora_weights and lora_config need the task id they load"
            )
        return None
    task = check_int("lora_task_id", task)
    if (weights is None) != (config is None):
        given, missing = (
            ("lora_weights", "lora_config") if config is None else ("lora_config", "lora_weights")
        )
        raise RequestError(f"{missing}: missing; {given} needs it (the first request of a task carries both)")
    if config is None:
        return LoraSpec(task)
    if not isinstance(config, (list, tuple)) or not config:
        raise RequestError("lora_config: expected rows [module_id, layer_idx, adapter_size]")
    rows = []
    seen = set()
    for i, row in enumerate(config):
        if (
            not isinstance(row, (list, tuple))
            or len(row) != 3
            or any(isinstance(v, bool) or not isinstance(v, int) for v in row)
        ):
            raise RequestError(
                f"lora_config: row {i} is {row!r}; expected [module_id, layer_idx, adapter_size]"
            )
        module, layer, size = row
        if module not in LORA_MODULE_NAMES:
            known = ", ".join(f"{v} ({k})" for k, v in LORA_MODULES.items())
            raise RequestError(f"lora_config: row {i} has module id {module}; supported module ids: {known}")
        if layer < 0 or size < 1:
            raise RequestError(
                f"lora_config: row {i} needs layer_idx >= 0 and adapter_size >= 1, got {list(row)}"
            )
        if (module, layer) in seen:
            raise RequestError(
                f"lora_config: row {i} repeats module {LORA_MODULE_NAMES[module]} of layer {layer}"
            )
        seen.add((module, layer))
        rows.append((module, layer, size))
    try:
        num_rows = len(weights)
    except TypeError:
        raise RequestError("lora_weights: expected rows [num_lora_modules_layers, D x Hi + Ho x D]") from None
    if num_rows != len(rows):
        raise RequestError(
            f"lora_weights: {num_rows} rows but lora_config has {len(rows)}; give one weight row per config row"
        )
    return LoraSpec(task, tuple(rows), weights)
