"""The stage codec against the reference's golden frames, for both implementations.

Every vector is encoded (fields -> exact bytes) and decoded (bytes -> fields) with the bytes fed
whole, one byte at a time, split at every offset, and back to back with other frames; every
invalid frame must raise WireError, and InvalidData frames must do so before the end of the stream
is signalled (the reader rejects on the size field itself).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import wire_vectors as vectors
from skippy.codec import protocol
from skippy.codec.protocol import (
    END_OF_STREAM,
    NEED_DATA,
    MessageKind,
    Phase,
    ReplyKind,
    ReplyStats,
    StageMessage,
    StageReply,
    StateFlag,
    StateHeader,
    WireDType,
    WireError,
)
from skippy.codec.wire_cli import (
    message_from_fields,
    message_to_fields,
    reply_from_fields,
    reply_to_fields,
)

IMPLEMENTATIONS = {"py": "skippy.codec._wire_py", "c": "skippy.codec._wire"}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def wire_impl(request: pytest.FixtureRequest) -> ModuleType:
    """Each codec implementation: the pure twin and the Cython module."""
    if request.param == "c":
        return pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    return importlib.import_module(IMPLEMENTATIONS[request.param])


def test_default_implementation_is_cython() -> None:
    from skippy.codec import wire

    if os.environ.get("SKIPPY_NO_EXTENSIONS") == "1":
        assert wire.IMPLEMENTATION == "python"
    else:
        assert wire.EXTENSION_IMPORT_ERROR is None
        assert wire.IMPLEMENTATION == "cython"
        assert wire.MessageDecoder.__module__ == "skippy.codec._wire"


def test_vector_copies_match_shared() -> None:
    if not vectors.SHARED_VECTOR_DIR.is_dir():
        pytest.skip("../shared/wire-vectors is not beside the repository")
    for name in vectors.VECTOR_FILES:
        copy = (vectors.VECTOR_DIR / name).read_bytes()
        assert copy == (vectors.SHARED_VECTOR_DIR / name).read_bytes(), name


# --------------------------------------------------------------------------------------------
# Feeding helpers
# --------------------------------------------------------------------------------------------


def whole(data: bytes) -> Iterator[bytes]:
    yield data


def bytewise(data: bytes) -> Iterator[bytes]:
    for index in range(len(data)):
        yield data[index:index + 1]


FEEDS = {"whole": whole, "bytewise": bytewise}


def decode_messages(wire_impl: ModuleType, chunks: Iterable[bytes], width: int,
                    close: bool = True) -> tuple[list[tuple[StageMessage, bytes]], Any]:
    """Feed ``chunks``, pulling after each; return (message, frame bytes) pairs and the decoder."""
    decoder = wire_impl.MessageDecoder(width)
    received = bytearray()
    consumed = 0
    out = []

    def pull() -> None:
        nonlocal consumed
        while True:
            item = decoder.next_message()
            if item is NEED_DATA or item is END_OF_STREAM:
                return
            end = len(received) - decoder.buffered_bytes
            out.append((item, bytes(received[consumed:end])))
            consumed = end

    for chunk in chunks:
        received += chunk
        decoder.receive_data(chunk)
        pull()
    if close:
        decoder.receive_data(b"")
        pull()
    return out, decoder


def decode_replies(wire_impl: ModuleType, chunks: Iterable[bytes]) -> list[StageReply]:
    decoder = wire_impl.ReplyDecoder()
    out = []
    for chunk in chunks:
        decoder.receive_data(chunk)
        while (item := decoder.next_reply()) is not NEED_DATA:
            out.append(item)
    decoder.receive_data(b"")
    assert decoder.next_reply() is END_OF_STREAM
    return out


def assert_message_fields(message: StageMessage, frame: bytes, case: dict[str, Any],
                          fields: dict[str, Any], lossy: bool) -> None:
    got = vectors.comparable_fields(message_to_fields(message, frame), lossy)
    assert got == vectors.comparable_fields(fields, lossy), case["name"]


# --------------------------------------------------------------------------------------------
# Message vectors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", vectors.MESSAGE_CASES, ids=vectors.ids(vectors.MESSAGE_CASES))
def test_encode_message_vector(wire_impl: ModuleType, case: dict[str, Any]) -> None:
    message = message_from_fields(case["fields"], case["activation_width"])
    dtype = WireDType[case["wire_dtype"].upper()]
    frame = wire_impl.encode_message(message, dtype, case["activation_width"])
    assert frame.hex() == case["hex"]
    assert len(frame) == case["byte_length"]


@pytest.mark.parametrize("case", vectors.MESSAGE_CASES, ids=vectors.ids(vectors.MESSAGE_CASES))
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_decode_message_vector(wire_impl: ModuleType, case: dict[str, Any], feed: str) -> None:
    data = bytes.fromhex(case["hex"])
    decoded, decoder = decode_messages(wire_impl, FEEDS[feed](data), case["activation_width"])
    assert len(decoded) == 1
    message, frame = decoded[0]
    assert frame == data
    assert_message_fields(message, frame, case, case["fields"], case["wire_dtype"] != "f32")
    assert decoder.buffered_bytes == 0


@pytest.mark.parametrize("case", vectors.MESSAGE_CASES, ids=vectors.ids(vectors.MESSAGE_CASES))
def test_decode_message_split_at_every_offset(wire_impl: ModuleType,
                                              case: dict[str, Any]) -> None:
    data = bytes.fromhex(case["hex"])
    width = case["activation_width"]
    expected, _ = decode_messages(wire_impl, [data], width)
    for split in range(1, len(data)):
        decoded, _ = decode_messages(wire_impl, [data[:split], data[split:]], width)
        assert decoded == expected, split


@pytest.mark.parametrize("case", vectors.MESSAGE_CASES, ids=vectors.ids(vectors.MESSAGE_CASES))
def test_message_round_trip_and_trailing_bytes(wire_impl: ModuleType,
                                               case: dict[str, Any]) -> None:
    data = bytes.fromhex(case["hex"])
    width = case["activation_width"]
    # Trailing bytes that start another frame stay buffered, the first frame is unaffected.
    decoded, decoder = decode_messages(wire_impl, [data + data[:5]], width, close=False)
    assert [frame for _, frame in decoded] == [data]
    assert decoder.next_message() is NEED_DATA
    assert decoder.buffered_bytes == 5
    # Decoding then re-encoding gives the same bytes (the decoded activation is lossless for
    # f32, and a fixed point of f16/q8 quantization).
    message = decoded[0][0]
    if message.activation is not None and not np.isfinite(message.activation).all():
        return  # a NaN decoded from an infinite q8 scale does not re-encode to that scale
    dtype = WireDType[case["wire_dtype"].upper()]
    assert wire_impl.encode_message(message, dtype, width) == data


def test_back_to_back_frames(wire_impl: ModuleType) -> None:
    by_width: dict[int, list[dict[str, Any]]] = {}
    for case in vectors.MESSAGE_CASES:
        by_width.setdefault(case["activation_width"], []).append(case)
    for width, cases in by_width.items():
        stream = b"".join(bytes.fromhex(case["hex"]) for case in cases)
        for feed in FEEDS.values():
            decoded, decoder = decode_messages(wire_impl, feed(stream), width)
            assert [frame.hex() for _, frame in decoded] == [case["hex"] for case in cases]
            for (message, frame), case in zip(decoded, cases):
                assert_message_fields(message, frame, case, case["fields"], case["wire_dtype"] != "f32")


@pytest.mark.parametrize("case", vectors.MESSAGE_DECODE_ONLY,
                         ids=vectors.ids(vectors.MESSAGE_DECODE_ONLY))
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_decode_only_messages(wire_impl: ModuleType, case: dict[str, Any], feed: str) -> None:
    data = bytes.fromhex(case["hex"])
    decoded, decoder = decode_messages(wire_impl, FEEDS[feed](data), case["activation_width"],
                                       close=False)
    assert len(decoded) == len(case["frames"])
    offset = 0
    for (message, frame), expected in zip(decoded, case["frames"]):
        assert offset == expected["offset"]
        assert len(frame) == expected["consumed_bytes"]
        # decode_only frames are hand-made: no float32 inputs exist, compare the decoded values.
        assert_message_fields(message, frame, case, expected["fields"], True)
        offset += len(frame)
    assert decoder.buffered_bytes == case["trailing_unread_bytes"]


def test_writer_input_variants(wire_impl: ModuleType) -> None:
    """Inputs the reference writer normalises: stale flags, wrong reserved, >256 biases."""
    cases = {case["name"]: case for case in vectors.MESSAGE_CASES}
    stale = cases["writer_clears_stale_optional_flags"]
    message = message_from_fields(stale["fields"])
    state = dataclasses.replace(message.state, flags=stale["writer_input"]["state_flags"],
                                reserved=stale["writer_input"]["state_reserved"])
    frame = wire_impl.encode_message(dataclasses.replace(message, state=state), WireDType.F16)
    assert frame.hex() == stale["hex"]

    truncated = cases["sampling_300_biases_writer_truncates_to_256"]
    message = message_from_fields(truncated["fields"])
    assert message.sampling is not None
    dropped = tuple(protocol.LogitBias(b["token_id"], b["bias"])
                    for b in truncated["writer_input"]["logit_bias_dropped_by_writer"])
    assert len(message.sampling.logit_bias) + len(dropped) == 300
    sampling = dataclasses.replace(message.sampling,
                                   logit_bias=message.sampling.logit_bias + dropped)
    frame = wire_impl.encode_message(dataclasses.replace(message, sampling=sampling),
                                     WireDType.F32)
    assert frame.hex() == truncated["hex"]


# --------------------------------------------------------------------------------------------
# Reply vectors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", vectors.REPLY_CASES, ids=vectors.ids(vectors.REPLY_CASES))
def test_encode_reply_vector(wire_impl: ModuleType, case: dict[str, Any]) -> None:
    frame = wire_impl.encode_reply(reply_from_fields(case["fields"]))
    assert frame.hex() == case["hex"]
    assert len(frame) == case["byte_length"]


@pytest.mark.parametrize("case", vectors.REPLY_CASES, ids=vectors.ids(vectors.REPLY_CASES))
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_decode_reply_vector(wire_impl: ModuleType, case: dict[str, Any], feed: str) -> None:
    data = bytes.fromhex(case["hex"])
    replies = decode_replies(wire_impl, FEEDS[feed](data))
    assert [reply_to_fields(reply) for reply in replies] == [case["fields"]]
    for split in range(1, len(data)) if feed == "whole" else ():
        assert decode_replies(wire_impl, [data[:split], data[split:]]) == replies


@pytest.mark.parametrize("case", vectors.REPLY_DECODE_ONLY,
                         ids=vectors.ids(vectors.REPLY_DECODE_ONLY))
def test_decode_only_replies(wire_impl: ModuleType, case: dict[str, Any]) -> None:
    data = bytes.fromhex(case["hex"])
    for feed in FEEDS.values():
        replies = decode_replies(wire_impl, feed(data))
        assert [reply_to_fields(r) for r in replies] == [f["fields"] for f in case["frames"]]


def test_back_to_back_replies(wire_impl: ModuleType) -> None:
    stream = b"".join(bytes.fromhex(case["hex"]) for case in vectors.REPLY_CASES)
    replies = decode_replies(wire_impl, bytewise(stream))
    assert [reply_to_fields(r) for r in replies] == [c["fields"] for c in vectors.REPLY_CASES]


def test_reply_stats_helpers_match_reference() -> None:
    cases = {case["name"]: case for case in vectors.REPLY_CASES}
    expected = cases["ack_stats_from_prefill_edge_observations"]["fields"]["stats"]
    stats = ReplyStats().observe_prefill_edge_transport(2, 12000, 3000, 1 << 20)
    stats = stats.observe_prefill_edge_transport(1, 4000, 40000, 512 << 10)
    assert dataclasses.asdict(stats) == expected
    merged = ReplyStats(kv_lookup_hits=1, kv_hit_stage_mask=1, verify_window_max_tokens=3).merge(
        ReplyStats(kv_lookup_hits=2, kv_hit_stage_mask=4, verify_window_max_tokens=2,
                   prefill_edge_total_us_max=9, prefill_edge_stage_index=3))
    assert (merged.kv_lookup_hits, merged.kv_hit_stage_mask, merged.verify_window_max_tokens,
            merged.prefill_edge_stage_index) == (3, 5, 3, 3)
    assert ReplyStats(prefill_edge_write_us_max=5).is_empty()
    assert not ReplyStats(prefill_edge_observation_count=1).is_empty()


# --------------------------------------------------------------------------------------------
# Invalid input
# --------------------------------------------------------------------------------------------


def _accepted_reasons(case: dict[str, Any]) -> set[str]:
    return {case["error"], *case.get("equivalent_errors", [])}


@pytest.mark.parametrize("case", vectors.INVALID_CASES, ids=vectors.ids(vectors.INVALID_CASES))
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_invalid_frames(wire_impl: ModuleType, case: dict[str, Any], feed: str) -> None:
    data = bytes.fromhex(case["hex"])
    eof = case["error_kind"] == "UnexpectedEof"
    if not data:
        # A sans-IO decoder reports a stream that ends between frames as a clean close; the
        # caller that was waiting for a frame treats END_OF_STREAM as the reference's EOF error.
        decoder = wire_impl.MessageDecoder(case["activation_width"])
        decoder.receive_data(b"")
        assert decoder.next_message() is END_OF_STREAM
        return
    if case["target"] == "ready":
        with pytest.raises(WireError) as raised:
            protocol.check_ready(data)
    else:
        decoder = (wire_impl.MessageDecoder(case["activation_width"])
                   if case["target"] == "message" else wire_impl.ReplyDecoder())
        pull = decoder.next_message if case["target"] == "message" else decoder.next_reply
        with pytest.raises(WireError) as raised:
            for chunk in FEEDS[feed](data):
                decoder.receive_data(chunk)
                assert pull() is NEED_DATA
            # InvalidData is detected from the bytes alone, before the end of the stream.
            assert eof, "malformed frame was not rejected before the end of the stream"
            decoder.receive_data(b"")
            pull()
    assert raised.value.end_of_stream is eof
    if not eof:
        assert raised.value.reason in _accepted_reasons(case)
        assert str(raised.value).startswith(raised.value.reason)


def _message(kind: MessageKind, **changes: Any) -> StageMessage:
    return StageMessage.create(kind, **changes)


def test_writer_rejects(wire_impl: ModuleType) -> None:
    """The reference's writer_rejects, raised here before anything is produced."""
    reasons = {case["name"]: case["error"] for case in vectors.WRITER_REJECTS}
    too_many = np.zeros(protocol.MAX_STAGE_SIDEBAND_VALUES + 1, dtype=np.int32)
    attempts: dict[str, Any] = {
        "writer_too_many_tokens": lambda: wire_impl.encode_message(
            _message(MessageKind.PREFILL_EMBD, tokens=too_many), WireDType.F32),
        "writer_too_many_positions": lambda: wire_impl.encode_message(
            _message(MessageKind.PREFILL_EMBD, positions=too_many), WireDType.F32),
        "writer_state_import_count_mismatch": lambda: wire_impl.encode_message(
            _message(MessageKind.STATE_IMPORT, token_count=8, raw_bytes=b"\x01\x02\x03\x04"),
            WireDType.F32),
        "writer_chat_metadata_too_large": lambda: wire_impl.encode_message(
            _message(MessageKind.CONFIGURE_GENERATION,
                     chat_sampling_metadata="x" * (protocol.MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES
                                                   + 1)), WireDType.F32),
        "writer_too_many_predicted_tokens": lambda: wire_impl.encode_reply(
            StageReply.predicted_token_vector((1,) * (protocol.MAX_STAGE_PREDICTED_TOKENS + 1))),
        "writer_too_many_mtp_draft_tokens": lambda: wire_impl.encode_reply(
            StageReply.predicted_token(1, native_mtp_draft=protocol.NativeMtpDraft(
                (1,) * (protocol.MAX_STAGE_PREDICTED_TOKENS + 1)))),
        "encode_activation_size_mismatch": lambda: wire_impl.encode_message(
            _message(MessageKind.PREFILL_EMBD, token_count=2,
                     state_changes={"source_stage_index": 0},
                     activation=np.zeros((1, 3), dtype=np.float32)), WireDType.F16, 4),
    }
    assert set(attempts) == set(reasons)
    for name, attempt in attempts.items():
        with pytest.raises(WireError) as raised:
            attempt()
        assert raised.value.reason == reasons[name], name


