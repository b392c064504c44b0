"""The input file of ``bm run`` (its prompts) and of ``bm bench`` / ``compare`` / ``sweep`` (their dataset) as
bm reads it: a regular file, or a private copy of what was piped in.

A pipe (``bm run -``, ``/dev/stdin``, ``<(...)``) can be read once only, while a run reads its input
three times: the digest that ``run.json`` records (so ``--resume`` can refuse another file), the line
count of the progress bar, and the run itself. Reading a pipe straight away gave the digest of the
whole input and a run of nothing. So a pipe, and a gzip file, are copied once to a temporary file (on
disk, so a large input costs no memory), and every later reader sees those same bytes. ``bm bench``'s
readers take the same copy (:func:`open_dataset`): one reader of pipes and gzip for every command.

Before the model loads the file is also checked to hold at least one line that can run: binary junk,
a CSV trace, a broken gzip file or a file whose every line is refused is one usage error (exit 2)
naming the file, the first bad line and the fix, not a model load followed by thousands of error
records. Plain Python (no torch).
"""

from __future__ import annotations

import atexit
import contextlib
import gzip
import os
import shutil
import stat
import sys
import tempfile
import zlib
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import BinaryIO

GZIP_MAGIC = b"\x1f\x8b"
STDIN_NAMES = ("-",)
SNIFF_BYTES = 4096
BOM = b"\xef\xbb\xbf"
# The suffixes bm bench's kind detection reads a dataset's format from (bm.workloads.detect_kind).
DATASET_SUFFIXES = (".jsonl", ".json", ".csv")


class PromptsFileError(ValueError):
    """The prompts file cannot run at all; phrased for the user (exit code 2)."""


@dataclass(frozen=True)
class PromptsSource:
    """``name``: the input as the user gave it (``-``, ``/dev/stdin``, ``p.jsonl.gz``), for messages and
    the printed resume command; ``path``: a regular file of JSONL text that every reader opens."""

    name: str
    path: Path
    copied: bool = False  # path is bm's private copy (a pipe, or decompressed gzip)


def open_prompts(given: Path | str, has_tokenizer: bool = True) -> PromptsSource:
    """The readable JSONL behind ``given``, checked to hold a line that can run; raises
    :class:`PromptsFileError` for an input that cannot run (missing, a directory, a terminal, broken
    gzip, empty, binary, a CSV table, every line refused) before anything loads. ``has_tokenizer``
    False: the model is known to have none (:attr:`bm.config.ModelConfig.has_no_tokenizer`), so a line
    that gives text cannot run either.

    Ranks other than 0 of a multi-rank run re-run the same command line but never read the prompts:
    they must not consume a pipe that rank 0 reads."""
    name = str(given)
    if int(os.environ.get("RANK", "0") or 0) > 0:
        return PromptsSource(name, Path(given))
    if name in STDIN_NAMES:
        if sys.stdin is None or sys.stdin.isatty():
            raise PromptsFileError(
                "prompts '-' reads standard input, but nothing is piped in; e.g. "
                "cat prompts.jsonl | bm run - -o out"
            )
        return _checked(_copied(name, sys.stdin.buffer), has_tokenizer)
    path = Path(given)
    if path.is_dir():
        raise PromptsFileError(f"prompts file {name!r} is a directory; give a JSONL file")
    if not path.exists():
        raise PromptsFileError(f"prompts file {name!r} does not exist")
    if not os.access(path, os.R_OK):
        raise PromptsFileError(f"prompts file {name!r} is not readable (permissions)")
    if not stat.S_ISREG(path.stat().st_mode):  # a pipe, /dev/stdin, <(...): readable once only
        with path.open("rb") as stream:
            return _checked(_copied(name, stream), has_tokenizer)
    with path.open("rb") as f:
        if f.read(2) == GZIP_MAGIC:
            f.seek(0)
            return _checked(_copied(name, f), has_tokenizer)
    return _checked(PromptsSource(name, path), has_tokenizer)


