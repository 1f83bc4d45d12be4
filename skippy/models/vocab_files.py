# Real tokenizers for synthetic models, taken from llama.cpp's vocab-only GGUF files.
#
# Strategy: the llama.cpp source tree ships `models/ggml-vocab-<name>.gguf` files that hold a
# complete tokenizer and no tensors. `vocab_path` finds one by looking, in order, at
# $SKIPPY_VOCAB_DIR, the package's own `vocab/` folder (filled by the native build, gitignored),
# and the two source trees the build leaves under `build/`; a miss names the file and every place
# searched. `read_tokenizer` copies every `tokenizer.*` key with its exact GGUF value type; string
# values are carried as raw bytes so the copy is byte-exact even for tokens that are not valid
# UTF-8 on their own. The key/value section is parsed here directly (see `_parse_kv` for why not
# gguf's GGUFReader), and reads are memoised per (path, size, mtime) because the test suite
# writes many models from the same three vocabularies. One vocabulary is derived rather than read:
# "harmony" is llama-bpe's with gpt-oss's Harmony special tokens (`<|start|>`, `<|channel|>`,
# `<|message|>`, `<|end|>`, `<|return|>`, `<|call|>`, `<|constrain|>`) renamed into its reserved
# control slots, `<|return|>` the end of sequence and no BOS added, as gpt-oss's o200k_harmony has
# them; llama.cpp's loader then treats them as it treats gpt-oss's (`<|return|>` / `<|call|>` end
# the generation, `<|end|>` does not). No gpt-oss vocab-only file ships with the llama.cpp tree.
from __future__ import annotations

import functools
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
from gguf import GGUFValueType

from skippy.models.spec import VocabName

__all__ = [
    "TokenizerField",
    "Tokenizer",
    "VocabNotFoundError",
    "read_tokenizer",
    "vocab_path",
    "vocab_search_dirs",
]

#: Environment variable naming a directory that holds the ggml-vocab-*.gguf files.
VOCAB_DIR_ENV: Final = "SKIPPY_VOCAB_DIR"

_PACKAGE_VOCAB_DIR: Final = Path(__file__).resolve().parent / "vocab"
_REPO_ROOT: Final = Path(__file__).resolve().parents[2]
_SOURCE_TREE_DIRS: Final = (
    _REPO_ROOT / "build" / "llama-src" / "models",
    _REPO_ROOT / "build" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "models",
)


class VocabNotFoundError(FileNotFoundError):
    """A vocab-only GGUF file is in none of the searched directories."""


@dataclass(frozen=True, slots=True)
class TokenizerField:
    """One ``tokenizer.*`` key/value pair, typed as in the source file.

    ``value`` is a scalar (int, float, bool, bytes for strings) or, for arrays, a list of them.
    """

    key: str
    value: object
    type: GGUFValueType
    sub_type: GGUFValueType | None


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """The tokenizer keys of one vocab file, plus what the model writer needs to know."""

    name: VocabName
    path: Path
    sha256: str
    n_vocab: int
    fields: tuple[TokenizerField, ...]