@pytest.mark.parametrize(
    ("message", "width", "reason"),
    [
        (_message(MessageKind.DECODE_EMBD, token_count=1, state_changes={"source_stage_index": 0},
                  activation=np.zeros((1, 7), dtype=np.float32)), 8,
         "F32 activation payload size mismatch"),
        (_message(MessageKind.DECODE_EMBD, token_count=1, state_changes={
            "source_stage_index": 0, "flags": int(StateFlag.GEMMA3N_ALTUP_SIDEBAND)},
                  activation=np.zeros((1, 8), dtype=np.float32)), 8,
         "F32 activation payload size mismatch"),
        (_message(MessageKind.DECODE_EMBD, token_count=1, state_changes={"source_stage_index": 0}),
         8, "F32 activation payload size mismatch"),
        (_message(MessageKind.DECODE_EMBD, token_count=1,
                  activation=np.zeros((1, 8), dtype=np.float32)), 8,
         "frame carries no activation"),
        (_message(MessageKind.STOP, tokens=np.array([1], dtype=np.int32)), 8,
         "frame kind carries no sideband or activation values"),
        (_message(MessageKind.TRIM_SESSION, token_count=-1), 8, "negative wire count"),
        (_message(MessageKind.TRIM_SESSION, state_changes={"version": 10}), 8,
         "unsupported stage state version"),
        (_message(MessageKind.TRIM_SESSION, pos_start=1 << 31), 8, "value out of range"),
        (_message(MessageKind.TRIM_SESSION, request_id=-1), 8, "value out of range"),
        (_message(MessageKind.TRIM_SESSION, raw_bytes=b"x"), 8, "only StateImport carries raw bytes"),
        (_message(MessageKind.PREFILL_EMBD, tokens=np.array([1 << 40])), 8, "value out of range"),
        (_message(MessageKind.CONFIGURE_GENERATION, chat_sampling_metadata="\ud800"), 8,
         "chat sampling metadata is not UTF-8"),
    ],
)
def test_writer_validates_before_writing(wire_impl: ModuleType, message: StageMessage,
                                         width: int, reason: str) -> None:
    with pytest.raises(WireError) as raised:
        wire_impl.encode_message(message, WireDType.F32, width)
    assert raised.value.reason == reason
    assert raised.value.field  # the message names the field