def open_dataset(given: Path | str) -> PromptsSource:
    """``bm bench``'s dataset (and ``bm compare``'s, ``bm sweep``'s) as its readers open it: by name.

    A regular file or a directory is itself (the readers say what is wrong with a missing one). A pipe
    (``-``, ``/dev/stdin``, ``<(...)``) or a gzip file is copied once to a temporary regular file: the
    kind detection reads the file before its reader does, which a pipe allows once only, and every
    reader then sees the same bytes. The copy's suffix tells the kind detection the format: a gzip
    file's inner suffix (``trace.csv.gz``: ``.csv``), else the text's first byte (``{``: JSONL, ``[``:
    a JSON list such as ShareGPT, anything else: a CSV table). Raises :class:`PromptsFileError` for
    standard input that is a terminal, gzip that does not decompress, or nothing at all."""
    name = str(given)
    if name in STDIN_NAMES:
        if sys.stdin is None or sys.stdin.isatty():
            raise PromptsFileError(
                "dataset '-' reads standard input, but nothing is piped in; e.g. "
                "zcat trace.jsonl.gz | bm bench - -o out"
            )
        return _suffixed(_copied(name, sys.stdin.buffer, "dataset", ".input"))
    path = Path(given)
    if not path.exists() or path.is_dir():
        return PromptsSource(name, path)
    if not stat.S_ISREG(path.stat().st_mode):
        with path.open("rb") as stream:
            return _suffixed(_copied(name, stream, "dataset", ".input"))
    with path.open("rb") as f:
        if f.read(2) != GZIP_MAGIC:
            return PromptsSource(name, path)
        f.seek(0)
        unzipped = path.name[:-3] if path.name.lower().endswith(".gz") else path.name
        inner = Path(unzipped).suffix.lower()  # trace.csv.gz -> .csv
        if inner in DATASET_SUFFIXES:
            return _copied(name, f, "dataset", inner)
        return _suffixed(_copied(name, f, "dataset", ".input"))


def _suffixed(source: PromptsSource) -> PromptsSource:
    """A copy of unnamed text moved to a file whose suffix its first byte implies (see
    :func:`open_dataset`); an empty copy is refused, since no kind can be told from nothing."""
    with source.path.open("rb") as f:
        head = f.read(SNIFF_BYTES).lstrip().removeprefix(BOM).lstrip()
    if not head:
        raise PromptsFileError(
            f"dataset {source.name!r} is empty (nothing was piped in, or only blank lines); give a "
            "dataset with at least one request"
        )
    suffix = {b"{": ".jsonl", b"[": ".json"}.get(head[:1], ".csv")
    fd, temp = tempfile.mkstemp(prefix="bm-input-", suffix=suffix)  # reserves the name
    os.close(fd)
    atexit.register(_remove, temp)
    os.replace(source.path, temp)
    return replace(source, path=Path(temp))


def _checked(source: PromptsSource, has_tokenizer: bool) -> PromptsSource:
    check_runnable(source, has_tokenizer)
    return source


def _copied(name: str, stream: BinaryIO, what: str = "prompts file", suffix: str = ".jsonl") -> PromptsSource:
    """Copy a stream (decompressing gzip, found by its magic bytes) to a temporary file removed at exit;
    ``suffix`` is the copy's (a dataset's kind is detected from it)."""
    fd, temp = tempfile.mkstemp(prefix="bm-input-", suffix=suffix)
    atexit.register(_remove, temp)
    with os.fdopen(fd, "wb") as out:
        head = stream.read(2)
        if head == GZIP_MAGIC:
            _gunzip(name, head, stream, out, what)
        else:
            out.write(head)
            shutil.copyfileobj(stream, out, 1 << 20)
    return PromptsSource(name, Path(temp), copied=True)


