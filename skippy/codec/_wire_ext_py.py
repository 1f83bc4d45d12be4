"""Pure-Python codec of skippy's extension reply frames, twin of ``_wire_ext.pxi``.

Error and Timings (``docs/protocol.md`` §3-§4), Identity (§9), SamplingAccepted and Logprobs (§10).

Strategy
--------
The frames are laid out like v11 replies (little-endian, no length prefix, the first i32 is
the kind) so a reply decoder tells them apart by kind alone: ``_wire_py.ReplyDecoder`` and the
Cython one call :func:`extension_layout` only for a kind outside v11's 1..3, and only when the
decoder was built with ``extensions=True``; a v11 frame never reaches this module, so the v11
decode path is unchanged. Layouts and limits: ``docs/protocol.md`` "Extensions".

As in ``_wire_py``, :func:`extension_layout` validates each size field the moment its bytes are
present and before anything is sized from it, and returns either the frame length (complete) or
the length needed so far; :func:`build_extension` turns a committed frame into the dataclass.
Encoders validate everything before building, so a failed encode writes nothing, and they accept
exactly what the decoder accepts: ``decode(encode(x)) == x`` and ``encode(decode(b)) == b``.
The Cython section raises its errors through this module, so both give identical WireErrors.
"""

from __future__ import annotations

import math
import struct
from typing import Final

from skippy.codec.protocol import WireError
from skippy.codec.protocol_ext import (
    ERROR_FRAME_BASE_BYTES,
    IDENTITY_FRAME_BASE_BYTES,
    MAX_IDENTITY_NAME_BYTES,
    DECODE_RUN_FEATURE,
    GRAMMAR_FEATURE,
    LOGPROBS_FEATURE,
    MAX_ERROR_ADDRESS_BYTES,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_LOGPROB_ROWS,
    MAX_TIMING_RECORDS,
    MAX_TOP_LOGPROBS,
    TIMING_RECORD_BYTES,
    ErrorCode,
    ExtensionReplyKind,
    ErrorFrame,
    IdentityFrame,
    LogprobsFrame,
    SamplingAcceptedFrame,
    TimingsFrame,
    TimingRecord,
    TokenLogprobs,
)

__all__ = ["build_extension", "encode_error", "encode_identity", "encode_logprobs", "encode_sampling_accepted",
           "encode_timings", "extension_layout"]

_ERROR_HEAD: Final = struct.Struct("<iiiiI")  # kind, code, origin, reporter, address length
_U32: Final = struct.Struct("<I")
_I32: Final = struct.Struct("<i")
_TIMINGS_HEAD: Final = struct.Struct("<ii")  # kind, record count
_RECORD: Final = struct.Struct("<iiiiqqqq")
_IDENTITY_HEAD: Final = struct.Struct("<iiiiii32sI")  # kind, 5 figures, digest, name length
_IDENTITY_FIELDS: Final = ("layer_start", "layer_end", "layer_count", "ctx_size", "batch_size")
_ERROR_CODES: Final = frozenset(int(code) for code in ErrorCode)
_EXTENSION_KINDS: Final = frozenset(int(kind) for kind in ExtensionReplyKind)
_RECORD_I32_FIELDS: Final = ("stage_index", "layer_start", "layer_end", "batch_size")
_RECORD_I64_FIELDS: Final = ("compute_us", "forward_write_us", "downstream_wait_us",
                             "queue_wait_us")
_RECORD_FIELDS: Final = _RECORD_I32_FIELDS + _RECORD_I64_FIELDS
_I32_MAX: Final = (1 << 31) - 1
_I64_MAX: Final = (1 << 63) - 1
_FEATURES: Final = GRAMMAR_FEATURE | LOGPROBS_FEATURE | DECODE_RUN_FEATURE
_SAMPLING_ACCEPTED: Final = struct.Struct("<ii")  # kind, features
_LOGPROBS_HEAD: Final = struct.Struct("<iii")  # kind, row count, top count
_PAIR: Final = struct.Struct("<if")  # token, log-probability

assert _RECORD.size == TIMING_RECORD_BYTES and _ERROR_HEAD.size + 4 == ERROR_FRAME_BASE_BYTES
assert _IDENTITY_HEAD.size == IDENTITY_FRAME_BASE_BYTES


# --------------------------------------------------------------------------------------------
# Checks shared by the encoders and the decoder
# --------------------------------------------------------------------------------------------


def _check_code(code: object) -> int:
    if isinstance(code, bool) or not isinstance(code, int) or int(code) not in _ERROR_CODES:
        raise WireError("unknown stage error code", field="code", value=code,
                        limit=f"1..{max(_ERROR_CODES)}")
    return int(code)