def test_writer_rejects_unknown_dtype_and_kind(wire_impl: ModuleType) -> None:
    with pytest.raises(WireError, match="unknown activation wire dtype"):
        wire_impl.encode_message(_message(MessageKind.STOP), 3)
    with pytest.raises(WireError, match="unknown stage message kind"):
        wire_impl.encode_message(dataclasses.replace(_message(MessageKind.STOP), kind=10),
                                 WireDType.F32)
    with pytest.raises(WireError, match="unknown stage reply kind"):
        wire_impl.encode_reply(StageReply(4))  # type: ignore[arg-type]


def test_decoder_end_of_stream_and_caps(wire_impl: ModuleType) -> None:
    stop = wire_impl.encode_message(StageMessage.stop(), WireDType.F32)
    decoder = wire_impl.MessageDecoder(8)
    assert decoder.next_message() is NEED_DATA
    decoder.receive_data(stop)
    assert isinstance(decoder.next_message(), StageMessage)
    decoder.receive_data(b"")
    assert decoder.next_message() is END_OF_STREAM
    with pytest.raises(RuntimeError):
        decoder.receive_data(stop)

    capped = wire_impl.MessageDecoder(8, max_buffer_bytes=100)
    with pytest.raises(WireError, match="cap"):
        capped.receive_data(stop + stop)
    capped.receive_data(stop[:40])
    # A frame announcing more than the cap is refused from its header.
    big = wire_impl.encode_message(
        _message(MessageKind.PREFILL_EMBD, token_count=4, state_changes={"source_stage_index": 0},
                 activation=np.ones((4, 8), dtype=np.float32)), WireDType.F32)
    capped = wire_impl.MessageDecoder(8, max_buffer_bytes=100)
    capped.receive_data(big[:80])
    with pytest.raises(WireError, match="cap"):
        capped.next_message()
    assert decoder.bytes_needed == 0


