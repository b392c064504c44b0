"""The tensors of a GGUF file, found without reading its metadata values: the gguf package's reader
parses every key's value into numpy views first, and a model file's tokenizer (SmolLM2's: 49,152 tokens
and 48,900 merges) took it 4.9 s of a 5.7 s load. Here the values are stepped over (a string array
still needs each length read: about 0.05 s) and only the architecture's name is kept.

The layout (GGUF versions 2 and 3, little-endian): magic ``GGUF``, version (u32), tensor count (u64),
key count (u64); each key a string (u64 length, bytes), a value type (u32) and the value (an array: its
element type (u32), count (u64), elements); each tensor's name, dimension count (u32), dimensions (u64,
innermost first), type (u32) and offset (u64) into the data, which starts at the next multiple of
``general.alignment`` (32 by default). The gguf package still names the block formats and their sizes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# value type -> its fixed size in bytes (8: string, 9: array, sized as they are read)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True)
class GgufTensor:
    name: str
    kind: str  # the gguf package's GGMLQuantizationType name: F32, Q4_1, ...
    shape: tuple[int, ...]  # outermost first, as torch has it: (rows, row length)
    data: np.ndarray  # the stored bytes, [rows, bytes per row] (a view of the mapped file)


class GgufIndexError(ValueError):
    """The file is not a GGUF file this reader understands; the message names why."""


def read_gguf_index(path: Path) -> tuple[str, dict[str, GgufTensor]]:
    """``path``'s architecture (``general.architecture``) and its tensors by name."""
    import gguf

    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != b"GGUF":
        raise GgufIndexError(f"{path.name} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GgufIndexError(f"{path.name} is GGUF version {version}; versions 2 and 3 are read")
    pos, arch, alignment = 24, None, gguf.GGUF_DEFAULT_ALIGNMENT

    def string(at: int) -> tuple[str, int]:
        (size,) = struct.unpack_from("<Q", buf, at)
        return buf[at + 8 : at + 8 + size].decode("utf-8", errors="replace"), at + 8 + size

    def skip(kind: int, at: int) -> int:
        if kind == _STRING:
            (size,) = struct.unpack_from("<Q", buf, at)
            return at + 8 + size
        if kind == _ARRAY:
            inner, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if inner in _SIZES:
                return at + count * _SIZES[inner]
            for _ in range(count):
                at = skip(inner, at)
            return at
        return at + _SIZES[kind]

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.architecture" and kind == _STRING:
            arch, pos = string(pos)
        elif key == "general.alignment" and kind == _UINT32:
            (alignment,) = struct.unpack_from("<I", buf, pos)
            pos += 4
        else:
            pos = skip(kind, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, gguf.GGMLQuantizationType(kind), dims, offset))
    start = -(-pos // alignment) * alignment
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = {}
    for name, kind, dims, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        row_bytes = dims[0] // block * size
        raw = data[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GgufTensor(name, kind.name, tuple(reversed(dims)), raw)
    if arch is None:
        raise GgufIndexError(f"{path.name} names no general.architecture")
    return arch, tensors
