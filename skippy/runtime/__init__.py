"""The native runtime: a layer range of a GGUF model in our patched llama.cpp, through cffi.

``Model`` loads layers ``[a, b)``; ``StageContext`` runs batches of rows for sessions (sequence
ids), exposes activations / logits, KV operations and per-session state; ``Sampler`` picks tokens.
"""

from skippy.runtime.context import MemoryReport, StageContext, huge_page_bytes, resident_bytes
from skippy.runtime.errors import (
    BindingMismatch,
    ClosedError,
    ContextError,
    DecodeAborted,
    InvalidBatch,
    KvSlotUnavailable,
    LayerRangeError,
    ModelLoadError,
    NativeError,
    NativeFatalError,
    SessionError,
    StateMismatch,
    UnsupportedArchitecture,
)
from skippy.runtime.model import LayerRange, Model, read_gguf_info
from skippy.runtime.sampling import GREEDY, Sampler, SamplingParams

__all__ = [
    "BindingMismatch", "ClosedError", "ContextError", "DecodeAborted", "GREEDY", "InvalidBatch",
    "KvSlotUnavailable", "LayerRange", "LayerRangeError", "MemoryReport", "Model", "ModelLoadError",
    "NativeError", "NativeFatalError", "Sampler", "SamplingParams", "SessionError", "StageContext",
    "StateMismatch", "UnsupportedArchitecture", "read_gguf_info", "resident_bytes", "huge_page_bytes",
]