# --------------------------------------------------------------------------------------------
# Activation codecs and sidebands
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "bits"),
    [(1.0 + 2.0**-11, 0x3C01), (2049.0, 0x6801), (65519.0, 0x7BFF), (65520.0, 0x7C00),
     (-65520.0, 0xFC00), (6e-8, 0x0001), (2.0**-25, 0x0001), (1e-9, 0), (-0.0, 0x8000),
     (float("inf"), 0x7C00), (float("nan"), 0x7E00), (2.0**-14, 0x0400),
     (2.0**-14 - 2.0**-25, 0x0400), (0.1, 0x2E66)],
)
def test_f16_rounding(wire_impl: ModuleType, value: float, bits: int) -> None:
    encoded = wire_impl.encode_activation(np.array([[value]], dtype=np.float32), WireDType.F16)
    assert int.from_bytes(encoded, "little") == bits


def test_q8_reference_vector(wire_impl: ModuleType) -> None:
    rows = np.array([[0.5, -2.0], [1.0, 0.0]], dtype=np.float32)
    encoded = wire_impl.encode_activation(rows, WireDType.Q8)
    assert encoded.hex() == "0402813c" "0402013c" "2081" "7f00"
    zero = wire_impl.encode_activation(np.zeros((1, 3), dtype=np.float32), WireDType.Q8)
    assert zero.hex() == "0000803f" "000000"
    decoded = wire_impl.decode_activation(bytes.fromhex("0000003f02fe"), WireDType.Q8, 1, 2)
    assert decoded.tolist() == [[1.0, -1.0]]
    with pytest.raises(WireError, match="Q8 activation payload size mismatch"):
        wire_impl.decode_activation(bytes.fromhex("0000003f02"), WireDType.Q8, 1, 2)


