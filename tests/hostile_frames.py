"""Hand-built stage frames with whatever counts a hostile peer claims, and process probes.

The codec's encoder refuses inconsistent messages, so these frames are packed field by field
(``docs/protocol.md`` §2: the 76-byte fixed header, then the sidebands and the activation), which
lets a test claim a ``token_count`` the frame does not back.  Used by the limit tests and the fuzz
harness (``bench/fuzz_stage.py``).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import trio

from skippy.protocol import MessageKind, StateHeader
from skippy.protocol_ext import SKIPPY_EXTENSIONS_FLAG

FIXED = struct.Struct("<5i10i2Q")


def raw_frame(kind: MessageKind | int, *, token_count: int, pos_start: int = 0, tokens: int = 0,
              positions: int = 0, session_id: int = 1, source_stage_index: int = -1, activation_rows: int = 0,
              width: int = 8, phase: int | None = None, flags: int | None = None, extensions: bool = True) -> bytes:
    """A frame claiming ``token_count`` rows while carrying ``tokens`` token ids, ``positions``
    positions and ``activation_rows`` f32 rows of ``width`` (with ``source_stage_index >= 0``);
    flagged for the extensions (so a refusal comes with an Error frame) unless told not to."""
    try:
        header = StateHeader.for_kind(MessageKind(kind))
    except ValueError:
        header = StateHeader()
    if flags is None:
        flags = header.flags | (SKIPPY_EXTENSIONS_FLAG if extensions else 0)
    state = (header.version, 0, header.phase if phase is None else phase, flags, 0, 0, -1, -1,
             source_stage_index, 0)
    head = FIXED.pack(int(kind), pos_start, token_count, tokens, positions, *state, 7, session_id)
    body = np.arange(tokens, dtype=np.int32).tobytes() + np.arange(positions, dtype=np.int32).tobytes()
    if source_stage_index >= 0:
        body += np.zeros((activation_rows, width), dtype=np.float32).tobytes()
    return head + body


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def fd_count(pid: int) -> int:
    """Open file descriptors of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


async def dial(host: str, port: int) -> trio.SocketStream:
    """A raw lane to a stage with its READY read (4 bytes)."""
    stream = await trio.open_tcp_stream(host, port)
    ready = b""
    while len(ready) < 4:
        chunk = await stream.receive_some(4 - len(ready))
        if not chunk:
            raise ConnectionError("the stage closed before READY")
        ready += chunk
    return stream


async def until_closed(stream: trio.abc.Stream, timeout: float) -> bytes:
    """Everything the stage sends until it closes the lane (TooSlowError after ``timeout`` s)."""
    received = b""
    with trio.fail_after(timeout):
        while True:
            try:
                chunk = await stream.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return received
            if not chunk:
                return received
            received += chunk
