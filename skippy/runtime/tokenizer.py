"""Tokenizer from a GGUF's vocabulary (vocab-only load: no weights), with streaming detokenization.

Strategy: llama.cpp loads just the vocabulary (``vocab_only``), so the driver can tokenize for a
model it does not hold.  Detokenization is incremental and UTF-8 safe: token pieces are raw bytes,
and :class:`TextStream` holds back an incomplete multi-byte sequence until the tokens that finish
it arrive, so streamed text never contains replacement characters that the whole text would not.
"""

from __future__ import annotations

import codecs
import os
import threading
from pathlib import Path
from typing import Sequence, final

from skippy.runtime import _callbacks
from skippy.runtime.errors import ClosedError, ModelLoadError
from skippy.runtime.ffi import ffi, lib


@final
class Tokenizer:
    """The vocabulary of a GGUF file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        file = Path(path)
        if not file.is_file():
            raise ModelLoadError(f"model file {str(file)!r} does not exist")
        params = lib.llama_model_default_params()
        params.vocab_only = True
        _callbacks.take_recent_errors()
        pointer = lib.llama_model_load_from_file(str(file).encode(), params)
        if pointer == ffi.NULL:
            raise ModelLoadError(f"cannot load the vocabulary of {file}: {_callbacks.take_recent_errors()}")
        self._model = pointer
        self._vocab = lib.llama_model_get_vocab(pointer)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.bos = int(lib.llama_vocab_bos(self._vocab))
        self.eos = int(lib.llama_vocab_eos(self._vocab))
        self._lock = threading.Lock()
        self.path = file
        self._eog: frozenset[int] | None = None

    def _vocab_ptr(self) -> object:
        if self._model == ffi.NULL:
            raise ClosedError("tokenizer is closed")
        return self._vocab

    @property
    def vocab_pointer(self) -> object:
        """The ``llama_vocab`` pointer (a grammar is parsed against it); valid until :meth:`close`."""
        return self._vocab_ptr()

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (with BOS when the vocabulary wants it and ``add_special``)."""
        data = text.encode("utf-8")
        capacity = len(data) + 16
        while True:
            out = ffi.new("llama_token[]", capacity)
            count = lib.llama_tokenize(self._vocab_ptr(), data, len(data), out, capacity, add_special, parse_special)
            if count >= 0:
                return list(out[0:count])
            capacity = -count

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 sequence)."""
        buffer = ffi.new("char[]", 64)
        count = lib.llama_token_to_piece(self._vocab_ptr(), token, buffer, 64, 0, special)
        if count < 0:
            buffer = ffi.new("char[]", -count)
            count = lib.llama_token_to_piece(self._vocab_ptr(), token, buffer, -count, 0, special)
        return ffi.buffer(buffer, count)[:]

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of a token sequence (invalid UTF-8 replaced)."""
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_eog(self._vocab_ptr(), token))

    def end_of_generation_tokens(self) -> frozenset[int]:
        """Every token id that ends generation (llama.cpp's EOG set; computed once, then cached)."""
        if self._eog is None:
            vocab, is_eog = self._vocab_ptr(), lib.llama_vocab_is_eog
            self._eog = frozenset(token for token in range(self.n_vocab) if is_eog(vocab, token))
        return self._eog

    def stream(self, special: frozenset[int] = frozenset()) -> "TextStream":
        """An incremental detokenizer; tokens in ``special`` are rendered as their special text."""
        return TextStream(self, special)

    def close(self) -> None:
        with self._lock:
            if self._model != ffi.NULL:
                lib.llama_model_free(self._model)
                self._model = ffi.NULL

    def __enter__(self) -> "Tokenizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TextStream:
    """Turns tokens into text incrementally; never splits a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, special: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        """Text completed by this token ('' while a multi-byte character is incomplete)."""
        return self._decoder.decode(self._tokenizer.piece(token, special=token in self._special))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