def test_all_f16_bit_patterns_decode_exactly(wire_impl: ModuleType) -> None:
    halves = np.arange(1 << 16, dtype=np.uint16)
    decoded = wire_impl.decode_activation(halves.astype("<u2").tobytes(), WireDType.F16,
                                          1 << 8, 1 << 8)
    bits = decoded.reshape(-1).view(np.uint32)
    finite = (halves & 0x7C00) != 0x7C00
    reference = halves.view(np.float16).astype(np.float32).view(np.uint32)
    assert np.array_equal(bits[finite], reference[finite])
    nan = ~finite & ((halves & 0x3FF) != 0)
    expected_nan = ((halves[nan].astype(np.uint32) & 0x8000) << 16) | 0x7F800000 | (
        (halves[nan].astype(np.uint32) & 0x3FF) << 13)
    assert np.array_equal(bits[nan], expected_nan)
    # Every half that is not NaN survives f16 -> f32 -> f16 unchanged.
    encoded = wire_impl.encode_activation(decoded, WireDType.F16)
    again = np.frombuffer(encoded, dtype="<u2")
    assert np.array_equal(again[~nan], halves[~nan])


def test_sideband_views(wire_impl: ModuleType) -> None:
    values = np.arange(-5, 123, dtype="<i4")
    data = b"\x00" * 4 + values.tobytes()
    view = wire_impl.int32_sideband(data, 4, len(values))
    assert np.array_equal(view, values)
    assert not view.flags.writeable
    assert view.base is not None  # a view, not a copy
    unaligned = wire_impl.int32_sideband(b"\x00" + values.tobytes(), 1, len(values))
    assert np.array_equal(unaligned, values)
    assert unaligned.flags.aligned
    assert wire_impl.int32_sideband(data, 4, 0).size == 0


