"""Read a GGUF file's metadata and tensor names without loading it (fast path for load checks).

Strategy: parse the header sequentially with ``struct``: scalar metadata values are decoded,
arrays of fixed-size values are skipped by arithmetic, arrays of strings by walking their
lengths (the only per-element work), and the tensor-info table yields names.  Short arrays of
numbers (per-layer hparams such as Gemma 4's sliding-window pattern, at most
``_SMALL_ARRAY`` elements) are decoded as tuples.  Only what
:mod:`skippy.runtime.model` needs is kept.  gguf's ``GGUFReader`` builds numpy views of every
field and takes seconds on a 150k-token vocabulary; this takes milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from pathlib import Path

_MAGIC = b"GGUF"
# GGUF value type -> struct format of one element (strings and arrays handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
#: Arrays of numbers up to this length are decoded (per-layer hparams); longer ones are skipped.
_SMALL_ARRAY = 4096


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file this reader understands."""


class _Cursor:
    def __init__(self, data: bytes, path: Path) -> None:
        self.data = data
        self.offset = 0
        self.path = path

    def take(self, fmt: str) -> object:
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.data):
            raise GGUFHeaderError(f"{self.path}: truncated GGUF header")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = int(self.take("Q"))  # type: ignore[call-overload]
        end = self.offset + length
        if end > len(self.data):
            raise GGUFHeaderError(f"{self.path}: truncated GGUF string")
        text = self.data[self.offset:end].decode("utf-8", "replace")
        self.offset = end
        return text

    def skip_value(self, value_type: int) -> None:
        if value_type in _SCALAR:
            self.offset += struct.calcsize(_SCALAR[value_type])
        elif value_type == _STRING:
            self.offset += int(self.take("Q"))  # type: ignore[call-overload]
        elif value_type == _ARRAY:
            element_type = int(self.take("I"))  # type: ignore[call-overload]
            count = int(self.take("Q"))  # type: ignore[call-overload]
            if element_type in _SCALAR:
                self.offset += count * struct.calcsize(_SCALAR[element_type])
            elif element_type == _STRING:
                unpack = struct.Struct("<Q").unpack_from
                data, offset = self.data, self.offset
                for _ in range(count):
                    offset += 8 + unpack(data, offset)[0]
                self.offset = offset
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        else:
            raise GGUFHeaderError(f"{self.path}: unknown GGUF value type {value_type}")
        if self.offset > len(self.data):
            raise GGUFHeaderError(f"{self.path}: truncated GGUF metadata")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """One row of the tensor-info table: name, dimensions, ggml type and data offset."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFLayout:
    """A GGUF file's scalar metadata, tensor table, and where its header ends.

    ``header_bytes`` is the length of everything before the (aligned) tensor data: the magic,
    the metadata and the tensor-info table.  Hashing those bytes identifies the model's shapes,
    types, tokenizer and layout without reading its weights (:func:`header_digest`).
    """

    metadata: dict[str, object]
    tensors: tuple[TensorEntry, ...]
    header_bytes: int


def read_header(path: Path, chunk: int = 1 << 22) -> tuple[dict[str, object], list[str]]:
    """Scalar metadata (arrays omitted) and tensor names of a GGUF file."""
    layout = read_layout(path, chunk)
    return layout.metadata, [tensor.name for tensor in layout.tensors]


def read_layout(path: Path, chunk: int = 1 << 22) -> GGUFLayout:
    """The metadata, the full tensor table and the header length of a GGUF file.

    Raises:
        GGUFHeaderError: not a GGUF file, or a truncated / malformed header.
    """
    size = path.stat().st_size
    with path.open("rb") as handle:
        length = min(size, chunk)
        while True:
            handle.seek(0)
            cursor = _Cursor(handle.read(length), path)
            try:
                return _parse(cursor)
            except (GGUFHeaderError, struct.error) as exc:
                # the header may extend past what was read: read more, up to the whole file
                if length >= size:
                    raise GGUFHeaderError(f"{path}: truncated or malformed GGUF header ({exc})") from exc
                length = min(size, length * 4)


def header_digest(path: Path, layout: GGUFLayout | None = None) -> str:
    """sha256 (hex) of the file's header bytes: metadata plus tensor index, no weights."""
    layout = layout or read_layout(path)
    with path.open("rb") as handle:
        return hashlib.sha256(handle.read(layout.header_bytes)).hexdigest()


def _small_numeric_array(cursor: _Cursor) -> bool:
    """The array at the cursor holds at most ``_SMALL_ARRAY`` numbers (nothing is consumed)."""
    if cursor.offset + 12 > len(cursor.data):
        return False
    element_type, count = struct.unpack_from("<IQ", cursor.data, cursor.offset)
    return element_type in _SCALAR and count <= _SMALL_ARRAY


def _parse(cursor: _Cursor) -> GGUFLayout:
    if cursor.data[:4] != _MAGIC:
        raise GGUFHeaderError(f"{cursor.path}: not a GGUF file (bad magic)")
    cursor.offset = 4
    version = int(cursor.take("I"))  # type: ignore[call-overload]
    if version < 2:
        raise GGUFHeaderError(f"{cursor.path}: GGUF version {version} is not supported")
    n_tensors = int(cursor.take("Q"))  # type: ignore[call-overload]
    n_kv = int(cursor.take("Q"))  # type: ignore[call-overload]
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cursor.string()
        value_type = int(cursor.take("I"))  # type: ignore[call-overload]
        if value_type in _SCALAR:
            metadata[key] = cursor.take(_SCALAR[value_type])
        elif value_type == _STRING:
            metadata[key] = cursor.string()
        elif value_type == _ARRAY and _small_numeric_array(cursor):
            element = _SCALAR[int(cursor.take("I"))]  # type: ignore[call-overload]
            count = int(cursor.take("Q"))  # type: ignore[call-overload]
            metadata[key] = tuple(cursor.take(element) for _ in range(count))
        else:
            cursor.skip_value(value_type)
    tensors = []
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = int(cursor.take("I"))  # type: ignore[call-overload]
        if not 0 <= n_dims <= 8:
            raise GGUFHeaderError(f"{cursor.path}: tensor {name!r} has {n_dims} dimensions")
        dims = tuple(int(cursor.take("Q")) for _ in range(n_dims))  # type: ignore[call-overload]
        ggml_type = int(cursor.take("I"))  # type: ignore[call-overload]
        offset = int(cursor.take("Q"))  # type: ignore[call-overload]
        tensors.append(TensorEntry(name, dims, ggml_type, offset))
    if cursor.offset > len(cursor.data):
        raise GGUFHeaderError(f"{cursor.path}: truncated GGUF tensor table")
    return GGUFLayout(metadata, tuple(tensors), cursor.offset)
