"""Hand-built stage frames with whatever counts a hostile peer claims, and process probes.

The codec's encoder refuses inconsistent messages, so these frames are packed field by field
(``docs/protocol.md`` §2: the 76-byte fixed header, then the sidebands and the activation), which
lets a test claim a ``token_count`` the frame does not back.  Used by the limit tests and the fuzz
harness (``bench/fuzz_stage.py``).
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import numpy as np
import trio

from skippy.codec.protocol import MessageKind, StateHeader
from skippy.codec.protocol_ext import SKIPPY_EXTENSIONS_FLAG

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
    try:
        while len(ready) < 4:
            chunk = await stream.receive_some(4 - len(ready))
            if not chunk:
                raise ConnectionError("the stage closed before READY")
            ready += chunk
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
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


# -- mutation (the fuzz campaign: tests/test_stage_fuzz.py, bench/fuzz_stage.py) --------------------
#: Values a mutated 32-bit field takes.
EXTREMES = (0, 1, -1, 2, 3, 4095, 4096, 4097, 1 << 16, 1 << 20, 1 << 28, (1 << 31) - 1, -(1 << 31), 0x7FFFFFFE)


def seed_frames(width: int = 8) -> list[bytes]:
    """Valid-looking frames of every kind (and a few with activations) to mutate."""
    frames = []
    for kind in MessageKind:
        frames.append(raw_frame(kind, token_count=1, tokens=1, width=width))
        frames.append(raw_frame(kind, token_count=3, tokens=3, positions=3, width=width))
        frames.append(raw_frame(kind, token_count=2, tokens=2, source_stage_index=0, activation_rows=2, width=width))
    return frames


def mutate(frame: bytes, rng: random.Random) -> bytes:
    """One random mutation of ``frame``: a 32-bit field set to an extreme value, bit flips, a
    truncation, an extension with garbage, a splice, or a duplicated frame."""
    data = bytearray(frame)
    if not data:
        return rng.randbytes(rng.randint(1, 80))
    choice = rng.randrange(7)
    if choice == 0 or choice == 1:  # a header field (or one anywhere) set to an extreme value
        limit = min(len(data), FIXED.size if choice == 0 else len(data))
        offset = rng.randrange(0, max(1, limit - 3)) & ~3
        data[offset:offset + 4] = struct.pack("<i", rng.choice(EXTREMES))
    elif choice == 2:  # bit flips
        for _ in range(rng.randint(1, 8)):
            index = rng.randrange(len(data))
            data[index] ^= 1 << rng.randrange(8)
    elif choice == 3:  # truncated (at least one byte left)
        data = data[:rng.randint(1, len(data))]
    elif choice == 4:  # garbage after it
        data += rng.randbytes(rng.randint(1, 300))
    elif choice == 5:  # a splice of random bytes
        start = rng.randrange(len(data))
        data[start:start + rng.randint(1, 40)] = rng.randbytes(rng.randint(0, 40))
    else:  # the frame twice, the second mutated
        data += mutate(bytes(frame), rng)
    return bytes(data)