def _check_stage_index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= _I32_MAX:
        raise WireError("stage index out of range", field=name, value=value,
                        limit=f"[-1, {_I32_MAX}]")
    return int(value)


def _check_text_length(name: str, length: int, limit: int) -> None:
    if length > limit:
        raise WireError(f"stage error {name} length exceeds maximum", field=f"{name}_length",
                        value=length, limit=limit)


def _check_record_count(count: int) -> None:
    if count < 0:
        raise WireError("negative timing record count", field="timing_record_count",
                        value=count, limit=">= 0")
    if count > MAX_TIMING_RECORDS:
        raise WireError("timing record count exceeds maximum", field="timing_record_count",
                        value=count, limit=MAX_TIMING_RECORDS)


def _check_record(index: int, values: tuple[object, ...]) -> tuple[int, ...]:
    """The eight values of a record, each a non-negative int in its range; layers ordered."""
    out = []
    for position, (name, value) in enumerate(zip(_RECORD_FIELDS, values)):
        high = _I32_MAX if position < 4 else _I64_MAX
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise WireError("timing value out of range", field=f"timings[{index}].{name}",
                            value=value, limit=f"[0, {high}]")
        out.append(int(value))
    if out[2] < out[1]:
        raise WireError("timing layer range is reversed", field=f"timings[{index}].layer_end",
                        value=out[2], limit=f">= layer_start = {out[1]}")
    return tuple(out)


def _check_identity(values: tuple[object, ...]) -> tuple[int, ...]:
    """The five figures of an Identity frame: ints, 0 <= start < end <= count, ctx and batch >= 1."""
    out = []
    for name, value in zip(_IDENTITY_FIELDS, values):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _I32_MAX:
            raise WireError("identity value out of range", field=name, value=value, limit=f"[0, {_I32_MAX}]")
        out.append(int(value))
    start, end, count, ctx, batch = out
    if not start < end <= count:
        raise WireError("identity layer range is invalid", field="layer_end", value=end,
                        limit=f"layer_start = {start} < layer_end <= layer_count = {count}")
    if ctx < 1 or batch < 1:
        raise WireError("identity context settings must be >= 1", field="ctx_size" if ctx < 1 else "batch_size",
                        value=min(ctx, batch), limit=">= 1")
    return tuple(out)


def _check_features(features: object) -> int:
    if isinstance(features, bool) or not isinstance(features, int) or not 0 <= features <= _FEATURES:
        raise WireError("unknown sampling feature bits", field="features", value=features,
                        limit=f"0..{_FEATURES}")
    return int(features)


def _check_logprob_counts(rows: int, top: int) -> None:
    if not 0 <= rows <= MAX_LOGPROB_ROWS:
        raise WireError("logprob row count out of range", field="logprob_row_count", value=rows,
                        limit=f"0..{MAX_LOGPROB_ROWS}")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise WireError("top logprob count out of range", field="top_logprob_count", value=top,
                        limit=f"0..{MAX_TOP_LOGPROBS}")


def _check_pair(name: str, token: object, logprob: object) -> tuple[int, float]:
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= _I32_MAX:
        raise WireError("logprob token out of range", field=f"{name}.token", value=token,
                        limit=f"[0, {_I32_MAX}]")
    if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) \
            or not (-math.inf < float(logprob) <= 0.0):
        raise WireError("logprob out of range", field=f"{name}.logprob", value=logprob,
                        limit="finite and <= 0")
    return int(token), float(logprob)


def _utf8(name: str, text: object, limit: int) -> bytes:
    if not isinstance(text, str):
        raise WireError("value is not a string", field=name, value=type(text).__name__)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates cannot go on the wire
        raise WireError(f"stage error {name} is not UTF-8", field=name) from error
    _check_text_length(name, len(data), limit)
    return data


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def encode_error(error: ErrorFrame) -> bytes:
    """Encode an Error frame (docs/protocol.md, Extensions §2).

    Raises:
        WireError: unknown code, a stage index below -1, a string over its limit or not
            encodable as UTF-8; raised before anything is built.
    """
    code = _check_code(error.code)
    origin = _check_stage_index("origin_stage_index", error.origin_stage_index)
    reporter = _check_stage_index("reporter_stage_index", error.reporter_stage_index)
    address = _utf8("address", error.origin_address, MAX_ERROR_ADDRESS_BYTES)
    message = _utf8("message", error.message, MAX_ERROR_MESSAGE_BYTES)
    return b"".join((
        _ERROR_HEAD.pack(ExtensionReplyKind.ERROR, code, origin, reporter, len(address)),
        address, _U32.pack(len(message)), message,
    ))


