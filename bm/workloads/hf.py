"""Hugging Face ``datasets``, from a local file or directory only (nothing is fetched from the Hub).

Accepted: a directory written by ``save_to_disk`` (a Dataset or a DatasetDict), a directory of data
files, or one data file (``.json``, ``.jsonl``, ``.csv``, ``.parquet``, ``.arrow``). The prompt comes
from ``prompt_column`` (text, or a list of token ids); the output length from ``output_column`` (an
integer, or a completion text whose token count is used) or else from ``bench.output_len``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bm.suggest import did_you_mean
from bm.workloads.jsonl import token_ids
from bm.workloads.request import DatasetError, Row, RowError, Workload, positive_int

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def _load(path: Path, split: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        elif path.suffix.lower() in BUILDERS:
            loaded = datasets.load_dataset(BUILDERS[path.suffix.lower()], data_files=str(path))
        else:
            raise DatasetError(
                f"{path}: not a Hugging Face dataset file; give a directory or a {', '.join(BUILDERS)} file"
            )
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as exc:
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(f"{path}: could not be loaded as a local Hugging Face dataset ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{path}: no split {split!r}; it has {', '.join(loaded)} (set --split)")
        loaded = loaded[split]
    return loaded


def load_hf(
    path: Path, split: str, prompt_column: str, output_column: str | None, default_max_tokens: int
) -> Workload:
    return _to_workload(_load(path, split), path, prompt_column, output_column, default_max_tokens)


def _to_workload(
    dataset: Any, path: Path, prompt_column: str, output_column: str | None, default_max_tokens: int
) -> Workload:
    columns = list(dataset.column_names)
    for option, column in (("--prompt-column", prompt_column), ("--output-column", output_column)):
        if column is not None and column not in columns:
            raise DatasetError(
                f"{path}: no column {column!r} ({option}); it has {', '.join(columns)}"
                f"{did_you_mean(column, columns) or f'; give {option} COLUMN'}"
            )
    prompts = dataset[prompt_column]
    outputs = dataset[output_column] if output_column else [None] * len(prompts)
    requests = []
    for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        req = Row(where=f"row {row}", index=row, user_id=row, max_tokens=default_max_tokens)
        try:
            if isinstance(prompt, str):
                if not prompt:
                    raise RowError(f"{prompt_column}: the prompt is empty")
                req.prompt = prompt
            else:
                req.input_ids = token_ids(prompt, prompt_column)
                req.input_len = len(req.input_ids)
            if isinstance(output, str):
                if not output:
                    raise RowError(f"{output_column}: the completion is empty")
                req.output_text = output
            elif output_column is not None:
                req.max_tokens = positive_int(output, output_column)
        except RowError as exc:
            req.error = f"row {row}: {exc}"
        requests.append(req)
    return Workload("hf", str(path), requests)
