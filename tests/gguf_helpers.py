"""A minimal GGUF reader for tests: scalar fields, tensor infos and raw tensor bytes; and a copier
that edits a file's tensors and keeps its keys byte for byte.

Strategy: walk the header with ``struct`` (strings and arrays skipped by their lengths), then
the tensor-info table; tensor data is addressed from the aligned end of the header. Written
independently of skippy's writer and of gguf's GGUFReader, which builds numpy views of every
vocabulary entry and takes seconds per file on a 32000-token vocab.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGML_TYPES = {0: "F32", 1: "F16", 8: "Q8_0"}
_U64 = struct.Struct("<Q").unpack_from


@dataclasses.dataclass
class ParsedGGUF:
    fields: dict[str, object]  # scalars and strings; arrays as their length
    tensors: dict[str, tuple[tuple[int, ...], str, int]]  # name -> (ne, type, absolute offset)
    data: bytes
    kv_end: int  # where the key/value section ends (the tensor-info table starts)


def parse_gguf(path: Path) -> ParsedGGUF:
    data = path.read_bytes()
    assert data[:4] == b"GGUF"
    pos = 4

    def take(fmt: str) -> object:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        nonlocal pos
        length = int(take("Q"))  # type: ignore[call-overload]
        pos += length
        return data[pos - length : pos].decode("utf-8", "replace")

    def value(kind: int) -> object:
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            sub, count = int(take("I")), int(take("Q"))  # type: ignore[call-overload]
            if sub == 8:  # skip the strings by their lengths (a vocabulary: tens of thousands)
                skip = pos
                for _ in range(count):
                    skip += 8 + _U64(data, skip)[0]
                pos = skip
            else:
                pos += struct.calcsize("<" + _GGUF_SCALARS[sub]) * count
            return count
        return take(_GGUF_SCALARS[kind])

    take("I")  # version
    n_tensors, n_kv = int(take("Q")), int(take("Q"))  # type: ignore[call-overload]
    fields = {}
    for _ in range(n_kv):
        key = string()
        fields[key] = value(int(take("I")))  # type: ignore[call-overload]
    kv_end = pos
    infos = []
    for _ in range(n_tensors):
        name = string()
        ne = tuple(int(take("Q")) for _ in range(int(take("I"))))  # type: ignore[call-overload]
        infos.append((name, ne, _GGML_TYPES[int(take("I"))], int(take("Q"))))  # type: ignore[call-overload]
    alignment = int(fields.get("general.alignment", 32))  # type: ignore[call-overload]
    start = (pos + alignment - 1) // alignment * alignment
    tensors = {name: (ne, kind, start + offset) for name, ne, kind, offset in infos}
    assert len(tensors) == n_tensors, "duplicate tensor names"
    return ParsedGGUF(fields, tensors, data, kv_end)


def tensor_f32(parsed: ParsedGGUF, name: str) -> np.ndarray:
    ne, kind, offset = parsed.tensors[name]
    assert kind == "F32"
    return np.frombuffer(parsed.data, dtype=np.float32, count=int(np.prod(ne)), offset=offset)


#: (values, bytes) per block of each type.
_BLOCKS = {"F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34)}
#: A tensor as :func:`copy_gguf` hands it to an edit: (ne, type, raw bytes).
RawTensor = tuple[tuple[int, ...], str, bytes]


def copy_gguf(source: Path, destination: Path,
              edit: Callable[[list[tuple[str, RawTensor]]], list[tuple[str, RawTensor]]]) -> Path:
    """``source`` with its key/value section byte for byte and the tensors ``edit`` returns (raw
    bytes and types kept), laid out as a GGUF writer does (each tensor at an aligned offset)."""
    parsed = parse_gguf(source)
    data = parsed.data
    tensors = []
    for name, (ne, kind, offset) in parsed.tensors.items():
        per, size = _BLOCKS[kind]
        tensors.append((name, (ne, kind, data[offset : offset + int(np.prod(ne)) // per * size])))
    tensors = edit(tensors)
    alignment = int(parsed.fields.get("general.alignment", 32))  # type: ignore[call-overload]
    types = {kind: number for number, kind in _GGML_TYPES.items()}
    head = bytearray(data[:8] + struct.pack("<Q", len(tensors)) + data[16 : parsed.kv_end])
    blobs = bytearray()
    for name, (ne, kind, raw) in tensors:
        encoded = name.encode()
        head += struct.pack("<Q", len(encoded)) + encoded + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, types[kind],
                                                                         len(blobs))
        blobs += raw + bytes(-len(raw) % alignment)
    head += bytes(-len(head) % alignment)
    destination.write_bytes(bytes(head + blobs))
    return destination