def encode_timings(timings: TimingsFrame) -> bytes:
    """Encode a Timings frame (docs/protocol.md, Extensions §3).

    Raises:
        WireError: more than MAX_TIMING_RECORDS records, a negative or out-of-range value, or a
            reversed layer range; raised before anything is built.
    """
    records = tuple(timings.records)
    _check_record_count(len(records))
    parts = [_TIMINGS_HEAD.pack(ExtensionReplyKind.TIMINGS, len(records))]
    for index, record in enumerate(records):
        values = tuple(getattr(record, name) for name in _RECORD_FIELDS)
        parts.append(_RECORD.pack(*_check_record(index, values)))
    return b"".join(parts)


def encode_identity(identity: IdentityFrame) -> bytes:
    """Encode an Identity frame (docs/protocol.md §9).

    Raises:
        WireError: a figure out of range, a reversed or empty range, a digest that is not 32
            bytes, a name over its limit; raised before anything is built.
    """
    values = _check_identity(tuple(getattr(identity, name) for name in _IDENTITY_FIELDS))
    digest = identity.digest
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise WireError("identity digest must be 32 bytes", field="digest",
                        value=len(digest) if isinstance(digest, bytes) else type(digest).__name__, limit=32)
    name = _utf8("model_name", identity.model_name, MAX_IDENTITY_NAME_BYTES)
    return _IDENTITY_HEAD.pack(ExtensionReplyKind.IDENTITY, *values, digest, len(name)) + name


def encode_sampling_accepted(frame: SamplingAcceptedFrame) -> bytes:
    """Encode a SamplingAccepted frame (docs/protocol.md §10).

    Raises:
        WireError: feature bits outside GRAMMAR_FEATURE | LOGPROBS_FEATURE | DECODE_RUN_FEATURE.
    """
    return _SAMPLING_ACCEPTED.pack(ExtensionReplyKind.SAMPLING_ACCEPTED, _check_features(frame.features))


def encode_logprobs(frame: LogprobsFrame) -> bytes:
    """Encode a Logprobs frame (docs/protocol.md §10).

    Raises:
        WireError: too many rows or alternatives, a row whose alternatives are not ``top_count``
            long, a negative token, or a log-probability that is not finite and <= 0; raised
            before anything is built.
    """
    rows = tuple(frame.rows)
    top = frame.top_count
    if isinstance(top, bool) or not isinstance(top, int):
        raise WireError("top logprob count out of range", field="top_logprob_count", value=top,
                        limit=f"0..{MAX_TOP_LOGPROBS}")
    _check_logprob_counts(len(rows), top)
    parts = [_LOGPROBS_HEAD.pack(ExtensionReplyKind.LOGPROBS, len(rows), top)]
    for index, row in enumerate(rows):
        parts.append(_PAIR.pack(*_check_pair(f"logprobs[{index}]", row.token, row.logprob)))
        alternatives = tuple(row.top)
        if len(alternatives) != top:
            raise WireError("logprob row has the wrong number of alternatives",
                            field=f"logprobs[{index}].top", value=len(alternatives), limit=top)
        for slot, pair in enumerate(alternatives):
            token, logprob = pair
            parts.append(_PAIR.pack(*_check_pair(f"logprobs[{index}].top[{slot}]", token, logprob)))
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def is_extension_kind(kind: int) -> bool:
    """True for the reply kinds this module decodes."""
    return kind in _EXTENSION_KINDS


