"""Skippy's negotiated extension frames (docs/protocol.md "Extensions"), for both implementations.

Golden frames pin the layouts byte for byte; one table drives encode and decode; every frame is
fed whole, one byte at a time, split at every offset and back to back with the reference's v11
reply vectors; malformed frames raise WireError naming the field and limit, before the end of the
stream when a size field is at fault; a decoder not told to accept extensions rejects them as v11
does, and an extension-aware decoder reads plain v11 replies exactly as before.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import pytest

import wire_vectors as vectors
from skippy.codec.protocol import (
    END_OF_STREAM,
    NEED_DATA,
    MessageKind,
    StageMessage,
    StageReply,
    StateFlag,
    WireDType,
    WireError,
)
from skippy.codec.protocol_ext import (
    MAX_ERROR_ADDRESS_BYTES,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_TIMING_RECORDS,
    PREFIX_EXTENT_FLAG,
    SKIPPY_EXTENSIONS_FLAG,
    ErrorCode,
    ErrorFrame,
    ExtensionNegotiation,
    IdentityFrame,
    MODEL_IDENTITY_FLAG,
    DIRECT_RETURN_FLAG,
    TimingRecord,
    TimingsFrame,
    append_timing,
    identity_query,
    is_identity_query,
    requests_extensions,
    with_extensions_flag,
)
from skippy.codec.wire_cli import (
    decode_frames,
    encode_frames,
    extension_from_fields,
    extension_to_fields,
    reply_to_fields,
)

IMPLEMENTATIONS = {"py": "skippy.codec._wire_py", "c": "skippy.codec._wire"}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def wire_impl(request: pytest.FixtureRequest) -> ModuleType:
    """Each codec implementation: the pure twin and the Cython module."""
    if request.param == "c":
        return pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    return importlib.import_module(IMPLEMENTATIONS[request.param])


def whole(data: bytes) -> Iterator[bytes]:
    yield data


def bytewise(data: bytes) -> Iterator[bytes]:
    for index in range(len(data)):
        yield data[index:index + 1]


FEEDS = {"whole": whole, "bytewise": bytewise}

Frame = ErrorFrame | TimingsFrame | IdentityFrame | StageReply


def encode(wire_impl: ModuleType, frame: Frame) -> bytes:
    if isinstance(frame, ErrorFrame):
        return bytes(wire_impl.encode_error(frame))
    if isinstance(frame, TimingsFrame):
        return bytes(wire_impl.encode_timings(frame))
    if isinstance(frame, IdentityFrame):
        return bytes(wire_impl.encode_identity(frame))
    return bytes(wire_impl.encode_reply(frame))


def decode(wire_impl: ModuleType, chunks: Iterable[bytes], extensions: bool = True) -> list[Any]:
    decoder = wire_impl.ReplyDecoder(extensions=extensions)
    out = []
    for chunk in chunks:
        decoder.receive_data(chunk)
        while (item := decoder.next_reply()) is not NEED_DATA:
            out.append(item)
    decoder.receive_data(b"")
    assert decoder.next_reply() is END_OF_STREAM
    assert decoder.buffered_bytes == 0
    return out


# --------------------------------------------------------------------------------------------
# The table: (id, frame, exact bytes)
# --------------------------------------------------------------------------------------------

RECORD = TimingRecord(1, 8, 16, 2, 5, 6, 7, 8)
RECORD_HEX = ("01000000" "08000000" "10000000" "02000000"
              "0500000000000000" "0600000000000000" "0700000000000000" "0800000000000000")

CASES: list[tuple[str, Frame, str]] = [
    ("error_downstream_lost", ErrorFrame(ErrorCode.DOWNSTREAM_LOST, 2, 1, "h:1", "x"),
     "005e0000" "01000000" "02000000" "01000000" "03000000" "683a31" "01000000" "78"),
    ("error_empty_strings", ErrorFrame(ErrorCode.MALFORMED_FRAME, -1, 0),
     "005e0000" "02000000" "ffffffff" "00000000" "00000000" "00000000"),
    ("error_utf8", ErrorFrame(ErrorCode.RUNTIME_ERROR, 0, 0, "", "é"),
     "005e0000" "03000000" "00000000" "00000000" "00000000" "02000000" "c3a9"),
    ("timings_empty", TimingsFrame(), "015e0000" "00000000"),
    ("timings_one", TimingsFrame((RECORD,)), "015e0000" "01000000" + RECORD_HEX),
    ("timings_two", TimingsFrame((RECORD, TimingRecord(0, 0, 8))),
     "015e0000" "02000000" + RECORD_HEX + "00000000" "00000000" "08000000" + "00" * 36),
    ("error_limits", ErrorFrame(ErrorCode.INTERNAL, 2**31 - 1, 63, "a" * MAX_ERROR_ADDRESS_BYTES,
                                "m" * MAX_ERROR_MESSAGE_BYTES),
     "005e0000" "08000000" "ffffff7f" "3f000000" "00010000" + "61" * 256 + "00100000"
     + "6d" * 4096),
    ("timings_limits", TimingsFrame((TimingRecord(2**31 - 1, 0, 2**31 - 1, 2**31 - 1, 2**63 - 1,
                                                  0, 2**63 - 1, 0),) * MAX_TIMING_RECORDS),
     "015e0000" "40000000" + ("ffffff7f" "00000000" "ffffff7f" "ffffff7f" "ffffffffffffff7f"
                              + "00" * 8 + "ffffffffffffff7f" + "00" * 8) * 64),
]
DIGEST = bytes(range(32))
IDENTITY = IdentityFrame(8, 16, 24, 4096, 512, DIGEST, "m.gguf")
IDENTITY_HEX = ("025e0000" "08000000" "10000000" "18000000" "00100000" "00020000" + DIGEST.hex()
                + "06000000" + b"m.gguf".hex())
CASES += [
    ("identity", IDENTITY, IDENTITY_HEX),
    ("identity_no_name", IdentityFrame(0, 1, 1, 1, 1, b"\xff" * 32),
     "025e0000" "00000000" "01000000" "01000000" "01000000" "01000000" + "ff" * 32 + "00000000"),
    ("error_model_mismatch", ErrorFrame(ErrorCode.MODEL_MISMATCH, 1, 0, "h:2", "x"),
     "005e0000" "09000000" "01000000" "00000000" "03000000" "683a32" "01000000" "78"),
]
CASE_IDS = [case[0] for case in CASES]
V11_REPLIES = [bytes.fromhex(case["hex"]) for case in vectors.REPLY_CASES]


@pytest.mark.parametrize(("name", "frame", "hex_bytes"), CASES, ids=CASE_IDS)
def test_encode_golden(wire_impl: ModuleType, name: str, frame: Frame, hex_bytes: str) -> None:
    assert encode(wire_impl, frame).hex() == hex_bytes


@pytest.mark.parametrize(("name", "frame", "hex_bytes"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_decode_golden(wire_impl: ModuleType, name: str, frame: Frame, hex_bytes: str,
                       feed: str) -> None:
    data = bytes.fromhex(hex_bytes)
    assert decode(wire_impl, FEEDS[feed](data)) == [frame]


@pytest.mark.parametrize(("name", "frame", "hex_bytes"), CASES[:6], ids=CASE_IDS[:6])
def test_split_at_every_offset(wire_impl: ModuleType, name: str, frame: Frame,
                               hex_bytes: str) -> None:
    data = bytes.fromhex(hex_bytes) + V11_REPLIES[0]
    expected = decode(wire_impl, [data])
    assert expected[0] == frame and len(expected) == 2
    for split in range(1, len(data)):
        assert decode(wire_impl, [data[:split], data[split:]]) == expected


def test_back_to_back_with_v11_replies(wire_impl: ModuleType) -> None:
    """Extension frames interleaved with every v11 reply vector, as a relaying stage sends them."""
    stream = bytearray()
    expected: list[Any] = []
    for index, reply_bytes in enumerate(V11_REPLIES):
        _, frame, hex_bytes = CASES[index % len(CASES)]
        stream += bytes.fromhex(hex_bytes) + reply_bytes
        expected.append(frame)
        expected.append(vectors.REPLY_CASES[index]["fields"])
    for feed in FEEDS.values():
        decoded = decode(wire_impl, feed(bytes(stream)))
        assert [item if isinstance(item, (ErrorFrame, TimingsFrame, IdentityFrame)) else reply_to_fields(item)
                for item in decoded] == expected


def test_aware_decoder_reads_plain_v11_replies(wire_impl: ModuleType) -> None:
    """An extension-aware client on a v11 server sees exactly the v11 replies."""
    for case, data in zip(vectors.REPLY_CASES, V11_REPLIES):
        for feed in FEEDS.values():
            plain = decode(wire_impl, feed(data), extensions=False)
            aware = decode(wire_impl, feed(data), extensions=True)
            assert aware == plain
            assert [reply_to_fields(reply) for reply in aware] == [case["fields"]]
    for case in vectors.REPLY_DECODE_ONLY:
        data = bytes.fromhex(case["hex"])
        assert decode(wire_impl, bytewise(data)) == decode(wire_impl, [data], extensions=False)


@pytest.mark.parametrize(("name", "frame", "hex_bytes"), CASES, ids=CASE_IDS)
def test_not_negotiated_decoder_rejects_like_v11(wire_impl: ModuleType, name: str, frame: Frame,
                                                 hex_bytes: str) -> None:
    decoder = wire_impl.ReplyDecoder()
    assert decoder.extensions is False
    decoder.receive_data(bytes.fromhex(hex_bytes)[:4])
    with pytest.raises(WireError) as raised:
        decoder.next_reply()
    assert raised.value.reason == "unknown stage reply kind"


def test_unknown_kind_still_rejected_when_negotiated(wire_impl: ModuleType) -> None:
    decoder = wire_impl.ReplyDecoder(extensions=True)
    decoder.receive_data(bytes.fromhex("7f5e0000"))
    with pytest.raises(WireError, match="unknown stage reply kind"):
        decoder.next_reply()


# --------------------------------------------------------------------------------------------
# Malformed frames
# --------------------------------------------------------------------------------------------

ERROR_HEAD = "005e0000"
INVALID: list[tuple[str, str, str, str]] = [
    # id, bytes, reason, field
    ("unknown_code_0", ERROR_HEAD + "00000000" "00000000" "00000000" "00000000",
     "unknown stage error code", "code"),
    ("unknown_code_10", ERROR_HEAD + "0a000000" "00000000" "00000000" "00000000",
     "unknown stage error code", "code"),
    ("identity_reversed", IDENTITY_HEX[:8] + "10000000" "08000000" + IDENTITY_HEX[24:],
     "identity layer range is invalid", "layer_end"),
    ("identity_past_count", IDENTITY_HEX[:16] + "20000000" + IDENTITY_HEX[24:],
     "identity layer range is invalid", "layer_end"),
    ("identity_negative_ctx", IDENTITY_HEX[:32] + "ffffffff" + IDENTITY_HEX[40:],
     "identity value out of range", "ctx_size"),
    ("identity_zero_batch", IDENTITY_HEX[:40] + "00000000" + IDENTITY_HEX[48:],
     "identity context settings must be >= 1", "batch_size"),
    ("identity_name_huge", IDENTITY_HEX[:112] + "ffffffff", "identity model_name length exceeds maximum",
     "model_name_length"),
    ("identity_name_not_utf8", IDENTITY_HEX[:112] + "01000000" "ff", "stage error model_name is not UTF-8",
     "model_name"),
    ("origin_below_minus_1", ERROR_HEAD + "01000000" "feffffff" "00000000" "00000000",
     "stage index out of range", "origin_stage_index"),
    ("reporter_below_minus_1", ERROR_HEAD + "01000000" "00000000" "00000080" "00000000",
     "stage index out of range", "reporter_stage_index"),
    ("address_too_long", ERROR_HEAD + "01000000" "00000000" "00000000" "01010000",
     "stage error address length exceeds maximum", "address_length"),
    ("address_huge", ERROR_HEAD + "01000000" "00000000" "00000000" "ffffffff",
     "stage error address length exceeds maximum", "address_length"),
    ("message_too_long", ERROR_HEAD + "01000000" "00000000" "00000000" "00000000" "01100000",
     "stage error message length exceeds maximum", "message_length"),
    ("address_not_utf8", ERROR_HEAD + "01000000" "00000000" "00000000" "01000000" "ff"
     "00000000", "stage error address is not UTF-8", "address"),
    ("message_not_utf8", ERROR_HEAD + "01000000" "00000000" "00000000" "00000000" "02000000"
     "c328", "stage error message is not UTF-8", "message"),
    ("timings_negative_count", "015e0000" "ffffffff", "negative timing record count",
     "timing_record_count"),
    ("timings_too_many", "015e0000" "41000000", "timing record count exceeds maximum",
     "timing_record_count"),
    ("timings_negative_stage", "015e0000" "01000000" "ffffffff" + RECORD_HEX[8:],
     "timing value out of range", "timings[0].stage_index"),
    ("timings_negative_batch", "015e0000" "01000000" + RECORD_HEX[:24] + "ffffffff"
     + RECORD_HEX[32:], "timing value out of range", "timings[0].batch_size"),
    ("timings_negative_us", "015e0000" "02000000" + RECORD_HEX + RECORD_HEX[:-16]
     + "ffffffffffffffff", "timing value out of range", "timings[1].queue_wait_us"),
    ("timings_reversed_layers", "015e0000" "01000000" "01000000" "10000000" "08000000"
     + RECORD_HEX[24:], "timing layer range is reversed", "timings[0].layer_end"),
]


@pytest.mark.parametrize(("name", "hex_bytes", "reason", "field"), INVALID,
                         ids=[case[0] for case in INVALID])
@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_malformed_frames_raise(wire_impl: ModuleType, name: str, hex_bytes: str, reason: str,
                                field: str, feed: str) -> None:
    decoder = wire_impl.ReplyDecoder(extensions=True)
    with pytest.raises(WireError) as raised:
        for chunk in FEEDS[feed](bytes.fromhex(hex_bytes)):
            decoder.receive_data(chunk)
            assert decoder.next_reply() is NEED_DATA
        pytest.fail("malformed frame was not rejected from its bytes alone")
    assert raised.value.reason == reason
    assert raised.value.field == field
    assert not raised.value.end_of_stream
    assert str(raised.value).startswith(reason)


def test_malformed_errors_identical_across_implementations() -> None:
    wire_c = pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    wire_py = importlib.import_module(IMPLEMENTATIONS["py"])
    for _, hex_bytes, _, _ in INVALID:
        messages = []
        for impl in (wire_py, wire_c):
            decoder = impl.ReplyDecoder(extensions=True)
            decoder.receive_data(bytes.fromhex(hex_bytes))
            with pytest.raises(WireError) as raised:
                decoder.next_reply()
            messages.append(str(raised.value))
        assert messages[0] == messages[1]


@pytest.mark.parametrize(("name", "frame", "hex_bytes"), CASES, ids=CASE_IDS)
def test_truncated_frames_end_of_stream(wire_impl: ModuleType, name: str, frame: Frame,
                                        hex_bytes: str) -> None:
    data = bytes.fromhex(hex_bytes)
    for cut in {1, len(data) // 2, len(data) - 1} - {0}:
        decoder = wire_impl.ReplyDecoder(extensions=True)
        decoder.receive_data(data[:cut])
        assert decoder.next_reply() is NEED_DATA
        decoder.receive_data(b"")
        with pytest.raises(WireError) as raised:
            decoder.next_reply()
        assert raised.value.end_of_stream


def test_decoder_cap_applies(wire_impl: ModuleType) -> None:
    decoder = wire_impl.ReplyDecoder(extensions=True, max_buffer_bytes=64)
    decoder.receive_data(bytes.fromhex(ERROR_HEAD + "01000000" "00000000" "00000000" "40000000"))
    with pytest.raises(WireError, match="buffer cap"):
        decoder.next_reply()


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------

GOOD_ERROR = ErrorFrame(ErrorCode.OVERLOADED, 0, 0, "a", "b")
WRITER_REJECTS: list[tuple[str, Frame, str, str]] = [
    ("code_unknown", dataclasses.replace(GOOD_ERROR, code=99), "unknown stage error code",
     "code"),
    ("code_bool", dataclasses.replace(GOOD_ERROR, code=True), "unknown stage error code", "code"),
    ("origin_low", dataclasses.replace(GOOD_ERROR, origin_stage_index=-2),
     "stage index out of range", "origin_stage_index"),
    ("origin_huge", dataclasses.replace(GOOD_ERROR, origin_stage_index=1 << 70),
     "stage index out of range", "origin_stage_index"),
    ("reporter_type", dataclasses.replace(GOOD_ERROR, reporter_stage_index="1"),
     "stage index out of range", "reporter_stage_index"),
    ("address_long", dataclasses.replace(GOOD_ERROR, origin_address="é" * 129),
     "stage error address length exceeds maximum", "address_length"),
    ("message_long", dataclasses.replace(GOOD_ERROR, message="m" * 4097),
     "stage error message length exceeds maximum", "message_length"),
    ("message_surrogate", dataclasses.replace(GOOD_ERROR, message="\ud800"),
     "stage error message is not UTF-8", "message"),
    ("message_type", dataclasses.replace(GOOD_ERROR, message=b"x"), "value is not a string",
     "message"),
    ("too_many_records", TimingsFrame((RECORD,) * 65), "timing record count exceeds maximum",
     "timing_record_count"),
    ("negative_us", TimingsFrame((dataclasses.replace(RECORD, compute_us=-1),)),
     "timing value out of range", "timings[0].compute_us"),
    ("us_overflow", TimingsFrame((RECORD, dataclasses.replace(RECORD, downstream_wait_us=1 << 63))),
     "timing value out of range", "timings[1].downstream_wait_us"),
    ("stage_i32_overflow", TimingsFrame((dataclasses.replace(RECORD, stage_index=1 << 31),)),
     "timing value out of range", "timings[0].stage_index"),
    ("float_value", TimingsFrame((dataclasses.replace(RECORD, batch_size=1.0),)),
     "timing value out of range", "timings[0].batch_size"),
    ("reversed_layers", TimingsFrame((dataclasses.replace(RECORD, layer_end=7),)),
     "timing layer range is reversed", "timings[0].layer_end"),
    ("identity_digest_short", dataclasses.replace(IDENTITY, digest=b"x"), "identity digest must be 32 bytes",
     "digest"),
    ("identity_empty_range", dataclasses.replace(IDENTITY, layer_end=8), "identity layer range is invalid",
     "layer_end"),
    ("identity_name_long", dataclasses.replace(IDENTITY, model_name="n" * 257),
     "stage error model_name length exceeds maximum", "model_name_length"),
]


@pytest.mark.parametrize(("name", "frame", "reason", "field"), WRITER_REJECTS,
                         ids=[case[0] for case in WRITER_REJECTS])
def test_writer_rejects(wire_impl: ModuleType, name: str, frame: Frame, reason: str,
                        field: str) -> None:
    with pytest.raises(WireError) as raised:
        encode(wire_impl, frame)
    assert raised.value.reason == reason
    assert raised.value.field == field
    if "exceeds" in reason or "range" in reason:
        assert raised.value.limit is not None


# --------------------------------------------------------------------------------------------
# Negotiation and relay helpers
# --------------------------------------------------------------------------------------------


def test_flag_bits_do_not_collide() -> None:
    v11_bits = 0
    for flag in StateFlag:
        v11_bits |= int(flag)
    assert SKIPPY_EXTENSIONS_FLAG == 1 << 10 and MODEL_IDENTITY_FLAG == 1 << 12
    assert not SKIPPY_EXTENSIONS_FLAG & (v11_bits | PREFIX_EXTENT_FLAG)
    assert not MODEL_IDENTITY_FLAG & (v11_bits | PREFIX_EXTENT_FLAG | SKIPPY_EXTENSIONS_FLAG | DIRECT_RETURN_FLAG)


def test_identity_query_and_mismatch_rules(wire_impl: ModuleType) -> None:
    query = identity_query()
    assert is_identity_query(query) and query.kind is MessageKind.PREDICTION_RETURN_OPEN
    frame = wire_impl.encode_message(query, WireDType.F32, 8)
    decoder = wire_impl.MessageDecoder(8)
    decoder.receive_data(bytes(frame))
    assert is_identity_query(decoder.next_message())  # a plain v11 message on the wire
    return_open = dataclasses.replace(query, state=dataclasses.replace(
        query.state, flags=query.state.flags | DIRECT_RETURN_FLAG))
    assert not is_identity_query(return_open)
    upstream = dataclasses.replace(IDENTITY, layer_start=0, layer_end=8)
    assert upstream.mismatch(IDENTITY) is None
    assert upstream.mismatch(dataclasses.replace(IDENTITY, digest=b"\0" * 32)) == "the model files differ"
    assert "start at 9" in str(upstream.mismatch(dataclasses.replace(IDENTITY, layer_start=9)))
    assert "context" in str(upstream.mismatch(dataclasses.replace(IDENTITY, ctx_size=1)))
    assert "m.gguf" in IDENTITY.describe() and DIGEST.hex()[:12] in IDENTITY.describe()


def test_flag_is_carried_by_the_v11_codec_and_changes_only_the_flags(wire_impl: ModuleType
                                                                     ) -> None:
    message = StageMessage.create(MessageKind.DECODE_EMBD, pos_start=5, token_count=1,
                                  tokens=[7])
    flagged = with_extensions_flag(message)
    assert requests_extensions(flagged.state.flags)
    assert not requests_extensions(message.state.flags)
    assert with_extensions_flag(flagged) is flagged
    plain = wire_impl.encode_message(message, WireDType.F32, 0)
    marked = wire_impl.encode_message(flagged, WireDType.F32, 0)
    assert len(plain) == len(marked)
    assert [i for i in range(len(plain)) if plain[i] != marked[i]] == [33]  # flags, byte 1
    decoder = wire_impl.MessageDecoder(0)
    decoder.receive_data(marked)
    decoded = decoder.next_message()
    assert decoded.state.flags == message.state.flags | SKIPPY_EXTENSIONS_FLAG
    decoder.receive_data(plain)
    assert dataclasses.replace(decoded, state=message.state) == decoder.next_message()


def test_negotiation_is_sticky_per_connection() -> None:
    negotiation = ExtensionNegotiation()
    message = StageMessage.create(MessageKind.STOP)
    assert negotiation.observe(message) is False
    assert negotiation.observe(with_extensions_flag(message)) is True
    assert negotiation.observe(message) is True


def test_timings_relay_appends_in_order() -> None:
    last = TimingRecord(2, 16, 24, 1, 900)
    middle = TimingRecord(1, 8, 16, 1, 800, 10, 950)
    first = TimingRecord(0, 0, 8, 1, 700, 12, 1800, 3)
    relayed = append_timing(append_timing(append_timing(None, last), middle), first)
    assert relayed.records == (last, middle, first)


def test_error_names_the_lost_stage() -> None:
    error = ErrorFrame(ErrorCode.DOWNSTREAM_LOST, 2, 1, "10.0.0.3:9000", "connection reset")
    assert error.describe() == ("downstream_lost at stage 2 (10.0.0.3:9000), reported by stage "
                                "1: connection reset")
    assert ErrorFrame(ErrorCode.RUNTIME_ERROR, 1, 1, "", "boom").describe() == \
        "runtime_error at stage 1: boom"


# --------------------------------------------------------------------------------------------
# CLI notation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "frame", "hex_bytes"), CASES, ids=CASE_IDS)
def test_cli_notation_round_trips(name: str, frame: Frame, hex_bytes: str) -> None:
    assert not isinstance(frame, StageReply)
    fields = extension_to_fields(frame)
    assert extension_from_fields(fields) == frame
    data = bytes.fromhex(hex_bytes) + V11_REPLIES[1]
    decoded = list(decode_frames(data, 0, replies=True))
    assert decoded == [fields, vectors.REPLY_CASES[1]["fields"]]
    import json

    text = json.dumps(decoded)
    assert b"".join(encode_frames(text, None, None, replies=True)) == data
    named = {key: value for key, value in fields.items() if key not in ("kind_code", "code_value")}
    assert b"".join(encode_frames(json.dumps(named), None, None, replies=True)) == data[
        :len(bytes.fromhex(hex_bytes))]