def test_decoded_f32_activation_is_a_view(wire_impl: ModuleType) -> None:
    message = _message(MessageKind.DECODE_EMBD, token_count=1, pos_start=3,
                       state_changes={"source_stage_index": 0},
                       tokens=np.array([9], dtype=np.int32),
                       activation=np.arange(16, dtype=np.float32).reshape(1, 16))
    frame = wire_impl.encode_message(message, WireDType.F32)
    decoded, _ = decode_messages(wire_impl, [frame], 16)
    got = decoded[0][0]
    assert got == message
    assert got.activation is not None and not got.activation.flags.writeable
    assert got.activation.shape == (1, 16) and got.activation.dtype == np.float32


def test_decoded_objects_are_ordinary_dataclasses(wire_impl: ModuleType) -> None:
    """The Cython decoder fills slots without __init__; the objects must not tell."""
    from skippy.codec.protocol import LogitBias, NativeMtpDraft, SamplingConfig

    sampling = SamplingConfig(1, 7, 0.5, 0.875, 40, 0.0625, 0.0, 0.0, 1.125, 64,  # f32-exact
                              (LogitBias(3, -1.5), LogitBias(9, 2.0)))
    message = _message(MessageKind.DECODE_EMBD, token_count=1, pos_start=3, sampling=sampling,
                       chat_sampling_metadata="{}", state_changes={"source_stage_index": 0},
                       tokens=np.array([9], dtype=np.int32),
                       activation=np.ones((1, 4), dtype=np.float32))
    decoded, _ = decode_messages(wire_impl, [wire_impl.encode_message(message, WireDType.F32)],
                                 4)
    got = decoded[0][0]
    expected_state = dataclasses.replace(message.state, flags=message.state.flags | 8 | 32)
    assert got == dataclasses.replace(message, state=expected_state)
    for value, expected in ((got.state, expected_state), (got.sampling, sampling),
                            (got.sampling.logit_bias[0], sampling.logit_bias[0])):
        assert type(value) is type(expected)
        assert value == expected and hash(value) == hash(expected)
        rebuilt = dataclasses.replace(value)  # through __init__
        assert rebuilt == expected and repr(rebuilt) == repr(value)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, dataclasses.fields(value)[0].name, 1)
    assert repr(got.kind) == repr(MessageKind.DECODE_EMBD)
    reply = StageReply.predicted_token(5, (5, 6), window_id=2,
                                       native_mtp_draft=NativeMtpDraft((7, 8), 11),
                                       stats=ReplyStats(kv_lookup_hits=3))
    (got_reply,) = decode_replies(wire_impl, [wire_impl.encode_reply(reply)])
    assert got_reply == reply and hash(got_reply) == hash(reply)
    assert repr(got_reply) == repr(dataclasses.replace(got_reply))
    assert hash(got_reply.stats) == hash(reply.stats)


