"""Typed failures of the native runtime; every message says what was wrong and with which value.

``NativeError`` is the root.  Errors about the caller's input (a bad layer range, tokens sent to a
stage that takes activations, a state blob for another stage) also derive from ``ValueError`` so
generic callers can catch them as such.
"""

from __future__ import annotations


class NativeError(Exception):
    """Root of all runtime errors."""


class BindingMismatch(ImportError):
    """skippy._llama or libllama is not the build this Python code expects."""


class ModelLoadError(NativeError):
    """llama.cpp could not load the model (missing file, bad GGUF, allocation failure)."""


class LayerRangeError(NativeError, ValueError):
    """The requested layer range is empty, out of bounds or unsupported for the architecture."""


class UnsupportedArchitecture(LayerRangeError):
    """A partial layer range was requested for an architecture the patch does not cover."""


class ContextError(NativeError):
    """A context could not be created (sizes, memory)."""


class InvalidBatch(NativeError, ValueError):
    """The batch was rejected before compute (wrong input kind, width, positions, sizes)."""


class KvSlotUnavailable(NativeError):
    """llama_decode found no room in the KV cache for the batch (return code 1)."""


class DecodeAborted(NativeError):
    """llama_decode was aborted (return code 2)."""


class NativeFatalError(NativeError):
    """llama_decode failed inside llama.cpp (return code below -1)."""


class SessionError(NativeError, ValueError):
    """Unknown, closed or exhausted session ids."""


class RollbackRefused(SessionError):
    """A recurrent session cannot go back to ``length`` positions (``reason``: why); nothing changed."""

    def __init__(self, seq: int, length: int, reason: str) -> None:
        super().__init__(f"cannot trim session {seq} to {length} positions: {reason}")
        self.reason = reason


class StateMismatch(NativeError, ValueError):
    """A saved sequence state belongs to another model, layer range or shape."""


class ClosedError(NativeError):
    """The model or context was already closed."""


def decode_error(rc: int, detail: str) -> NativeError:
    """Map a non-zero llama_decode return code to its exception."""
    if rc == 1:
        return KvSlotUnavailable(f"no KV cache slot for the batch ({detail}); free sessions or raise n_ctx")
    if rc == 2:
        return DecodeAborted(f"decode aborted ({detail})")
    if rc == -1:
        return InvalidBatch(f"llama_decode rejected the batch ({detail})")
    return NativeFatalError(f"llama_decode failed with code {rc} ({detail})")
