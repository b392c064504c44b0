"""From a ``bench`` config to a ready workload: pick the loader, choose the rows, fix every length.

Order matters and is the same for every format: read all rows -> check trace order -> shuffle (seeded)
-> take ``num_requests`` -> tokenize text / scale lengths / cap them -> generate token ids where the
dataset has lengths only. Generating last, in replay order, from one seeded generator makes a run
repeatable: the Azure trace with ``--num-requests 128 --input-scale 0.25 --output-scale 0.25
--max-input-len 1024 --max-output-len 256`` gives the reference workload's lengths (28,239 prompt and
6,235 output tokens, as the team's ``make_workload.py`` does; the random ids differ, numpy's generator
being not Python's ``random``). docs/performance.md writes the benchmark scripts' workload this way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

import numpy as np

from bm.config import DATASET_KINDS, BenchConfig
from bm.workloads.hf import BUILDERS, load_hf
from bm.workloads.jsonl import KNOWN_KEYS, WORD_LISTS, chat_ids, iter_lines, resolve_word_list
from bm.workloads.records import load_bm_jsonl, load_sharegpt, load_trtllm_jsonl
from bm.workloads.request import DatasetError, Row, RowError, Workload, check_order
from bm.workloads.synthetic import load_synthetic

Encode = Callable[[str], list[int]]
RenderChat = Callable[..., list[int]]  # (messages, tools=None) -> prompt ids
BM_KEYS = KNOWN_KEYS - {"id"}  # the fields that mark a line as bm's format (any table may have an id)
FIRST_RANDOM_ID = 3  # ids 0-2 are pad/bos/eos in most vocabularies (and in make_workload.py)

LOADERS: dict[str, Callable[[Path, BenchConfig], Workload]] = {
    "bm": lambda path, b: load_bm_jsonl(path, b.output_len),
    "trtllm": lambda path, _b: load_trtllm_jsonl(path),
    "sharegpt": lambda path, _b: load_sharegpt(path),
    # the trace readers need pandas: imported when a trace is read, so other errors are reported at once
    "azure": lambda path, _b: import_module("bm.workloads.traces").load_azure(path),
    "mooncake": lambda path, b: import_module("bm.workloads.traces").load_mooncake(path, b.hash_block_size),
    "hf": lambda path, b: load_hf(path, b.split, b.prompt_column, b.output_column, b.output_len),
}


def detect_kind(path: Path, prompt_column: str = "prompt") -> str:
    """The kind a file most likely is, from its suffix and first record; ambiguity is an error.

    A JSONL file is bm's format only when its first record has a field of bm's own (``id`` alone
    does not count); a table of other columns (``{"question": ..., "answer": ...}``) is an ``hf``
    dataset, read with ``--prompt-column``, as is any file whose first record holds the column that
    ``--prompt-column`` names. The shipped HF sample used to be read as bm lines: every row failed on
    ``unknown field 'answer'`` and ``--prompt-column`` could not switch it."""
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix == ".csv":
        header = path.open(encoding="utf-8-sig").readline().strip().split(",")
        header = [h.strip() for h in header]
        if "TIMESTAMP" in header and "ContextTokens" in header:
            return "azure"
        if "input_length" in header:
            return "mooncake"
        raise DatasetError(
            f"{path}: cannot tell the kind of this CSV from its columns ({', '.join(header)}); "
            "give --dataset-kind (azure, mooncake or hf)"
        )
    if suffix == ".json":
        start = path.open(encoding="utf-8-sig").read(4096).lstrip()[:1]
        if start == "[":
            return "sharegpt"
    if suffix == ".jsonl":
        first = _first_json_line(path)
        if "custom_id" in first and "body" in first:  # OpenAI Batch API input: the prompt is in body
            return "openai-batch"
        if "task_id" in first:
            return "trtllm"
        if "input_length" in first or "hash_ids" in first:
            return "mooncake"
        if prompt_column != "prompt" and prompt_column in first:
            return "hf"
        return "bm" if any(key in BM_KEYS for key in first) or not first else "hf"
    if suffix in BUILDERS:
        return "hf"
    kinds = ", ".join(k for k in sorted(set(DATASET_KINDS.values())) if k != "auto")
    raise DatasetError(f"{path}: cannot tell the dataset kind from its name; give --dataset-kind ({kinds})")


def _first_json_line(path: Path) -> dict:
    for _number, data in iter_lines(path):
        return data if isinstance(data, dict) else {}
    return {}


def read_workload(bench: BenchConfig) -> Workload:
    """Every row of the dataset, unselected and untokenized."""
    if bench.dataset_kind == "synthetic":
        return load_synthetic(bench)
    if bench.dataset is None:
        raise DatasetError("no dataset: give a DATASET path, or --dataset-kind synthetic")
    path = Path(bench.dataset)
    if not path.exists():
        raise DatasetError(f"dataset {str(path)!r} does not exist")
    try:
        kind = detect_kind(path, bench.prompt_column) if bench.dataset_kind == "auto" else bench.dataset_kind
        if kind != "hf" and path.is_dir():
            raise DatasetError(f"{path} is a directory; only --dataset-kind hf reads directories")
        if kind not in LOADERS:  # openai-batch: its reader is the CLI's (bm.runfiles.openai_batch)
            raise DatasetError(f"{path}: {kind} files are read by the bm bench and bm run commands")
        workload = LOADERS[kind](path, bench)
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not workload.requests:  # refused here, before a model loads only to run nothing
        skipped = (
            f" ({workload.num_skipped} skipped: {workload.skipped_reason})" if workload.num_skipped else ""
        )
        raise DatasetError(
            f"{path}: no requests in this {kind} dataset{skipped}; give a file with at least one"
        )
    return workload


def load_workload(
    bench: BenchConfig,
    *,
    vocab_size: int,
    encode: Encode | None,
    encode_word: Encode | None = None,
    workload: Workload | None = None,
    render_chat: RenderChat | None = None,
) -> Workload:
    """The workload ``bm bench`` replays: selected, tokenized, scaled and capped, in replay order.

    ``encode_word`` tokenizes the strings of word lists and stop strings (without the special tokens a
    prompt gets); ``render_chat`` turns a chat row's ``messages`` into prompt ids with the model's chat
    template (``bm run``'s codec, :class:`bm.runfiles.prompts.Codec`); ``workload`` is the result of
    :func:`read_workload` when the caller read the file already (before loading the model, so a bad file
    is reported at once)."""
    workload = workload if workload is not None else read_workload(bench)
    requests = workload.requests
    if bench.trace_timestamps:
        missing = next((r for r in requests if r.ok and r.arrival_time is None), None)
        if missing is not None:
            field = "arrival_time" if workload.kind == "bm" else "timestamp"
            raise DatasetError(
                f"{missing.where}: no {field}; --trace-timestamps needs one on every row "
                f"(this {workload.kind} dataset may have none: use --rate instead)"
            )
        check_order(requests, "arrival_time" if workload.kind == "bm" else "timestamp")
    if bench.shuffle:
        random.Random(bench.seed).shuffle(requests)
    if bench.num_requests is not None:
        del requests[bench.num_requests :]
    _finalize(workload, bench, vocab_size, encode, encode_word or encode, render_chat)
    return workload


def _scaled(value: int, scale: float) -> int:
    return value if scale == 1.0 else max(1, round(value * scale))


def _finalize(
    workload: Workload,
    bench: BenchConfig,
    vocab_size: int,
    encode: Encode | None,
    encode_word: Encode | None,
    render_chat: RenderChat | None = None,
) -> None:
    # numpy draws a prompt's ids in one call; random.randrange per token cost seconds per thousand
    # requests of a long trace
    id_rng = np.random.default_rng(bench.seed % 2**64)
    low = FIRST_RANDOM_ID if vocab_size > FIRST_RANDOM_ID + 1 else 0
    block_size = _scaled(workload.hash_block_size, bench.input_scale) if workload.hash_block_size else 0
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = np.random.default_rng([bench.seed % 2**64, hash_id % 2**64])
            blocks[hash_id] = rng.integers(low, vocab_size, block_size).tolist()
        return blocks[hash_id]

    for req in workload.requests:
        if not req.ok:
            continue
        if req.lora_dir is not None:  # bm run applies it; a replay runs the base model alone
            req.error = (
                f"{req.where}: lora_dir: bm bench replays on the base model and applies no adapter, so "
                "it would time another model's answers; run this file with bm run"
            )
            continue
        try:
            _tokenize(req, encode, render_chat)
            for name in WORD_LISTS:
                if name in req.fields:
                    req.fields[name] = resolve_word_list(req.fields[name], name, encode_word)
            if req.stop:  # stop strings end a request as bm run's do: as stop words
                stops = resolve_word_list(req.stop, "stop", encode_word)
                req.fields["stop_words_list"] = [*req.fields.get("stop_words_list", []), *stops]
                req.stop = []
        except RowError as exc:
            req.error = f"{req.where}: {exc}"
            continue
        req.max_tokens = _capped(
            _scaled(req.max_tokens or bench.output_len, bench.output_scale), bench.max_output_len
        )
        n = _capped(_scaled(req.input_len, bench.input_scale), bench.max_input_len)
        if req.input_ids is not None:
            req.input_ids = _resize(req.input_ids, n)
        else:
            shared = [t for h in (req.hash_ids or []) for t in block(h)][:n]
            req.input_ids = shared + id_rng.integers(low, vocab_size, n - len(shared)).tolist()
        req.input_len = len(req.input_ids)


def _tokenize(req: Row, encode: Encode | None, render_chat: RenderChat | None = None) -> None:
    for text in (req.prompt, req.output_text, req.messages):
        if text is not None and encode is None:
            raise DatasetError(
                f"{req.where}: the dataset holds text but the model has no tokenizer; set model.tokenizer "
                "(or model.path to a checkpoint with one), or use a dataset with token ids or lengths"
            )
    if req.messages is not None:
        req.input_ids = chat_ids(req, render_chat)
        req.input_len = len(req.input_ids)
    if req.prompt is not None:
        req.input_ids = list(encode(req.prompt))  # type: ignore[misc]
        if not req.input_ids:
            raise RowError("prompt: the prompt encodes to no tokens")
        req.input_len = len(req.input_ids)
    if req.output_text is not None:
        req.max_tokens = len(encode(req.output_text))  # type: ignore[misc]
        if req.max_tokens < 1:
            raise RowError("the completion encodes to no tokens, so its output length would be 0")


def _capped(value: int, cap: int | None) -> int:
    return value if cap is None else min(value, cap)


def _resize(ids: list[int], n: int) -> list[int]:
    """Truncate, or repeat the prompt cyclically, to ``n`` tokens (``--input-scale`` on real prompts)."""
    if n <= len(ids):
        return ids[:n]
    return (ids * (n // len(ids) + 1))[:n]
