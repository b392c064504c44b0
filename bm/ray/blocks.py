"""The blocks of a ``bm run --ray`` run: fixed line ranges of the prompts file, and their records on disk.

A block is the lines ``[id * block_lines, (id + 1) * block_lines)`` of the file (0-based, blank lines
included, so an index never moves). Fixed ranges make the work of a run a function of the file alone:
a resume after the driver was killed knows which blocks are done by the part files present, whatever
order the replicas finished them in. Each block's records go to ``parts/block-<id>.jsonl``, written in
one step (a temporary file renamed over it), so a part is either whole or absent: a replica that dies
mid-block leaves nothing, and a block that Ray retries is written once. ``outputs.jsonl`` (and an OpenAI batch
file's ``batch_output.jsonl``) is assembled from the parts in input order at the end, each file in one
step too: a driver killed while assembling leaves the previous file or none, never part of one.

Plain Python (no Ray, no torch): the driver plans and assembles here; tests read it without a cluster.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.files import replacing, replacing_text
from bm.runfiles.openai_batch import (
    IgnoredFieldNotices,
    iter_batch_file,
    iter_batch_slice,
    note_ignored_fields,
)
from bm.runfiles.openai_batch_output import BatchOutput
from bm.runfiles.outdir import FINAL_REASONS
from bm.runfiles.served_models import ANY_MODEL, ServedModels
from bm.workloads.json_lines import split_lines
from bm.workloads.jsonl import iter_request_file, iter_request_slice
from bm.workloads.request import Row

PARTS = "parts"
LAYOUT = "layout.json"
OUTPUTS = "outputs.jsonl"
BATCH_OUTPUT = "batch_output.jsonl"


@dataclass(frozen=True)
class Block:
    """Lines ``first_number .. first_number + num_lines - 1`` (1-based) of the file, bytes ``start:end``."""

    block_id: int
    start: int
    end: int
    first_number: int
    num_lines: int

    @property
    def indexes(self) -> range:
        """The 0-based line indexes the block covers (a record's ``index``)."""
        return range(self.first_number - 1, self.first_number - 1 + self.num_lines)


def plan_blocks(path: Path, block_lines: int) -> list[Block]:
    """The file cut into blocks of ``block_lines`` lines, by one pass over its bytes (no parsing)."""
    blocks: list[Block] = []
    start = offset = count = 0
    with path.open("rb") as f:
        for raw in f:
            offset += len(raw)
            count += 1
            if count % block_lines == 0:
                blocks.append(Block(len(blocks), start, offset, count - block_lines + 1, block_lines))
                start = offset
    if count % block_lines:
        blocks.append(Block(len(blocks), start, offset, count - count % block_lines + 1, count % block_lines))
    return blocks


def line_blocks(path: Path, block: Block) -> list[Block]:
    """``block`` as blocks of one line each (ids are line indexes), blank lines left out: how a block that
    failed on every try is narrowed down to the line that fails."""
    out: list[Block] = []
    offset = block.start
    for number, raw in enumerate(split_lines(read_bytes(path, block)), start=block.first_number):
        if raw.strip():
            out.append(Block(number - 1, offset, offset + len(raw), number, 1))
        offset += len(raw)
    return out


def block_row(block: Block, verdicts: dict[int, str], kept: dict[int, Any]) -> dict[str, Any]:
    """The Ray Data row that stands for ``block``: where its lines are, the whole file's verdicts on them
    (index -> error) and the indexes whose records a resume keeps (they do not run again)."""
    return {
        "block": block.block_id,
        "start": block.start,
        "end": block.end,
        "first": block.first_number,
        "lines": block.num_lines,
        "verdicts": json.dumps({i: verdicts[i] for i in block.indexes if i in verdicts}),
        "skip": json.dumps(sorted(kept)),
    }


def read_bytes(path: Path, block: Block) -> bytes:
    with path.open("rb") as f:
        f.seek(block.start)
        return f.read(block.end - block.start)


def block_rows(
    data: bytes,
    block: Block,
    base: Path,
    verdicts: dict[int, str],
    batch: bool = False,
    served: ServedModels = ANY_MODEL,
) -> Iterator[Row]:
    """The checked rows of ``block`` (its bytes ``data``; ``base``: the file's directory), read as bm
    request lines or, for an OpenAI batch file (``batch``), as batch lines by the one-process reader's
    parser (bm.runfiles.openai_batch). ``verdicts`` (index -> error) are the whole file's reader's, which
    alone sees an id repeated on another block's line; they win over the slice's own. ``served``: what a
    batch line's ``body.model`` may name (the replica's config)."""
    if batch:
        rows: Iterable[Row] = (line.parsed for line in iter_batch_slice(data, block.first_number, served))
    else:
        rows = iter_request_slice(data, block.first_number, base)
    for row in rows:
        if row.index in verdicts:
            row.error = verdicts[row.index]
        yield row


def file_verdicts(
    path: Path,
    batch: bool = False,
    notices: IgnoredFieldNotices | None = None,
    served: ServedModels = ANY_MODEL,
) -> dict[int, str]:
    """Index -> error of every line the reader refuses, from one streaming pass over the whole file with
    the validator every ``bm run`` uses (bm.workloads.jsonl): the lines that cannot run, and the
    duplicate ids only a reader of the whole file can find. Empty for an OpenAI batch file (``batch``):
    its one whole-file check, duplicate custom ids, refuses the file before the run starts
    (bm.runfiles.source.check_runnable), and every other verdict is the line's own. With ``notices``, a batch
    file's pass (lines routed by ``served``) says each body field bm ignores, once per name, as a
    one-process run does while it reads: the driver runs this before any replica starts, and the
    replicas, which read their own blocks, say nothing of it."""
    if batch:
        if notices is not None:
            note_ignored_fields(path, served, notices)
        return {}
    return {row.index: row.error for row in iter_request_file(path) if row.error is not None}


class PartStore:
    """``OUT/parts``: one JSONL file of records per finished block, and ``layout.json`` (the block size
    the part files were cut with, which a resume keeps)."""

    def __init__(self, out_dir: Path) -> None:
        self.dir = out_dir / PARTS

    def exists(self) -> bool:
        return (self.dir / LAYOUT).is_file()

    def block_lines(self) -> int | None:
        """The block size of the parts already here (None: no run has started here)."""
        try:
            value = json.loads((self.dir / LAYOUT).read_text(encoding="utf-8"))["block_lines"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return value if isinstance(value, int) and value > 0 else None

    def start(self, block_lines: int) -> None:
        """A fresh run: no parts, this block size."""
        if self.dir.exists():
            for stale in self.dir.iterdir():
                stale.unlink()
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.dir / LAYOUT, json.dumps({"block_lines": block_lines}) + "\n")

    def path(self, block_id: int) -> Path:
        return self.dir / f"block-{block_id:08d}.jsonl"

    def has(self, block_id: int) -> bool:
        return self.path(block_id).is_file()

    def read(self, block_id: int) -> list[dict[str, Any]]:
        text = self.path(block_id).read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line]

    def write(self, block_id: int, records: list[dict[str, Any]]) -> None:
        """The block's records in index order, in one step (a kill leaves the old part or none)."""
        ordered = sorted(records, key=lambda r: r["index"])
        _write_atomic(self.path(block_id), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered))

    def kept(self, block_id: int) -> dict[int, dict[str, Any]] | None:
        """``--resume``: the block's final records by index (a failed line's record is not final: it runs
        again, as in a plain resume); None when the block has no part."""
        if not self.has(block_id):
            return None
        return {r["index"]: r for r in self.read(block_id) if r.get("finish_reason") in FINAL_REASONS}


