"""LoRA adapters from disk, for the library and the CLI: a PEFT adapter directory as the request fields
that carry it (``lora_task_id``, ``lora_config``, ``lora_weights``, TensorRT-LLM's form).

The CLI reads ``lora_dir`` lines through here, as a library user would, rather than reaching into the
runtime; each directory is read once per process however many lines name it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


def lora_fields(directory: str | Path) -> dict[str, Any]:
    """``{lora_task_id, lora_config, lora_weights}`` for a PEFT LoRA directory; the task id derives from
    the directory's resolved path. Raises ValueError naming the file and what is wrong."""
    config, weights, task_id = _read(str(Path(directory)))
    return {"lora_task_id": task_id, "lora_config": config, "lora_weights": weights}


@functools.lru_cache(maxsize=64)
def _read(directory: str) -> tuple[Any, Any, int]:
    from bm.runtime.lora_adapters import read_peft_adapter, task_id_for_directory

    config, weights = read_peft_adapter(Path(directory))
    return config, weights, task_id_for_directory(Path(directory))