def test_whole_bytes_frame_is_parsed_in_place() -> None:
    """The Cython decoder neither copies a bytes chunk in nor a whole-chunk frame out."""
    wire_c = pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    message = _message(MessageKind.DECODE_EMBD, token_count=1, tokens=np.array([9], np.int32),
                       state_changes={"source_stage_index": 0},
                       activation=np.arange(8, dtype=np.float32).reshape(1, 8))
    frame = wire_c.encode_message(message, WireDType.F32)
    decoder = wire_c.MessageDecoder(8)
    decoder.receive_data(frame)
    got = decoder.next_message()
    assert got == message and got.activation.base is frame and got.tokens.base is frame
    assert decoder.buffered_bytes == 0 and decoder.next_message() is NEED_DATA
    # Two frames in one chunk, then a frame split across chunks: copies, same messages.
    decoder.receive_data(frame + frame[:10])
    assert decoder.next_message() == message and decoder.buffered_bytes == 10
    assert decoder.next_message() is NEED_DATA
    decoder.receive_data(frame[10:] + frame)
    assert decoder.next_message() == message and decoder.next_message() == message
    assert decoder.buffered_bytes == 0


def test_kernels_match_the_twin_on_special_values() -> None:
    """f16 and q8 bytes of the vectorised C kernels equal the twin's numpy code."""
    wire_c = pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    wire_py = importlib.import_module(IMPLEMENTATIONS["py"])
    rng = np.random.default_rng(11)
    # Every sign/exponent/top-mantissa prefix with assorted low bits: all f16 rounding regions
    # (normal, subnormal, ties, overflow, inf, NaN) and f32 subnormals.
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0xFFFF], np.uint32)
    bits = (high[:, None] | low[None, :]).reshape(-1)
    values = np.concatenate([bits, rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint32)])
    values = values.view(np.float32).reshape(-1, 64)
    for dtype in (WireDType.F16, WireDType.Q8):
        assert wire_c.encode_activation(values, dtype) == wire_py.encode_activation(values, dtype)
    rows = rng.standard_normal((64, 33)).astype(np.float32) * np.float32(1e-30)
    rows[1] = 0.0
    rows[2, 5] = np.inf
    rows[3, ::3] = np.nan
    rows[4] = rows[4] * np.float32(1e-15)  # subnormal maxima: scales underflow to 0
    rows[5] = np.float32(127.0) * np.arange(33, dtype=np.float32) / np.float32(32.0) - 63.5
    for dtype in (WireDType.F16, WireDType.Q8):
        encoded = wire_c.encode_activation(rows, dtype)
        assert encoded == wire_py.encode_activation(rows, dtype)
        assert (wire_c.decode_activation(encoded, dtype, 64, 33).tobytes()
                == wire_py.decode_activation(encoded, dtype, 64, 33).tobytes())


