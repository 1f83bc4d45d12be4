"""Public, sans-IO codec of the skippy stage data plane (state version 11).

Strategy
--------
The codec exists twice with one API: ``skippy.codec._wire`` (Cython, the default) and
``skippy.codec._wire_py`` (the typed pure-Python twin). This module picks one at import time; set
``SKIPPY_NO_EXTENSIONS=1`` to force the twin. Type checkers always see the twin, so mypy checks
the code that defines the behaviour. If the extension is not built the twin is used and
:data:`EXTENSION_IMPORT_ERROR` says why; :data:`IMPLEMENTATION` names the one in use.

Usage::

    frame = encode_message(message, WireDType.F16, width=4096)
    decoder = MessageDecoder(width=4096)
    decoder.receive_data(chunk)          # b"" marks the end of the stream
    while (item := decoder.next_message()) is not NEED_DATA: ...

Skippy's negotiated extension frames (Error, Timings; ``docs/protocol.md`` "Extensions") are
encoded with ``encode_error`` / ``encode_timings`` and decoded by ``ReplyDecoder(extensions=True)``;
their types live in :mod:`skippy.codec.protocol_ext`.

Every malformed input raises :class:`~skippy.codec.protocol.WireError`; after one on the receive path
the stream is desynchronised and the connection must be closed. Nothing here does I/O.

``python -m skippy.codec.wire decode|encode`` is the debugging CLI (:mod:`skippy.codec.wire_cli`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from skippy.codec.protocol import (
    END_OF_STREAM,
    NEED_DATA,
    READY_BYTES,
    MessageKind,
    ReplyKind,
    StageMessage,
    StageReply,
    WireDType,
    WireError,
    check_ready,
)
from skippy.codec.protocol_ext import (
    SKIPPY_EXTENSIONS_FLAG,
    ErrorCode,
    ErrorFrame,
    ExtensionNegotiation,
    IdentityFrame,
    TimingRecord,
    TimingsFrame,
)

#: Why the Cython extension was not used (None when it is, or when the twin was forced).
EXTENSION_IMPORT_ERROR: ImportError | None = None

if TYPE_CHECKING or os.environ.get("SKIPPY_NO_EXTENSIONS") == "1":
    from skippy.codec import _wire_py as _implementation
else:
    try:
        from skippy.codec import _wire as _implementation  # type: ignore[no-redef]
    except ImportError as error:  # extension not built in this checkout: the twin still works
        EXTENSION_IMPORT_ERROR = error
        from skippy.codec import _wire_py as _implementation  # type: ignore[no-redef]

#: ``"cython"`` or ``"python"``: which implementation this process uses.
IMPLEMENTATION: str = _implementation.IMPLEMENTATION

encode_message = _implementation.encode_message
encode_reply = _implementation.encode_reply
encode_error = _implementation.encode_error
encode_timings = _implementation.encode_timings
encode_identity = _implementation.encode_identity
encode_sampling_accepted = _implementation.encode_sampling_accepted
encode_logprobs = _implementation.encode_logprobs
encode_activation = _implementation.encode_activation
decode_activation = _implementation.decode_activation
int32_sideband = _implementation.int32_sideband
MessageDecoder = _implementation.MessageDecoder
ReplyDecoder = _implementation.ReplyDecoder

__all__ = [
    "END_OF_STREAM",
    "EXTENSION_IMPORT_ERROR",
    "IMPLEMENTATION",
    "NEED_DATA",
    "READY_BYTES",
    "SKIPPY_EXTENSIONS_FLAG",
    "ErrorCode",
    "ErrorFrame",
    "ExtensionNegotiation",
    "IdentityFrame",
    "MessageDecoder",
    "MessageKind",
    "ReplyDecoder",
    "ReplyKind",
    "StageMessage",
    "StageReply",
    "TimingRecord",
    "TimingsFrame",
    "WireDType",
    "WireError",
    "check_ready",
    "decode_activation",
    "encode_activation",
    "encode_error",
    "encode_identity",
    "encode_message",
    "encode_reply",
    "encode_logprobs",
    "encode_sampling_accepted",
    "encode_timings",
    "int32_sideband",
]

if __name__ == "__main__":
    import sys

    from skippy.codec.wire_cli import main

    sys.exit(main())