class _Prefixed:
    """A stream with bytes already read put back in front (gzip needs the magic it was sniffed by)."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        self.head, self.stream = head, stream

    def read(self, size: int = -1) -> bytes:
        if self.head:
            data, self.head = self.head, b""
            return data
        return self.stream.read(size)


def _gunzip(name: str, head: bytes, stream: BinaryIO, out: BinaryIO, what: str) -> None:
    try:
        with gzip.GzipFile(fileobj=_Prefixed(head, stream), mode="rb") as unzipped:  # type: ignore[arg-type]
            shutil.copyfileobj(unzipped, out, 1 << 20)
    except (OSError, EOFError, zlib.error) as exc:
        raise PromptsFileError(
            f"{what} {name!r} starts as gzip but does not decompress ({exc}); the file is truncated "
            "or corrupt: download it again, or give the uncompressed file"
        ) from None


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def check_runnable(source: PromptsSource, has_tokenizer: bool = True) -> None:
    """Refuse, before the model loads, a file where no line can run: one with no request (empty or blank),
    binary data, a CSV table, or lines that are all refused by the reader. A file with one good line runs (each bad line gets its record):
    a line holding a NUL byte is one refused line wherever it is, and binary data is a file of them.

    The reader is the one the run uses (bm lines or OpenAI batch lines, told apart by the first JSON
    object, as :func:`bm.runfiles.openai_batch.is_batch_file` does); it stops at the first good line, so a
    good file costs one line here, and a file of junk one pass of its lines."""
    from bm.runfiles.openai_batch import batch_lines, check_unique_custom_ids, is_batch_object
    from bm.workloads.json_lines import iter_lines
    from bm.workloads.jsonl import check_without_tokenizer, iter_request_lines
    from bm.workloads.request import RowError

    lines = iter_lines(source.path)
    # Lines before the first object are refused by either reader: counted, and only the first one is
    # parsed, for its message (a binary file is millions of such lines).
    first_bad, first_object, count = None, None, 0
    for line in lines:
        if isinstance(line[1], dict):
            first_object = line
            break
        if first_bad is None:
            first_bad = line
        else:
            count += 1
    batch = first_object is not None and is_batch_object(first_object[1])
    replayed = chain([x for x in (first_bad, first_object) if x is not None], lines)
    base = source.path.parent
    rows = (line.parsed for line in batch_lines(replayed)) if batch else iter_request_lines(replayed, base)
    first_error = None
    for row in rows:
        if row.error is None and not has_tokenizer:
            try:
                check_without_tokenizer(row)
            except RowError as exc:
                row.error = f"{row.where}: {exc}"
        if row.error is None:
            if batch:
                check_unique_custom_ids(source.path, source.name)
            return
        count += 1
        first_error = first_error or row.error
    if count == 0:  # blank by the reader's rule, the one the run skips lines by (U+00A0 is whitespace too)
        raise PromptsFileError(
            f"prompts file {source.name!r} holds no request (it is empty, or its lines hold only "
            'whitespace); give one JSON object per line, e.g. {"prompt": "Hello"}'
        )
    with source.path.open("rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\x00" in head:  # only the words: a NUL refuses its line wherever it is, and the file when all are
        raise PromptsFileError(
            f"prompts file {source.name!r} is binary data (it holds NUL bytes), not JSONL text; give one "
            'JSON object per line, e.g. {"prompt": "Hello"}'
        )
    first_line = head.lstrip(b"\xef\xbb\xbf").split(b"\n", 1)[0].strip()
    if not first_line.startswith((b"{", b"[")) and b"," in first_line:
        raise PromptsFileError(
            f"prompts file {source.name!r} is a CSV table (first line: "
            f"{first_line[:80].decode('utf-8', 'replace')!r}), not JSONL; bm run reads one JSON object per "
            "line. To replay a trace, use bm bench FILE (e.g. --dataset-kind azure)"
        )
    raise PromptsFileError(
        f"prompts file {source.name!r}: none of its {count} line(s) can run; the first: {first_error}"
    )
