"""Property tests: the two codec implementations against each other and against numpy.

* random valid messages and replies round-trip, and both implementations write identical bytes;
* random and mutated byte strings, fed whole or one byte at a time, give frames, NEED_DATA or
  WireError (the same outcome from both implementations), never another exception, and the
  decoder never buffers or asks for more than a legal frame;
* f16 encoding equals IEEE round-to-nearest everywhere except exact ties, which go away from zero.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from skippy.codec import _wire_py  # noqa: E402
from skippy.codec.protocol import (  # noqa: E402
    END_OF_STREAM,
    MAX_MESSAGE_FRAME_BYTES,
    MAX_REPLY_FRAME_BYTES,
    MAX_STAGE_LOGIT_BIAS,
    NEED_DATA,
    LogitBias,
    MessageKind,
    NativeMtpDraft,
    ReplyKind,
    ReplyStats,
    SamplingConfig,
    StageMessage,
    StageReply,
    StateFlag,
    StateHeader,
    WireDType,
    WireError,
    activation_row_multiplier,
    carries_activation,
)

_wire_c = pytest.importorskip("skippy.codec._wire", reason="Cython extension not built")
IMPLEMENTATIONS = (_wire_py, _wire_c)
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])

i32 = st.integers(-(1 << 31), (1 << 31) - 1)
u32 = st.integers(0, (1 << 32) - 1)
i64 = st.integers(-(1 << 63), (1 << 63) - 1)
f32 = st.floats(width=32, allow_nan=False)
known_flags = st.sampled_from([int(flag) for flag in StateFlag])


@st.composite
def samplings(draw: st.DrawFn) -> SamplingConfig:
    biases = draw(st.lists(st.builds(LogitBias, i32, f32), max_size=MAX_STAGE_LOGIT_BIAS + 4))
    return SamplingConfig(draw(u32), draw(u32), draw(f32), draw(f32), draw(i32), draw(f32),
                          draw(f32), draw(f32), draw(f32), draw(i32), tuple(biases))


@st.composite
def messages(draw: st.DrawFn) -> tuple[StageMessage, WireDType, int]:
    kind = draw(st.sampled_from(list(MessageKind)))
    dtype = draw(st.sampled_from(list(WireDType)))
    width = draw(st.integers(0, 9))
    flags = 0
    for flag in draw(st.lists(known_flags, max_size=4)):
        flags |= flag
    flags |= draw(st.sampled_from([0, 1 << 2, 1 << 9, 1 << 20, -(1 << 31)]))
    source = draw(st.sampled_from([-1, -7, 0, 1, 5]))
    state = StateHeader(11, draw(i32), draw(i32), flags, draw(i32), draw(i32), draw(i32),
                        draw(i32), source, draw(st.integers(0, 2)))
    carries = carries_activation(kind, source)
    if kind == MessageKind.STOP:
        token_count = draw(i32)
    elif carries:
        token_count = draw(st.integers(0, 4))
    else:
        token_count = draw(st.integers(0, (1 << 31) - 1))
    raw = b""
    tokens = positions = np.zeros(0, dtype=np.int32)
    activation = None
    if kind == MessageKind.STATE_IMPORT:
        raw = draw(st.binary(max_size=40))
        token_count = len(raw)
    elif kind != MessageKind.STOP:
        tokens = draw(hnp.arrays(np.int32, st.integers(0, 6)))
        positions = draw(hnp.arrays(np.int32, st.integers(0, 6)))
        if carries:
            rows = token_count * activation_row_multiplier(flags)
            activation = draw(hnp.arrays(np.float32, (rows, width),
                                         elements=st.floats(width=32)))
    message = StageMessage(
        kind, draw(i32), token_count, state, draw(st.integers(0, (1 << 64) - 1)),
        draw(st.integers(0, (1 << 64) - 1)), draw(st.none() | samplings()),
        draw(st.none() | st.text(max_size=20)), tokens, positions, activation, raw,
    )
    return message, dtype, width


def expected_after_round_trip(message: StageMessage, dtype: WireDType) -> StageMessage:
    flags = message.state.flags & ~int(StateFlag.SAMPLING | StateFlag.CHAT_SAMPLING_METADATA)
    if message.sampling is not None:
        flags |= int(StateFlag.SAMPLING)
    if message.chat_sampling_metadata is not None:
        flags |= int(StateFlag.CHAT_SAMPLING_METADATA)
    sampling = message.sampling
    if sampling is not None:
        sampling = dataclasses.replace(sampling,
                                       logit_bias=sampling.logit_bias[:MAX_STAGE_LOGIT_BIAS])
    state = dataclasses.replace(message.state, flags=int(flags), reserved=int(dtype))
    return dataclasses.replace(message, state=state, sampling=sampling)


def decode_one(implementation: Any, frame: bytes, width: int) -> StageMessage:
    decoder = implementation.MessageDecoder(width)
    decoder.receive_data(frame)
    message = decoder.next_message()
    assert isinstance(message, StageMessage)
    assert decoder.buffered_bytes == 0
    return message


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(messages())
def test_messages_round_trip_identically(case: tuple[StageMessage, WireDType, int]) -> None:
    message, dtype, width = case
    frames = [impl.encode_message(message, dtype, width) for impl in IMPLEMENTATIONS]
    assert frames[0] == frames[1]
    decoded = [decode_one(impl, frames[0], width) for impl in IMPLEMENTATIONS]
    assert decoded[0] == decoded[1]
    if dtype == WireDType.F32 or message.activation is None or message.activation.size == 0:
        assert decoded[0] == expected_after_round_trip(message, dtype)
    else:
        # Lossy: a decoded f16 activation re-encodes to the very same bytes when it is finite
        # (q8 is not a fixed point: (127 x scale) / 127 may differ from scale by an ulp).
        activation = decoded[0].activation
        assert activation is not None and activation.shape == message.activation.shape
        if dtype == WireDType.F16 and np.isfinite(activation).all():
            for impl in IMPLEMENTATIONS:
                assert impl.encode_message(decoded[0], dtype, width) == frames[0]


@st.composite
def replies(draw: st.DrawFn) -> StageReply:
    draft = draw(st.none() | st.builds(NativeMtpDraft, st.lists(i32, max_size=5).map(tuple),
                                       i64))
    stats = ReplyStats(*draw(st.lists(i64, min_size=23, max_size=23)))
    return StageReply(draw(st.sampled_from(list(ReplyKind))), draw(i32),
                      tuple(draw(st.lists(i32, max_size=6))), draw(i32), draft, stats)


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(replies())
def test_replies_round_trip_identically(reply: StageReply) -> None:
    frames = [impl.encode_reply(reply) for impl in IMPLEMENTATIONS]
    assert frames[0] == frames[1]
    for impl in IMPLEMENTATIONS:
        decoder = impl.ReplyDecoder()
        decoder.receive_data(frames[0])
        assert decoder.next_reply() == reply


def outcome(implementation: Any, data: bytes, width: int, replies: bool,
            bytewise: bool) -> list[Any]:
    """Everything a decoder yields for ``data``, ending with the error reason or NEED_DATA."""
    decoder = implementation.ReplyDecoder() if replies else implementation.MessageDecoder(width)
    pull = decoder.next_reply if replies else decoder.next_message
    cap = MAX_REPLY_FRAME_BYTES if replies else MAX_MESSAGE_FRAME_BYTES
    results: list[Any] = []
    chunks = [data[i:i + 1] for i in range(len(data))] if bytewise else [data] if data else []
    try:
        for chunk in chunks + [b""]:
            decoder.receive_data(chunk)
            while True:
                item = pull()
                assert decoder.buffered_bytes <= len(data)
                assert decoder.bytes_needed <= cap
                if item is NEED_DATA or item is END_OF_STREAM:
                    break
                results.append(implementation.encode_reply(item) if replies else item)
    except WireError as error:
        results.append(("error", error.reason, error.end_of_stream))
    return results


@PROPERTY_SETTINGS
@given(st.binary(max_size=300), st.integers(-2, 16), st.booleans())
def test_random_bytes_give_frames_or_wire_errors(data: bytes, width: int,
                                                 replies: bool) -> None:
    results = [outcome(impl, data, width, replies, bytewise=False) for impl in IMPLEMENTATIONS]
    assert results[0] == results[1]
    assert outcome(_wire_c, data, width, replies, bytewise=True) == results[1]


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(messages(), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                            min_size=1, max_size=4), st.integers(0, 40))
def test_mutated_frames_give_frames_or_wire_errors(
    case: tuple[StageMessage, WireDType, int], mutations: list[tuple[int, int]], cut: int
) -> None:
    message, dtype, width = case
    frame = bytearray(_wire_c.encode_message(message, dtype, width))
    for position, value in mutations:
        frame[position % len(frame)] = value
    data = bytes(frame[:len(frame) - cut] if cut < len(frame) else frame)
    results = [outcome(impl, data, width, False, bytewise=False) for impl in IMPLEMENTATIONS]
    assert results[0] == results[1]


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(hnp.arrays(np.uint32, st.integers(1, 64)))
def test_f16_matches_ieee_except_ties(bits: np.ndarray) -> None:
    values = bits.view(np.float32).reshape(1, -1)
    encoded = [impl.encode_activation(values, WireDType.F16) for impl in IMPLEMENTATIONS]
    assert encoded[0] == encoded[1]
    ours = np.frombuffer(encoded[0], dtype="<u2")
    with np.errstate(all="ignore"):  # overflow to inf is the expected result
        ieee = values.reshape(-1).astype(np.float16).view(np.uint16)
    nan = np.isnan(values.reshape(-1))
    assert np.array_equal(ours[nan] & 0x7E00, np.full(nan.sum(), 0x7E00, dtype=np.uint16))
    differs = (ours != ieee) & ~nan
    # Widening a signalling NaN raises the invalid flag (0x7F800001 from hypothesis); NaNs are
    # checked above, so every cast below ignores the floating-point flags.
    with np.errstate(all="ignore"):
        exact = ieee.astype(np.float32)
        widened = np.frombuffer(encoded[0], dtype=np.float16).astype(np.float64)
        reference = values.reshape(-1).astype(np.float64)
        # Where the results differ, the input lies exactly halfway, and ours is farther from zero.
        ieee_value = ieee.view(np.float16).astype(np.float64)
        assert np.all(np.abs(widened[differs] - reference[differs])
                      == np.abs(ieee_value[differs] - reference[differs]))
        assert np.all(np.abs(widened[differs]) > np.abs(ieee_value[differs]))
    assert exact.shape == ours.shape


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(hnp.arrays(np.float32, st.tuples(st.integers(0, 5), st.integers(0, 9)),
                  elements=st.floats(width=32)))
def test_q8_implementations_agree(values: np.ndarray) -> None:
    encoded = [impl.encode_activation(values, WireDType.Q8) for impl in IMPLEMENTATIONS]
    assert encoded[0] == encoded[1]
    rows, width = values.shape
    decoded = [impl.decode_activation(encoded[0], WireDType.Q8, rows, width)
               for impl in IMPLEMENTATIONS]
    assert decoded[0].tobytes() == decoded[1].tobytes()
    # Rows whose decoded values stay finite (127 x scale can overflow near float32 max).
    finite = np.isfinite(values).all(axis=1) & np.isfinite(decoded[0]).all(axis=1)
    if width:
        scale = np.frombuffer(encoded[0][:4 * rows], dtype="<f4")
        error = np.abs(decoded[0][finite].astype(np.float64) - values[finite])
        assert np.all(error <= scale[finite][:, None].astype(np.float64) * 0.501 + 1e-30)


# --------------------------------------------------------------------------------------------
# Extension frames (docs/protocol.md "Extensions")
# --------------------------------------------------------------------------------------------

from skippy.codec.protocol_ext import (  # noqa: E402
    MAX_ERROR_ADDRESS_BYTES,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_TIMING_RECORDS,
    ErrorCode,
    ErrorFrame,
    TimingRecord,
    TimingsFrame,
)

stage_indices = st.integers(-1, (1 << 31) - 1)
non_negative_i32 = st.integers(0, (1 << 31) - 1)
non_negative_i64 = st.integers(0, (1 << 63) - 1)


def _utf8_text(limit: int) -> st.SearchStrategy[str]:
    # At most 4 UTF-8 bytes a character, so any draw fits; surrogates cannot be encoded.
    return st.text(st.characters(blacklist_categories=("Cs",)), max_size=limit // 4)


@st.composite
def error_frames(draw: st.DrawFn) -> ErrorFrame:
    return ErrorFrame(draw(st.sampled_from(list(ErrorCode))), draw(stage_indices),
                      draw(stage_indices), draw(_utf8_text(MAX_ERROR_ADDRESS_BYTES)),
                      draw(_utf8_text(MAX_ERROR_MESSAGE_BYTES)))


@st.composite
def timing_records(draw: st.DrawFn) -> TimingRecord:
    start = draw(non_negative_i32)
    end = draw(st.integers(start, (1 << 31) - 1))
    return TimingRecord(draw(non_negative_i32), start, end, draw(non_negative_i32),
                        *(draw(non_negative_i64) for _ in range(4)))


timings_frames = st.lists(timing_records(), max_size=MAX_TIMING_RECORDS).map(
    lambda records: TimingsFrame(tuple(records)))
extension_frames = error_frames() | timings_frames


def _encode_any(implementation: Any, frame: Any) -> bytes:
    if isinstance(frame, ErrorFrame):
        return bytes(implementation.encode_error(frame))
    if isinstance(frame, TimingsFrame):
        return bytes(implementation.encode_timings(frame))
    return bytes(implementation.encode_reply(frame))


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(st.lists(extension_frames | replies(), min_size=1, max_size=5))
def test_extension_frames_round_trip_identically(frames: list[Any]) -> None:
    encoded = [b"".join(_encode_any(impl, frame) for frame in frames) for impl in IMPLEMENTATIONS]
    assert encoded[0] == encoded[1]
    for impl in IMPLEMENTATIONS:
        for chunks in ([encoded[0]], [encoded[0][i:i + 1] for i in range(len(encoded[0]))]):
            decoder = impl.ReplyDecoder(extensions=True)
            out = []
            for chunk in chunks:
                decoder.receive_data(chunk)
                while (item := decoder.next_reply()) is not NEED_DATA:
                    out.append(item)
            assert out == frames
            assert b"".join(_encode_any(impl, item) for item in out) == encoded[0]


def extension_outcome(implementation: Any, data: bytes, bytewise: bool) -> list[Any]:
    decoder = implementation.ReplyDecoder(extensions=True)
    results: list[Any] = []
    chunks = [data[i:i + 1] for i in range(len(data))] if bytewise else [data] if data else []
    try:
        for chunk in chunks + [b""]:
            decoder.receive_data(chunk)
            while True:
                item = decoder.next_reply()
                assert decoder.buffered_bytes <= len(data)
                assert decoder.bytes_needed <= MAX_REPLY_FRAME_BYTES
                if item is NEED_DATA or item is END_OF_STREAM:
                    break
                results.append(_encode_any(implementation, item))
    except WireError as error:
        results.append(("error", str(error), error.end_of_stream))
    return results


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(extension_frames, st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                  min_size=1, max_size=4), st.integers(0, 40))
def test_mutated_extension_frames_give_frames_or_wire_errors(
    frame: Any, mutations: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(_encode_any(_wire_c, frame))
    for position, value in mutations:
        data[position % len(data)] = value
    sample = bytes(data[:len(data) - cut] if cut < len(data) else data)
    results = [extension_outcome(impl, sample, bytewise=False) for impl in IMPLEMENTATIONS]
    assert results[0] == results[1]
    assert extension_outcome(_wire_c, sample, bytewise=True) == results[1]


@PROPERTY_SETTINGS
@given(st.sampled_from([b"\x00\x5e\x00\x00", b"\x01\x5e\x00\x00"]), st.binary(max_size=200))
def test_random_extension_bodies_give_frames_or_wire_errors(head: bytes, body: bytes) -> None:
    results = [extension_outcome(impl, head + body, bytewise=False) for impl in IMPLEMENTATIONS]
    assert results[0] == results[1]


def _generic_merge(left: ReplyStats, right: ReplyStats) -> ReplyStats:
    """The §5.3 merge rules written generically over the field names (the old definition)."""
    from skippy.codec import protocol

    changes: dict[str, int] = {
        name: protocol._saturating(getattr(left, name) + getattr(right, name)) for name in protocol._SUM_FIELDS
    }
    changes["kv_hit_stage_mask"] = left.kv_hit_stage_mask | right.kv_hit_stage_mask
    changes["kv_record_stage_mask"] = left.kv_record_stage_mask | right.kv_record_stage_mask
    for name in ("verify_window_max_tokens", "prefill_edge_write_us_max", "prefill_edge_wait_us_max"):
        changes[name] = max(getattr(left, name), getattr(right, name))
    if right.prefill_edge_total_us_max > left.prefill_edge_total_us_max:
        changes["prefill_edge_total_us_max"] = right.prefill_edge_total_us_max
        changes["prefill_edge_stage_index"] = right.prefill_edge_stage_index
        changes["prefill_edge_activation_bytes_max"] = right.prefill_edge_activation_bytes_max
    return dataclasses.replace(left, **changes)


stats_values = st.lists(st.one_of(i64, st.integers(-3, 3)), min_size=23, max_size=23).map(lambda v: ReplyStats(*v))


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(stats_values, stats_values)
def test_reply_stats_fast_paths_match_generic_definitions(left: ReplyStats, right: ReplyStats) -> None:
    """``as_tuple`` (a hand-written field tuple) and ``merge`` (field-wise) keep their meaning."""
    assert left.as_tuple() == dataclasses.astuple(left)
    assert left.merge(right) == _generic_merge(left, right)