def assemble(
    store: PartStore,
    blocks: list[Block],
    out_dir: Path,
    missing: Callable[[Block], list[dict[str, Any]]],
    count: Callable[[dict[str, Any]], None],
    batch_output: Callable[[Path], BatchOutputLines] | None = None,
) -> int:
    """Write ``outputs.jsonl`` from the parts, in input order; a block without a part (an interrupted
    run) gets ``missing(block)``'s records. ``batch_output`` (an OpenAI batch file's run) opens the
    writer of ``batch_output.jsonl`` on the path it is given, and every record goes to it as well. Each
    file is written in one step (:func:`bm.files.replacing`). ``count`` sees every record; returns how many."""
    written = 0
    with contextlib.ExitStack() as files:  # closed, then renamed, in the reverse order of opening
        outputs = files.enter_context(replacing(out_dir / OUTPUTS))
        f = files.enter_context(outputs.open("w", encoding="utf-8"))
        output = None
        if batch_output is not None:
            lines = files.enter_context(replacing(out_dir / BATCH_OUTPUT))
            output = files.enter_context(contextlib.closing(batch_output(lines)))
        for block in blocks:
            records = store.read(block.block_id) if store.has(block.block_id) else missing(block)
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                count(record)
                if output is not None:
                    output.write(record)
                written += 1
    return written


class BatchOutputLines:
    """``batch_output.jsonl`` of a run over an OpenAI batch file, written by the driver from the records
    as ``outputs.jsonl`` is assembled (in input order), with the one-process run's writer
    (:class:`~bm.runfiles.openai_batch_output.BatchOutput`) into ``path`` (assembly's temporary file):
    one output line per input line. Every assembly writes it whole, from kept and new records alike, so
    after a ``--resume`` it holds each line once."""

    def __init__(
        self,
        prompts: Path,
        path: Path,
        model_name: str,
        decode_token: Callable[[int], str] | None,
        served: ServedModels = ANY_MODEL,
    ) -> None:
        self.lines = iter_batch_file(prompts, served)  # in input order, as the records come
        self.output = BatchOutput(path.parent, model_name, decode_token, path=path)

    def write(self, record: dict[str, Any]) -> None:
        """The output line of ``record`` (the next record in input order)."""
        for line in self.lines:
            if line.parsed.index == record["index"]:
                self.output.write(line, record)
                return
        raise RuntimeError(f"record {record['index']} answers no line of the batch file")

    def close(self) -> None:
        self.output.close()


def _write_atomic(path: Path, text: str) -> None:
    with replacing_text(path) as f:
        f.write(text)
