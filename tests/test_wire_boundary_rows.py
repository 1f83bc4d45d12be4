"""The boundary-rows extension (docs/protocol.md §12), in both codec implementations.

A frame with state flag bit 15 carries ``k`` rows of n_embd per token (k in bits 16..21): each
width encodes and decodes (whole, byte by byte, with trailing garbage), the golden frames'
bit 20 without bit 15 still sizes nothing, and every malformed announcement is a WireError from
either side.  The stage's own check (a frame whose k is not its first layer's) is in
tests/test_lane_messages_boundary_rows.py.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import pytest

from skippy.codec.protocol import (
    BOUNDARY_ROWS_FLAG,
    MAX_BOUNDARY_ROWS,
    NEED_DATA,
    MessageKind,
    StageMessage,
    StateFlag,
    StateHeader,
    WireDType,
    WireError,
    activation_row_multiplier,
    boundary_rows_flags,
)
from skippy.codec.protocol_ext import SKIPPY_EXTENSIONS_FLAG

IMPLEMENTATIONS = {"py": "skippy.codec._wire_py", "c": "skippy.codec._wire"}
WIDTH = 8


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def wire_impl(request: pytest.FixtureRequest) -> ModuleType:
    if request.param == "c":
        return pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    return importlib.import_module(IMPLEMENTATIONS[request.param])


def _message(flags: int, tokens: int, rows: int) -> StageMessage:
    values = np.arange(rows * WIDTH, dtype=np.float32).reshape(rows, WIDTH) / 7
    state = StateHeader.for_kind(MessageKind.DECODE_EMBD)
    state = StateHeader(version=state.version, phase=state.phase, flags=flags, decode_step=1, source_stage_index=0)
    return StageMessage(kind=MessageKind.DECODE_EMBD, pos_start=3, token_count=tokens, state=state,
                        request_id=5, session_id=6, activation=values)


def _decode_all(wire_impl: ModuleType, data: bytes, chunk: int) -> list[StageMessage]:
    decoder = wire_impl.MessageDecoder(width=WIDTH)
    out = []
    for start in range(0, len(data), chunk):
        decoder.receive_data(data[start:start + chunk])
        while (event := decoder.next_message()) is not NEED_DATA:
            out.append(event)
    return out


def test_flags_round_trip_every_width() -> None:
    assert boundary_rows_flags(1) == 0
    for k in range(2, MAX_BOUNDARY_ROWS + 1):
        assert activation_row_multiplier(boundary_rows_flags(k)) == k
    for bad in (0, -1, MAX_BOUNDARY_ROWS + 1):
        with pytest.raises(ValueError, match="rows per token"):
            boundary_rows_flags(bad)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 11, MAX_BOUNDARY_ROWS])
@pytest.mark.parametrize("dtype", list(WireDType))
def test_wide_frames_encode_and_decode(wire_impl: ModuleType, k: int, dtype: WireDType) -> None:
    flags = boundary_rows_flags(k) | SKIPPY_EXTENSIONS_FLAG
    message = _message(flags, 2, 2 * k)
    frame = wire_impl.encode_message(message, dtype)
    twin = importlib.import_module("skippy.codec._wire_py").encode_message(message, dtype)
    assert frame == twin
    for chunk in (len(frame), 1, 7):
        (decoded,) = _decode_all(wire_impl, frame + b"\x99" * 3, chunk)  # garbage: an incomplete next frame
        assert decoded.state.flags == flags
        assert decoded.activation.shape == (2 * k, WIDTH)
        if dtype is WireDType.F32:
            assert np.array_equal(decoded.activation, message.activation)


def test_bit_20_without_bit_15_sizes_nothing(wire_impl: ModuleType) -> None:
    """The golden vector `unknown_and_full_state_flag_bits_preserved` sets bit 20 (inside the
    field): without bit 15 the field means nothing and the frame keeps one row per token."""
    flags = 1 << 20 | 1 << 9 | int(StateFlag.FULL_STATE)
    frame = wire_impl.encode_message(_message(flags, 1, 1), WireDType.F32)
    (decoded,) = _decode_all(wire_impl, frame, len(frame))
    assert decoded.activation.shape == (1, WIDTH) and decoded.state.flags == flags


@pytest.mark.parametrize(("flags", "reason"), [
    (BOUNDARY_ROWS_FLAG | SKIPPY_EXTENSIONS_FLAG, "boundary rows per token out of range"),
    (BOUNDARY_ROWS_FLAG | 1 << 16 | SKIPPY_EXTENSIONS_FLAG, "boundary rows per token out of range"),
    (boundary_rows_flags(4), "boundary rows without the skippy extensions bit"),
    (boundary_rows_flags(4) | SKIPPY_EXTENSIONS_FLAG | int(StateFlag.GEMMA3N_ALTUP_SIDEBAND),
     "boundary rows beside a v11 sideband flag"),
    (boundary_rows_flags(2) | SKIPPY_EXTENSIONS_FLAG | int(StateFlag.RWKV7_V_FIRST_SIDEBAND),
     "boundary rows beside a v11 sideband flag"),
])
def test_malformed_announcements_are_refused_both_ways(wire_impl: ModuleType, flags: int, reason: str) -> None:
    rows = max(activation_row_multiplier(flags), 1)
    with pytest.raises(WireError) as raised:
        wire_impl.encode_message(_message(flags, 1, rows), WireDType.F32)
    assert raised.value.reason == reason
    # the same header written by hand (a valid frame of one row, then the flags patched in)
    good = bytearray(wire_impl.encode_message(_message(SKIPPY_EXTENSIONS_FLAG, 1, 1), WireDType.F32))
    good[32:36] = (flags & 0xFFFFFFFF).to_bytes(4, "little")
    for chunk in (len(good), 1):
        with pytest.raises(WireError) as raised:
            _decode_all(wire_impl, bytes(good), chunk)
        assert raised.value.reason == reason


def test_payload_must_match_the_announced_width(wire_impl: ModuleType) -> None:
    flags = boundary_rows_flags(4) | SKIPPY_EXTENSIONS_FLAG
    with pytest.raises(WireError, match="size mismatch"):
        wire_impl.encode_message(_message(flags, 2, 2 * 3), WireDType.F32)
    # a frame of 4 rows per token announced as 5: the decoder waits for the missing bytes
    frame = bytearray(wire_impl.encode_message(_message(flags, 1, 4), WireDType.F32))
    frame[32:36] = (boundary_rows_flags(5) | SKIPPY_EXTENSIONS_FLAG).to_bytes(4, "little")
    assert _decode_all(wire_impl, bytes(frame), len(frame)) == []