def extension_layout(buffer: bytes | bytearray, start: int, end: int) -> int:
    """Validate the extension frame at ``buffer[start:end]`` as far as its bytes go.

    The caller has checked that the kind at ``start`` is an extension kind. Returns the frame
    length once the frame is complete, or the negated length needed so far.

    Raises:
        WireError: a field breaks its limit (before anything is sized from it).
    """
    available = end - start
    kind = _I32.unpack_from(buffer, start)[0]
    if kind == ExtensionReplyKind.SAMPLING_ACCEPTED:
        if available < 8:
            return -8
        _check_features(_I32.unpack_from(buffer, start + 4)[0])
        return 8
    if kind == ExtensionReplyKind.LOGPROBS:
        if available < 12:
            return -12
        _, rows, top = _LOGPROBS_HEAD.unpack_from(buffer, start)
        _check_logprob_counts(rows, top)
        length = 12 + rows * 8 * (1 + top)
        if available < length:
            return -length
        for index, (token, logprob) in enumerate(_PAIR.iter_unpack(bytes(buffer[start + 12:start + length]))):
            row, slot = divmod(index, 1 + top)
            _check_pair(f"logprobs[{row}]" + (f".top[{slot - 1}]" if slot else ""), token, logprob)
        return length
    if kind == ExtensionReplyKind.ERROR:
        if available < 20:
            return -20
        _, code, origin, reporter, address_length = _ERROR_HEAD.unpack_from(buffer, start)
        _check_code(code)
        _check_stage_index("origin_stage_index", origin)
        _check_stage_index("reporter_stage_index", reporter)
        _check_text_length("address", address_length, MAX_ERROR_ADDRESS_BYTES)
        offset = 20 + address_length
        if available < offset + 4:
            return -(offset + 4)
        message_length = _U32.unpack_from(buffer, start + offset)[0]
        _check_text_length("message", message_length, MAX_ERROR_MESSAGE_BYTES)
        offset += 4 + message_length
        if available < offset:
            return -offset
        _decode_text("address", buffer, start + 20, address_length)
        _decode_text("message", buffer, start + offset - message_length, message_length)
        return offset
    if kind == ExtensionReplyKind.IDENTITY:
        if available < IDENTITY_FRAME_BASE_BYTES:
            return -IDENTITY_FRAME_BASE_BYTES
        head = _IDENTITY_HEAD.unpack_from(buffer, start)
        _check_identity(head[1:6])
        name_length = head[7]
        if name_length > MAX_IDENTITY_NAME_BYTES:
            raise WireError("identity model_name length exceeds maximum", field="model_name_length",
                            value=name_length, limit=MAX_IDENTITY_NAME_BYTES)
        length = IDENTITY_FRAME_BASE_BYTES + name_length
        if available < length:
            return -length
        _decode_text("model_name", buffer, start + IDENTITY_FRAME_BASE_BYTES, name_length)
        return length
    if available < 8:
        return -8
    count = _I32.unpack_from(buffer, start + 4)[0]
    _check_record_count(count)
    length = 8 + TIMING_RECORD_BYTES * count
    if available < length:
        return -length
    for index in range(count):
        _check_record(index, _RECORD.unpack_from(buffer, start + 8 + TIMING_RECORD_BYTES * index))
    return length


def _decode_text(name: str, buffer: bytes | bytearray, offset: int, length: int) -> str:
    try:
        return bytes(buffer[offset:offset + length]).decode("utf-8")
    except UnicodeDecodeError as error:  # the frame's strings are UTF-8 by definition
        raise WireError(f"stage error {name} is not UTF-8", field=name,
                        value=error.reason) from error


def build_extension(frame: bytes) -> ErrorFrame | TimingsFrame | IdentityFrame | SamplingAcceptedFrame | LogprobsFrame:
    """The dataclass of a committed frame that :func:`extension_layout` accepted."""
    kind = _I32.unpack_from(frame, 0)[0]
    if kind == ExtensionReplyKind.IDENTITY:
        head = _IDENTITY_HEAD.unpack_from(frame, 0)
        name = _decode_text("model_name", frame, IDENTITY_FRAME_BASE_BYTES, head[7])
        return IdentityFrame(*head[1:6], bytes(head[6]), name)
    if kind == ExtensionReplyKind.SAMPLING_ACCEPTED:
        return SamplingAcceptedFrame(_I32.unpack_from(frame, 4)[0])
    if kind == ExtensionReplyKind.LOGPROBS:
        _, count, top = _LOGPROBS_HEAD.unpack_from(frame, 0)
        pairs = list(_PAIR.iter_unpack(frame[12:]))
        rows = []
        for row in range(count):
            token, logprob = pairs[row * (1 + top)]
            alternatives = tuple(pairs[row * (1 + top) + 1:(row + 1) * (1 + top)])
            rows.append(TokenLogprobs(token, logprob, alternatives))
        return LogprobsFrame(top, tuple(rows))
    if kind == ExtensionReplyKind.ERROR:
        _, code, origin, reporter, address_length = _ERROR_HEAD.unpack_from(frame, 0)
        message_length = _U32.unpack_from(frame, 20 + address_length)[0]
        address = _decode_text("address", frame, 20, address_length)
        message = _decode_text("message", frame, 24 + address_length, message_length)
        return ErrorFrame(ErrorCode(code), origin, reporter, address, message)
    count = _I32.unpack_from(frame, 4)[0]
    return TimingsFrame(tuple(
        TimingRecord(*_RECORD.unpack_from(frame, 8 + TIMING_RECORD_BYTES * index))
        for index in range(count)
    ))