def test_dispatched_kernels_match_portable() -> None:
    """The AVX2/F16C kernels (picked at run time) write exactly the portable loops' bytes.

    Ties (f16 normal and subnormal, q8 k + 0.5), NaN payloads of both signs, overflow, f32 and
    f16 subnormals, every f16 bit pattern, a few million random bit patterns, and row widths
    that leave loop tails. (The full 2^32 f32 inputs were checked outside the suite.)
    """
    wire_c = pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    initial = wire_c.activation_kernels()
    try:
        if wire_c.activation_kernels(True) != "avx2":
            pytest.skip("no AVX2/F16C kernels on this host")

        def both(encode: Any, *args: Any) -> tuple[Any, Any]:
            assert wire_c.activation_kernels(False) == "portable"
            portable = encode(*args)
            assert wire_c.activation_kernels(True) == "avx2"
            return portable, encode(*args)

        rng = np.random.default_rng(2024)
        high = np.arange(1 << 16, dtype=np.uint32) << 16
        low = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000,
                        0xF000, 0xFFFF], np.uint32)
        special = (high[:, None] | low[None, :]).reshape(-1)
        # f16 subnormal ties: (k + 0.5) * 2^-24, and their neighbours.
        ties = (np.arange(2048, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
        tie_bits = ties.view(np.uint32)
        random_bits = rng.integers(0, 1 << 32, 3 << 20, dtype=np.uint64).astype(np.uint32)
        bits = np.concatenate([special, tie_bits - 1, tie_bits, tie_bits + 1, tie_bits | 1 << 31,
                               random_bits])
        values = bits.view(np.float32)
        for count in (values.size, values.size - 1, 7, 9, 31):  # vector loop tails
            flat = values[:count].reshape(1, -1)
            portable, fast = both(wire_c.encode_activation, flat, WireDType.F16)
            assert fast == portable
        normal = (rng.standard_normal(1 << 20) * 1000).astype(np.float32).reshape(256, -1)
        portable, fast = both(wire_c.encode_activation, normal, WireDType.F16)
        assert fast == portable
        halves = np.arange(1 << 16, dtype="<u2").tobytes()
        for rows, width in ((256, 256), (1, 65535), (3, 7)):
            data = halves[:2 * rows * width]
            portable, fast = both(wire_c.decode_activation, data, WireDType.F16, rows, width)
            assert fast.tobytes() == portable.tobytes()
        # q8: rows of every width class, scale-1 rows (max 127) full of exact ties, specials.
        q8_rows = [values[:(1 << 20) - (1 << 20) % 4099].reshape(-1, 4099),
                   rng.standard_normal((64, 4096)).astype(np.float32),
                   rng.standard_normal((33, 37)).astype(np.float32) * np.float32(1e-40),
                   np.zeros((2, 40), np.float32)]
        tie_row = np.arange(-127.5, 128.0, 0.5, dtype=np.float32)
        tie_row = np.clip(tie_row, -127, 127)
        q8_rows.append(np.tile(tie_row, (3, 1)))
        nudged = np.concatenate([tie_row.view(np.uint32) + 1, tie_row.view(np.uint32) - 1])
        q8_rows.append(np.concatenate([nudged.view(np.float32), [np.float32(127)]])[None, :])
        mixed = rng.standard_normal((40, 100)).astype(np.float32)
        mixed[0, 3] = np.inf
        mixed[1, ::7] = np.nan
        mixed[2, :] = -np.inf
        mixed[3, ::2] = -np.nan
        mixed[4] = np.float32(3e38) * np.sign(mixed[4])
        q8_rows.append(mixed)
        for block in q8_rows:
            block = np.ascontiguousarray(block, dtype=np.float32)
            portable, fast = both(wire_c.encode_activation, block, WireDType.Q8)
            assert fast == portable, block.shape
    finally:
        wire_c.activation_kernels(initial == "avx2")


# --------------------------------------------------------------------------------------------
# Protocol vocabulary
# --------------------------------------------------------------------------------------------


def test_kinds_phases_and_flags_match_vectors() -> None:
    fmt = vectors.MESSAGES["format"]
    assert {k.reference_name: int(k) for k in MessageKind} == fmt["message_kinds"]
    assert {k.reference_name: int(k) for k in ReplyKind} == fmt["reply_kinds"]
    assert {p.reference_name: int(p) for p in Phase} == fmt["phases"]
    assert {d.reference_name: int(d) for d in WireDType} == fmt["wire_dtypes"]
    assert {f.name: int(f) for f in StateFlag} == fmt["state_flags"]
    for name, default in fmt["default_header_by_kind"].items():
        kind = MessageKind[name] if name in MessageKind.__members__ else next(
            k for k in MessageKind if k.reference_name == name)
        header = StateHeader.for_kind(kind)
        assert (header.phase, header.flags) == (default["phase"], default["flags"])
        assert header.matches_kind(kind)
    limits = fmt["limits"]
    for name, value in limits.items():
        assert getattr(protocol, name) == value
    assert protocol.READY_BYTES.hex() == vectors.INVALID["ready"]["hex"]
    protocol.check_ready(protocol.READY_BYTES)


def test_predicates() -> None:
    def codes(predicate: str) -> set[int]:
        return {int(k) for k in MessageKind if getattr(k, predicate)}

    assert codes("is_prefill") == {1, 4}
    assert codes("is_decode_replay") == {5, 6}
    assert codes("is_decode_light_context") == {9}
    assert codes("requires_predicted_reply") == {2, 4, 6, 8, 9, 21}
    assert codes("is_session_control") == {19}
    assert codes("is_verify_retirement") == {22}
    assert codes("is_generation_control") == {14}
    assert codes("is_prefix_cache_control") == {15, 16, 17, 18}
    assert codes("is_activationless_prefix_cache_control") == {15, 16, 17}
    decode = _message(MessageKind.DECODE_EMBD, pos_start=17)
    assert decode.authoritative_session_position == 17
    assert dataclasses.replace(decode, pos_start=-1).authoritative_session_position is None
    assert _message(MessageKind.PREFILL_EMBD, pos_start=3).authoritative_session_position is None
    window = _message(MessageKind.VERIFY_WINDOW, pos_start=135, token_count=4,
                      state_changes={"seq_id": 42})
    assert (window.verify_window_id, window.verify_window_base_position,
            window.verify_window_token_count) == (42, 135, 4)
    assert StateHeader.for_kind(MessageKind.DECODE_EMBD).matches_kind(MessageKind.VERIFY_WINDOW)
    assert not StateHeader.for_kind(MessageKind.DECODE_EMBD).matches_kind(
        MessageKind.PREFILL_FINAL_EMBD)