def vocab_search_dirs() -> list[Path]:
    """Return the directories `vocab_path` searches, in order."""
    dirs: list[Path] = []
    env = os.environ.get(VOCAB_DIR_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    dirs.append(_PACKAGE_VOCAB_DIR)
    dirs.extend(_SOURCE_TREE_DIRS)
    return dirs


def vocab_path(name: VocabName) -> Path:
    """Find ``ggml-vocab-<name>.gguf``.

    Args:
        name: the vocabulary, e.g. ``"llama-spm"``, ``"llama-bpe"`` or ``"qwen2"``.

    Returns:
        The path of the first match.

    Raises:
        VocabNotFoundError: the file is in none of the directories of `vocab_search_dirs`.
    """
    file_name = f"ggml-vocab-{name}.gguf"
    searched = vocab_search_dirs()
    for directory in searched:
        candidate = directory / file_name
        if candidate.is_file():
            return candidate
    places = "\n  ".join(str(d) for d in searched)
    raise VocabNotFoundError(
        f"{file_name} not found; searched:\n  {places}\n"
        f"Set {VOCAB_DIR_ENV} to a directory holding it (the llama.cpp source tree's models/ "
        "folder has it), or run the native build, which copies it into skippy/models/vocab/."
    )


#: The derived "harmony" vocabulary: llama-bpe's token id -> the Harmony token written there.
HARMONY_TOKENS: Final[dict[int, bytes]] = {
    128000: b"<|startoftext|>", 128001: b"<|endoftext|>", 128002: b"<|return|>", 128003: b"<|constrain|>",
    128004: b"<|channel|>", 128005: b"<|start|>", 128006: b"<|end|>", 128007: b"<|message|>", 128008: b"<|call|>",
    128009: b"<|reserved_200001|>",  # llama-bpe's <|eot_id|>: it would end the generation
}
_DERIVED: Final[dict[str, VocabName]] = {"harmony": "llama-bpe"}


def _harmony(base: Tokenizer) -> Tokenizer:
    fields: list[TokenizerField] = []
    for field in base.fields:
        if field.key == "tokenizer.ggml.tokens":
            tokens = list(field.value)  # type: ignore[call-overload]
            for index, text in HARMONY_TOKENS.items():
                tokens[index] = text
            field = TokenizerField(field.key, tokens, field.type, field.sub_type)
        elif field.key == "tokenizer.ggml.eos_token_id":
            field = TokenizerField(field.key, 128002, field.type, field.sub_type)
        fields.append(field)
    fields.append(TokenizerField("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL, None))
    digest = hashlib.sha256(f"harmony:{base.sha256}:{sorted(HARMONY_TOKENS.items())}".encode()).hexdigest()
    return Tokenizer("harmony", base.path, digest, base.n_vocab, tuple(fields))


def read_tokenizer(name: VocabName) -> Tokenizer:
    """Read every ``tokenizer.*`` key of a vocab-only GGUF.

    Args:
        name: the vocabulary.

    Returns:
        The tokenizer fields (in file order), the token count and the file's sha256.

    Raises:
        VocabNotFoundError: see `vocab_path`.
        ValueError: the file has no ``tokenizer.ggml.tokens`` array.
    """
    if name in _DERIVED:
        return _harmony(read_tokenizer(_DERIVED[name]))
    path = vocab_path(name)
    stat = path.stat()
    return _read_tokenizer_cached(name, str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_tokenizer_cached(name: VocabName, path: str, size: int, mtime_ns: int) -> Tokenizer:
    del size, mtime_ns  # only part of the memoisation key
    data = Path(path).read_bytes()
    fields = tuple(f for f in _parse_kv(data, path) if f.key.startswith("tokenizer."))
    tokens = next((f for f in fields if f.key == "tokenizer.ggml.tokens"), None)
    if tokens is None or not isinstance(tokens.value, list):
        raise ValueError(f"{path} has no tokenizer.ggml.tokens array")
    digest = hashlib.sha256(data).hexdigest()
    return Tokenizer(name, Path(path), digest, len(tokens.value), fields)


# A direct parser of the GGUF header and key/value section. gguf's GGUFReader builds one numpy
# array per string, which takes seconds for the 280k merges of llama-bpe; this takes well under
# one. Only the KV section is read: the vocab files have no tensors, and nothing else is needed.
_GGUF_MAGIC: Final = b"GGUF"
_SCALAR_FORMATS: Final[dict[GGUFValueType, str]] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


def _parse_kv(data: bytes, path: str) -> list[TokenizerField]:
    view = memoryview(data)
    if len(data) < 24 or bytes(view[:4]) != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    offset = 24
    fields: list[TokenizerField] = []
    try:
        for _ in range(n_kv):
            key_bytes, offset = _read_string(view, offset)
            (raw_type,) = struct.unpack_from("<I", data, offset)
            offset += 4
            value_type = GGUFValueType(raw_type)
            sub_type: GGUFValueType | None = None
            value: object
            if value_type == GGUFValueType.ARRAY:
                raw_sub, count = struct.unpack_from("<IQ", data, offset)
                offset += 12
                sub_type = GGUFValueType(raw_sub)
                value, offset = _read_array(view, offset, sub_type, count)
            elif value_type == GGUFValueType.STRING:
                value, offset = _read_string(view, offset)
            else:
                fmt = _SCALAR_FORMATS[value_type]
                (value,) = struct.unpack_from(fmt, data, offset)
                offset += struct.calcsize(fmt)
            fields.append(TokenizerField(key_bytes.decode("utf-8"), value, value_type, sub_type))
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
        # A truncated or corrupt file surfaces as any of these; name the file once.
        raise ValueError(f"{path}: malformed GGUF key/value section ({exc})") from exc
    return fields


def _read_string(view: memoryview, offset: int) -> tuple[bytes, int]:
    length = int.from_bytes(view[offset : offset + 8], "little")
    start = offset + 8
    end = start + length
    if end > len(view):
        raise ValueError("string runs past the end of the file")
    return bytes(view[start:end]), end


def _read_array(
    view: memoryview, offset: int, sub_type: GGUFValueType, count: int
) -> tuple[list[object], int]:
    if sub_type == GGUFValueType.STRING:
        items: list[object] = []
        for _ in range(count):
            item, offset = _read_string(view, offset)
            items.append(item)
        return items, offset
    if sub_type == GGUFValueType.ARRAY:
        raise ValueError("nested arrays are not supported")
    dtype = np.dtype(_SCALAR_FORMATS[sub_type])
    end = offset + dtype.itemsize * count
    if end > len(view):
        raise ValueError("array runs past the end of the file")
    values = np.frombuffer(view[offset:end], dtype=dtype).tolist()
    return values, end
