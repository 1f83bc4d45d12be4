"""Pure-Python twin of :mod:`skippy.codec._wire`: the stage frame codec, sans-IO.

Strategy
--------
Frames have no length prefix (protocol.md §0): a frame's length follows from its header, the
optional-section flags and the activation width. Decoding is therefore two steps:

1. ``_message_layout`` walks the *uncommitted* buffer in the reference reader's order (§2.8),
   validating each size field the moment its bytes are present and before anything is sized from
   it. It returns either the frame layout or the number of bytes the frame needs so far. Nothing
   is copied; a decoder remembers that number and does not re-parse until enough bytes arrived.
2. Once the frame is complete it is *committed*: copied once out of the buffer into an immutable
   ``bytes`` object, and ``_build_message`` makes the token/position sidebands and f32 activations
   zero-copy numpy views of it (copying only when an offset is not 4-aligned). f16 and q8 are
   decoded into a fresh float32 array.

Encoding validates the whole message first (every range, limit and the activation shape against
``token_count x rows_per_token x width``) and only then builds the frame, so a failed encode
writes nothing. The activation codecs use numpy only with explicit bit manipulation, so they give
exactly the reference's bytes: f16 rounds ties away from zero, q8 rounds half away from zero.

This module and ``_wire.pyx`` expose the same names; ``tests/test_wire*.py`` run both.
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple, NoReturn, cast

import numpy as np

from skippy.codec import _frame_layout as layout
from skippy.codec import _wire_ext_py as _extension
from skippy.codec._activation_py import _f16_bits_to_f32, _f32_to_f16_bits, _f32_to_q8
from skippy.codec.protocol import (
    BOUNDARY_ROWS_BITS,
    BOUNDARY_ROWS_FLAG,
    MAX_BOUNDARY_ROWS,
    MAX_MESSAGE_FRAME_BYTES,
    MAX_REPLY_FRAME_BYTES,
    MAX_STAGE_ACTIVATION_BYTES,
    MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES,
    MAX_STAGE_DECODED_ACTIVATION_BYTES,
    MAX_STAGE_LOGIT_BIAS,
    MAX_STAGE_PREDICTED_TOKENS,
    MAX_STAGE_SIDEBAND_VALUES,
    MAX_STAGE_STATE_IMPORT_BYTES,
    STAGE_STATE_VERSION,
    END_OF_STREAM,
    NEED_DATA,
    Float32Array,
    Int32Array,
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
from skippy.codec.protocol_ext import SKIPPY_EXTENSIONS_FLAG, ErrorFrame, TimingsFrame

__all__ = [
    "IMPLEMENTATION",
    "MessageDecoder",
    "ReplyDecoder",
    "decode_activation",
    "encode_activation",
    "encode_error",
    "encode_message",
    "encode_reply",
    "encode_identity",
    "encode_timings",
    "boundary_rows",
    "int32_sideband",
]

encode_error = _extension.encode_error
encode_timings = _extension.encode_timings
encode_identity = _extension.encode_identity
encode_sampling_accepted = _extension.encode_sampling_accepted
encode_logprobs = _extension.encode_logprobs

#: Which implementation this module is (``wire.IMPLEMENTATION`` reports the one in use).
IMPLEMENTATION: Final = "python"

_FIXED: Final = struct.Struct("<5i10i2Q")  # §2.2: layout.FIXED_HEADER bytes
_SAMPLING: Final = struct.Struct("<IIffiffffiI")  # §2.5: layout.SAMPLING_FIXED bytes + u32 bias count
if _FIXED.size != layout.FIXED_HEADER or _SAMPLING.size != layout.SAMPLING_HEAD:
    raise ImportError("skippy.codec._wire_py disagrees with skippy.codec._frame_layout")
_I32: Final = struct.Struct("<i")
_U32: Final = struct.Struct("<I")
_REPLY_HEAD: Final = struct.Struct("<iii")
_DRAFT_TAIL: Final = struct.Struct("<q")
_STATS: Final = struct.Struct("<23q")
_KIND_CODES: Final = frozenset(int(kind) for kind in MessageKind)
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_U32_MAX: Final = (1 << 32) - 1
_U64_MAX: Final = (1 << 64) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_SAMPLING_BIT: Final = int(StateFlag.SAMPLING)
_EXTENSIONS_BIT: Final = SKIPPY_EXTENSIONS_FLAG
_SIDEBAND_BITS: Final = int(StateFlag.RWKV7_V_FIRST_SIDEBAND | StateFlag.GEMMA3N_ALTUP_SIDEBAND
                            | StateFlag.INKLING_MTP_EMBD_SIDEBAND)
_CHAT_BIT: Final = int(StateFlag.CHAT_SAMPLING_METADATA)
_STATE_FIELDS: Final = (
    "version", "seq_id", "phase", "flags", "checkpoint_generation", "prompt_token_count",
    "decode_step", "current_token", "source_stage_index",
)
_EMPTY_I32: Final = np.zeros(0, dtype=np.int32)
_EMPTY_I32.flags.writeable = False


# --------------------------------------------------------------------------------------------
# Sizes and activation codecs
# --------------------------------------------------------------------------------------------


def boundary_rows(flags: int) -> int:
    """The rows per token a frame with the boundary-rows bit announces (docs/protocol.md §12).

    Raises:
        WireError: the field is outside 2..MAX_BOUNDARY_ROWS, the sender did not negotiate (no
            SKIPPY_EXTENSIONS bit 10), or a v11 sideband bit (6-8) also sizes the activation.
    """
    rows = activation_row_multiplier(flags & BOUNDARY_ROWS_BITS)
    if not 2 <= rows <= MAX_BOUNDARY_ROWS:
        raise WireError("boundary rows per token out of range", field="state.flags", value=rows,
                        limit=f"2..{MAX_BOUNDARY_ROWS} in bits 16..21 with bit 15")
    if not flags & _EXTENSIONS_BIT:
        raise WireError("boundary rows without the skippy extensions bit", field="state.flags",
                        value=flags & 0xFFFFFFFF, limit="bit 15 only beside bit 10")
    if flags & _SIDEBAND_BITS:
        raise WireError("boundary rows beside a v11 sideband flag", field="state.flags",
                        value=flags & 0xFFFFFFFF, limit="bit 15 without bits 6-8")
    return rows


def _activation_sizes(dtype: int, token_count: int, width: int, flags: int) -> tuple[int, int]:
    """(rows, wire bytes) of an activation, enforcing the §2.6 limits before any allocation."""
    if token_count < 0 or width < 0:
        raise WireError(
            "negative activation dimensions", field="token_count/width",
            value=(token_count, width),
        )
    rows = token_count * (boundary_rows(flags) if flags & BOUNDARY_ROWS_FLAG else activation_row_multiplier(flags))
    elements = rows * width
    if dtype == WireDType.F32:
        wire_bytes = elements * 4
    elif dtype == WireDType.F16:
        wire_bytes = elements * 2
    else:
        wire_bytes = rows * 4 + elements
    if wire_bytes > MAX_STAGE_ACTIVATION_BYTES:
        raise WireError(
            "activation payload byte count exceeds maximum", field="activation_wire_bytes",
            value=wire_bytes, limit=MAX_STAGE_ACTIVATION_BYTES,
        )
    if wire_bytes > 0 and elements * 4 > MAX_STAGE_DECODED_ACTIVATION_BYTES:
        raise WireError(
            "decoded activation payload byte count exceeds maximum",
            field="activation_decoded_bytes", value=elements * 4,
            limit=MAX_STAGE_DECODED_ACTIVATION_BYTES,
        )
    return rows, wire_bytes


def encode_activation(values: Float32Array, wire_dtype: WireDType) -> bytes:
    """Encode a float32 ``(rows, width)`` activation to its wire bytes.

    Args:
        values: float32 array, shape ``(rows, width)``.
        wire_dtype: target encoding.
    Returns:
        The activation segment exactly as the reference writes it.
    Raises:
        WireError: wrong dtype or shape, or the size limits of protocol.md §2.6.
    """
    array = _float32_rows(values)
    rows, width = array.shape
    _activation_sizes(int(wire_dtype), rows, width, 0)
    if wire_dtype == WireDType.F32:
        return array.astype("<f4", copy=False).tobytes()
    if wire_dtype == WireDType.F16:
        return _f32_to_f16_bits(array.reshape(-1)).tobytes()
    return _f32_to_q8(array)


def decode_activation(data: bytes, wire_dtype: WireDType, rows: int, width: int,
                      offset: int = 0) -> Float32Array:
    """Decode an activation segment of ``data`` at ``offset`` to float32 ``(rows, width)``.

    f32 gives a read-only view of ``data`` when the offset is 4-aligned; f16/q8 a new array.

    Raises:
        WireError: size limits, negative dimensions, or ``data`` too short.
    """
    dtype = _check_dtype(wire_dtype)
    rows_checked, wire_bytes = _activation_sizes(dtype, rows, width, 0)
    if len(data) - offset < wire_bytes:
        raise WireError(
            "Q8 activation payload size mismatch" if dtype == WireDType.Q8
            else "activation payload size mismatch",
            field="activation_bytes", value=len(data) - offset, limit=wire_bytes,
        )
    elements = rows * width
    if dtype == WireDType.F32:
        array = np.frombuffer(data, dtype="<f4", count=elements, offset=offset)
        if not array.flags.aligned:
            array = array.copy()
        return cast(Float32Array, array.reshape(rows, width))
    if dtype == WireDType.F16:
        halves = np.frombuffer(data, dtype="<u2", count=elements, offset=offset)
        return _f16_bits_to_f32(halves).reshape(rows, width)
    scales = np.frombuffer(data, dtype="<f4", count=rows, offset=offset)
    quantized = np.frombuffer(data, dtype=np.int8, count=elements, offset=offset + 4 * rows)
    out = quantized.reshape(rows, width).astype(np.float32)
    with np.errstate(all="ignore"):  # 0 x inf and NaN scales yield NaN by definition
        out *= scales.astype(np.float32)[:, None]
    return cast(Float32Array, out)


def int32_sideband(data: bytes, offset: int, count: int) -> Int32Array:
    """``count`` little-endian i32 values of ``data`` at ``offset``: a read-only view when the
    offset is aligned, else a copy."""
    if count == 0:
        return _EMPTY_I32
    array = np.frombuffer(data, dtype="<i4", count=count, offset=offset)
    if not array.flags.aligned:
        array = array.copy()
        array.flags.writeable = False
    return cast(Int32Array, array)


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _check_range(name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise WireError("value is not an integer", field=name, value=value)
    number = int(value)
    if not low <= number <= high:
        raise WireError("value out of range", field=name, value=number, limit=f"[{low}, {high}]")
    return number


def _check_kind(kind: object) -> int:
    if isinstance(kind, bool) or not isinstance(kind, int) or int(kind) not in _KIND_CODES:
        raise WireError("unknown stage message kind", field="kind", value=kind)
    return int(kind)


def _check_version(version: int) -> None:
    if version != STAGE_STATE_VERSION:
        raise WireError("unsupported stage state version", field="state.version", value=version,
                        limit=STAGE_STATE_VERSION)


def _check_dtype(dtype: object) -> int:
    if isinstance(dtype, bool) or not isinstance(dtype, int) or not 0 <= int(dtype) <= 2:
        raise WireError("unknown activation wire dtype", field="wire_dtype", value=dtype,
                        limit="0 f32, 1 f16, 2 q8")
    return int(dtype)


def _int32_values(name: str, values: object, limit: int, reason: str) -> np.ndarray:
    array = np.asarray(values)
    if array.size == 0:
        return _EMPTY_I32
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise WireError("sideband values must be a 1-D integer array", field=name,
                        value=f"{array.dtype}{list(array.shape)}")
    if array.size > limit:
        raise WireError(reason, field=name, value=int(array.size), limit=limit)
    if array.dtype != np.int32:
        low, high = int(array.min()), int(array.max())
        if low < _I32_MIN or high > _I32_MAX:
            raise WireError("value out of range", field=name, value=(low, high),
                            limit="i32")
    return array.astype("<i4", copy=False)


def _float32_rows(values: object) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype != np.float32 or array.ndim != 2:
        raise WireError("activation must be a 2-D float32 array", field="activation",
                        value=f"{array.dtype}{list(array.shape)}")
    return np.ascontiguousarray(array)


def _pack_f32(name: str, value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except (OverflowError, struct.error, TypeError) as error:  # struct refuses non-f32 values
        raise WireError("value is not an f32", field=name, value=value) from error


def _encode_sampling(sampling: SamplingConfig) -> bytes:
    biases = sampling.logit_bias[:MAX_STAGE_LOGIT_BIAS]  # the reference silently truncates
    parts = [
        struct.pack(
            "<II", _check_range("sampling.flags", sampling.flags, 0, _U32_MAX),
            _check_range("sampling.seed", sampling.seed, 0, _U32_MAX),
        ),
        _pack_f32("sampling.temperature", sampling.temperature),
        _pack_f32("sampling.top_p", sampling.top_p),
        _I32.pack(_check_range("sampling.top_k", sampling.top_k, _I32_MIN, _I32_MAX)),
        _pack_f32("sampling.min_p", sampling.min_p),
        _pack_f32("sampling.presence_penalty", sampling.presence_penalty),
        _pack_f32("sampling.frequency_penalty", sampling.frequency_penalty),
        _pack_f32("sampling.repeat_penalty", sampling.repeat_penalty),
        _I32.pack(_check_range("sampling.penalty_last_n", sampling.penalty_last_n,
                               _I32_MIN, _I32_MAX)),
        _U32.pack(len(biases)),
    ]
    for bias in biases:
        parts.append(_I32.pack(_check_range("logit_bias.token_id", bias.token_id,
                                            _I32_MIN, _I32_MAX)))
        parts.append(_pack_f32("logit_bias.bias", bias.bias))
    return b"".join(parts)


def _none_or_empty(value: object) -> bool:
    return value is None or np.asarray(value).size == 0


def _encode_metadata(metadata: str) -> bytes:
    """The chat metadata section: u32 byte length, then UTF-8 (§2.5)."""
    try:
        text = metadata.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates cannot go on the wire
        raise WireError("chat sampling metadata is not UTF-8",
                        field="chat_sampling_metadata") from error
    if len(text) > MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES:
        raise WireError("chat sampling metadata is too large",
                        field="chat_sampling_metadata_bytes", value=len(text),
                        limit=MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES)
    return _U32.pack(len(text)) + text


def _activation_shape_error(shape: object, rows: int, width: int) -> NoReturn:
    raise WireError("F32 activation payload size mismatch", field="activation", value=shape,
                    limit=f"(rows, width) = {(rows, width)}")


def _validate_special_payload(kind: int, token_count: int, tokens: np.ndarray,
                              positions: np.ndarray, activation: object, raw: bytes,
                              carries: bool) -> None:
    """Payload rules other than the activation shape (writer side of §2.7, made strict)."""
    if kind == MessageKind.STOP or kind == MessageKind.STATE_IMPORT:
        # The reader never reads these values: writing them would desynchronise the stream.
        for name, value in (("tokens", tokens), ("positions", positions),
                            ("activation", activation)):
            if not _none_or_empty(value):
                raise WireError("frame kind carries no sideband or activation values",
                                field=name, value=MessageKind(kind).reference_name)
    if kind == MessageKind.STATE_IMPORT:
        if len(raw) > MAX_STAGE_STATE_IMPORT_BYTES:
            raise WireError("state import raw byte count exceeds maximum", field="raw_bytes",
                            value=len(raw), limit=MAX_STAGE_STATE_IMPORT_BYTES)
        if token_count != len(raw):
            raise WireError("state import raw byte count mismatch", field="token_count",
                            value=token_count, limit=f"len(raw_bytes) = {len(raw)}")
        return
    if raw:
        raise WireError("only StateImport carries raw bytes", field="raw_bytes", value=len(raw))
    if kind == MessageKind.STOP:
        return
    if token_count < 0:
        raise WireError("negative wire count", field="token_count", value=token_count,
                        limit=">= 0")
    if not carries and not _none_or_empty(activation):
        raise WireError("frame carries no activation", field="activation",
                        value=np.asarray(activation).shape,
                        limit="source_stage_index < 0 or activationless kind")


def encode_message(message: StageMessage, wire_dtype: WireDType,
                   width: int | None = None) -> bytes:
    """Encode ``message`` as one frame (``write_stage_message``, protocol.md §2.7).

    Args:
        message: the frame. ``state.reserved`` is replaced by ``wire_dtype`` and the SAMPLING /
            CHAT_SAMPLING_METADATA bits by the presence of those sections, as the reference does.
        wire_dtype: activation encoding.
        width: activation width (n_embd); defaults to ``message.activation.shape[1]``.
    Returns:
        The frame bytes.
    Raises:
        WireError: before anything is built, for any value the reader would reject or that would
            desynchronise the stream (an activation whose size is not
            ``token_count x rows_per_token x width``, sideband values on Stop, ...).
    """
    kind = _check_kind(message.kind)
    dtype = _check_dtype(wire_dtype)
    state = message.state
    tokens = _int32_values("tokens", message.tokens, MAX_STAGE_SIDEBAND_VALUES, "too many tokens")
    positions = _int32_values("positions", message.positions, MAX_STAGE_SIDEBAND_VALUES,
                              "too many position sideband values")
    header = [_check_range(name, getattr(state, name), _I32_MIN, _I32_MAX)
              for name in _STATE_FIELDS]
    _check_version(header[0])
    flags = header[3] & ~(_SAMPLING_BIT | _CHAT_BIT)
    sampling = b""
    if message.sampling is not None:
        flags |= _SAMPLING_BIT
        sampling = _encode_sampling(message.sampling)
    metadata = b""
    if message.chat_sampling_metadata is not None:
        flags |= _CHAT_BIT
        metadata = _encode_metadata(message.chat_sampling_metadata)
    header[3] = flags
    pos_start = _check_range("pos_start", message.pos_start, _I32_MIN, _I32_MAX)
    token_count = _check_range("token_count", message.token_count, _I32_MIN, _I32_MAX)
    request_id = _check_range("request_id", message.request_id, 0, _U64_MAX)
    session_id = _check_range("session_id", message.session_id, 0, _U64_MAX)
    raw = bytes(message.raw_bytes)
    activation = message.activation
    carries = carries_activation(kind, header[8])
    _validate_special_payload(kind, token_count, tokens, positions, activation, raw, carries)
    payload: list[bytes] = []
    if kind == MessageKind.STATE_IMPORT:
        payload.append(raw)
    elif kind != MessageKind.STOP:
        payload += (tokens.tobytes(), positions.tobytes())
        if carries:
            array = None if activation is None else _float32_rows(activation)
            if width is None:
                width = 0 if array is None else array.shape[1]
            rows, wire_bytes = _activation_sizes(dtype, token_count, width, flags)
            if array is None or array.size + rows * width == 0:
                # No values: fine only when there are none to send (q8 still sends row scales).
                if rows * width != 0:
                    _activation_shape_error(None, rows, width)
                array = np.zeros((rows, width), dtype=np.float32)
            if array.shape != (rows, width):
                _activation_shape_error(array.shape, rows, width)
            if wire_bytes:
                payload.append(encode_activation(array, WireDType(dtype)))
    header_bytes = _FIXED.pack(kind, pos_start, token_count, len(tokens), len(positions),
                               *header, dtype, request_id, session_id)
    return b"".join((header_bytes, sampling, metadata, *payload))


def encode_reply(reply: StageReply) -> bytes:
    """Encode ``reply`` (``send_reply_message``, protocol.md §5.1).

    Raises:
        WireError: unknown kind, out-of-range values, or more than MAX_STAGE_PREDICTED_TOKENS
            tokens or draft tokens; raised before anything is built.
    """
    kind = reply.kind
    if isinstance(kind, bool) or not isinstance(kind, int) or not 1 <= int(kind) <= 3:
        raise WireError("unknown stage reply kind", field="kind", value=kind)
    tokens = reply.predicted_tokens
    if len(tokens) > MAX_STAGE_PREDICTED_TOKENS:
        raise WireError("too many predicted tokens", field="predicted_tokens",
                        value=len(tokens), limit=MAX_STAGE_PREDICTED_TOKENS)
    parts = [_REPLY_HEAD.pack(int(kind), _check_range("predicted", reply.predicted,
                                                      _I32_MIN, _I32_MAX), len(tokens))]
    parts += [_I32.pack(_check_range("predicted_tokens", t, _I32_MIN, _I32_MAX)) for t in tokens]
    parts.append(_I32.pack(_check_range("window_id", reply.window_id, _I32_MIN, _I32_MAX)))
    draft = reply.native_mtp_draft
    if draft is None:
        parts.append(_I32.pack(0))
    else:
        if len(draft.token_ids) > MAX_STAGE_PREDICTED_TOKENS:
            raise WireError("too many native MTP draft tokens", field="native_mtp_draft.token_ids",
                            value=len(draft.token_ids), limit=MAX_STAGE_PREDICTED_TOKENS)
        parts.append(struct.pack("<ii", 1, len(draft.token_ids)))
        parts += [_I32.pack(_check_range("native_mtp_draft.token_ids", t, _I32_MIN, _I32_MAX))
                  for t in draft.token_ids]
        parts.append(_DRAFT_TAIL.pack(_check_range("native_mtp_draft.proposal_compute_us",
                                                   draft.proposal_compute_us, _I64_MIN, _I64_MAX)))
    stats = [_check_range(f"stats[{index}]", value, _I64_MIN, _I64_MAX)
             for index, value in enumerate(reply.stats.as_tuple())]
    parts.append(_STATS.pack(*stats))
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


class _MessageLayout(NamedTuple):
    """Where the sections of one complete frame lie, relative to the frame start."""

    length: int
    sampling_offset: int  # -1: none
    metadata: str | None
    payload_offset: int
    token_sideband_count: int
    position_sideband_count: int
    activation_rows: int  # -1: no activation


def _message_layout(buffer: bytes | bytearray, start: int, end: int,
                    width: int) -> _MessageLayout | int:
    """Validate the frame at ``buffer[start:end]`` as far as its bytes go.

    Returns the layout once the frame is complete, else the frame length needed so far.
    """
    available = end - start
    if available < 4:
        return 4
    kind = _I32.unpack_from(buffer, start)[0]
    if kind not in _KIND_CODES:
        raise WireError("unknown stage message kind", field="kind", value=kind)
    if available < layout.FIXED_HEADER:
        return layout.FIXED_HEADER
    fields = _FIXED.unpack_from(buffer, start)
    token_count, token_sideband_count, position_sideband_count = fields[2:5]
    version, flags, source_stage_index, dtype = fields[5], fields[8], fields[13], fields[14]
    _check_version(version)
    offset = layout.FIXED_HEADER
    sampling_offset = -1
    if flags & _SAMPLING_BIT:
        if available < offset + layout.SAMPLING_HEAD:
            return offset + layout.SAMPLING_HEAD
        bias_count = _U32.unpack_from(buffer, start + offset + layout.SAMPLING_FIXED)[0]
        if bias_count > MAX_STAGE_LOGIT_BIAS:
            raise WireError("logit bias count exceeds maximum", field="logit_bias_count",
                            value=bias_count, limit=MAX_STAGE_LOGIT_BIAS)
        sampling_offset = offset
        offset += layout.SAMPLING_HEAD + layout.SAMPLING_BIAS * bias_count
        if available < offset:
            return offset
    metadata = None
    if flags & _CHAT_BIT:
        if available < offset + 4:
            return offset + 4
        length = _U32.unpack_from(buffer, start + offset)[0]
        if length > MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES:
            raise WireError("chat sampling metadata length exceeds maximum",
                            field="chat_sampling_metadata_length", value=length,
                            limit=MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES)
        offset += 4 + length
        if available < offset:
            return offset
        try:
            metadata = bytes(buffer[start + offset - length:start + offset]).decode("utf-8")
        except UnicodeDecodeError as error:  # §2.5: the reader refuses non-UTF-8 metadata
            raise WireError("chat sampling metadata is not UTF-8",
                            field="chat_sampling_metadata", value=error.reason) from error
    if not 0 <= dtype <= 2:
        raise WireError("unknown activation wire dtype", field="state.reserved", value=dtype,
                        limit="0 f32, 1 f16, 2 q8")
    if kind == MessageKind.STOP:
        return _MessageLayout(offset, sampling_offset, metadata, offset, 0, 0, -1)
    for name, count in (("token_count", token_count),
                        ("token_sideband_count", token_sideband_count),
                        ("position_sideband_count", position_sideband_count)):
        if count < 0:
            raise WireError("negative wire count", field=name, value=count, limit=">= 0")
    if token_sideband_count > MAX_STAGE_SIDEBAND_VALUES:
        raise WireError("token sideband count exceeds maximum", field="token_sideband_count",
                        value=token_sideband_count, limit=MAX_STAGE_SIDEBAND_VALUES)
    if position_sideband_count > MAX_STAGE_SIDEBAND_VALUES:
        raise WireError("position sideband count exceeds maximum",
                        field="position_sideband_count", value=position_sideband_count,
                        limit=MAX_STAGE_SIDEBAND_VALUES)
    payload_offset = offset
    if kind == MessageKind.STATE_IMPORT:
        if token_count > MAX_STAGE_STATE_IMPORT_BYTES:
            raise WireError("state import byte count exceeds maximum", field="token_count",
                            value=token_count, limit=MAX_STAGE_STATE_IMPORT_BYTES)
        offset += token_count
        if available < offset:
            return offset
        return _MessageLayout(offset, sampling_offset, metadata, payload_offset, 0, 0, -1)
    offset += 4 * (token_sideband_count + position_sideband_count)
    rows = -1
    if carries_activation(kind, source_stage_index):
        rows, wire_bytes = _activation_sizes(dtype, token_count, width, flags)
        offset += wire_bytes
    if available < offset:
        return offset
    return _MessageLayout(offset, sampling_offset, metadata, payload_offset,
                          token_sideband_count, position_sideband_count, rows)


def _build_message(frame: bytes, layout: _MessageLayout, width: int) -> StageMessage:
    """Make the message of a committed, validated frame (views into ``frame``)."""
    fields = _FIXED.unpack_from(frame, 0)
    kind = MessageKind(fields[0])
    state = StateHeader(*fields[5:15])
    sampling = None
    if layout.sampling_offset >= 0:
        values = _SAMPLING.unpack_from(frame, layout.sampling_offset)
        bias_count = values[10]
        pairs = struct.unpack_from(f"<{'if' * bias_count}", frame, layout.sampling_offset + 44)
        flags, seed, temperature, top_p, top_k, min_p, presence, frequency, repeat, last_n = values[:10]
        sampling = SamplingConfig(
            flags, seed, temperature, top_p, top_k, min_p, presence, frequency, repeat, last_n,
            logit_bias=tuple(LogitBias(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)),
        )
    tokens = positions = _EMPTY_I32
    activation = None
    raw = b""
    offset = layout.payload_offset
    if kind == MessageKind.STATE_IMPORT:
        raw = frame[offset:layout.length]
    elif kind != MessageKind.STOP:
        tokens = int32_sideband(frame, offset, layout.token_sideband_count)
        offset += 4 * layout.token_sideband_count
        positions = int32_sideband(frame, offset, layout.position_sideband_count)
        offset += 4 * layout.position_sideband_count
        if layout.activation_rows >= 0:
            activation = decode_activation(frame, WireDType(state.reserved),
                                           layout.activation_rows, width, offset)
    return StageMessage(kind, fields[1], fields[2], state, fields[15], fields[16], sampling,
                        layout.metadata, tokens, positions, activation, raw)


class _ReplyLayout(NamedTuple):
    length: int
    draft_offset: int  # -1: no draft


def _reply_layout(buffer: bytes | bytearray, start: int, end: int) -> _ReplyLayout | int:
    """Validate the reply at ``buffer[start:end]`` in the reference reader's order (§5.1)."""
    available = end - start
    if available < 4:
        return 4
    kind = _I32.unpack_from(buffer, start)[0]
    if not 1 <= kind <= 3:
        raise WireError("unknown stage reply kind", field="kind", value=kind)
    if available < 12:
        return 12
    count = _I32.unpack_from(buffer, start + 8)[0]
    if count < 0:
        raise WireError("negative predicted token count", field="predicted_token_count",
                        value=count, limit=">= 0")
    if count > MAX_STAGE_PREDICTED_TOKENS:
        raise WireError("predicted token count exceeds maximum", field="predicted_token_count",
                        value=count, limit=MAX_STAGE_PREDICTED_TOKENS)
    offset = 12 + 4 * count + 4  # tokens, window_id
    if available < offset + 4:
        return offset + 4
    marker = _I32.unpack_from(buffer, start + offset)[0]
    offset += 4
    draft_offset = -1
    if marker == 1:
        if available < offset + 4:
            return offset + 4
        draft_count = _I32.unpack_from(buffer, start + offset)[0]
        if draft_count < 0:
            raise WireError("negative native MTP draft token count",
                            field="native_mtp_draft_token_count", value=draft_count,
                            limit=">= 0")
        if draft_count > MAX_STAGE_PREDICTED_TOKENS:
            raise WireError("native MTP draft token count exceeds maximum",
                            field="native_mtp_draft_token_count", value=draft_count,
                            limit=MAX_STAGE_PREDICTED_TOKENS)
        draft_offset = offset
        offset += 4 + 4 * draft_count + 8
    elif marker != 0:
        raise WireError("unknown native MTP draft reply marker", field="native_mtp_marker",
                        value=marker, limit="0 or 1")
    offset += _STATS.size
    if available < offset:
        return offset
    return _ReplyLayout(offset, draft_offset)


def _build_reply(frame: bytes, layout: _ReplyLayout) -> StageReply:
    kind, predicted, count = _REPLY_HEAD.unpack_from(frame, 0)
    tokens = struct.unpack_from(f"<{count}i", frame, 12)
    window_id = _I32.unpack_from(frame, 12 + 4 * count)[0]
    draft = None
    if layout.draft_offset >= 0:
        draft_count = _I32.unpack_from(frame, layout.draft_offset)[0]
        ids = struct.unpack_from(f"<{draft_count}i", frame, layout.draft_offset + 4)
        compute_us = _DRAFT_TAIL.unpack_from(frame, layout.draft_offset + 4 + 4 * draft_count)[0]
        draft = NativeMtpDraft(ids, compute_us)
    stats = ReplyStats(*_STATS.unpack_from(frame, layout.length - _STATS.size))
    return StageReply(ReplyKind(kind), predicted, tokens, window_id, draft, stats)


class _FrameDecoder:
    """Incremental buffer shared by the message and reply decoders.

    Bytes accumulate in one ``bytearray``; ``_start`` marks the first unconsumed byte and
    ``_needed`` the length the pending frame is known to need, so a large frame arriving in many
    chunks is parsed only when enough bytes are there. The buffer never holds more than
    ``max_buffer_bytes``.
    """

    def __init__(self, max_buffer_bytes: int) -> None:
        self._buffer = bytearray()
        self._start = 0
        self._needed = 0
        self._closed = False
        self._max_buffer_bytes = max_buffer_bytes

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet returned as frames."""
        return len(self._buffer) - self._start

    @property
    def bytes_needed(self) -> int:
        """Length the pending frame is known to need (0 when nothing is pending)."""
        return self._needed

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer ``data``; ``b""`` marks the end of the stream.

        Raises:
            WireError: the buffer would exceed ``max_buffer_bytes``.
            RuntimeError: data after the end of the stream.
        """
        if self._closed:
            raise RuntimeError("received data after the end of the stream")
        if not data:
            self._closed = True
            return
        if self.buffered_bytes + len(data) > self._max_buffer_bytes:
            raise WireError("buffered data exceeds the decoder's cap", field="buffered_bytes",
                            value=self.buffered_bytes + len(data), limit=self._max_buffer_bytes)
        if self._start and self._start == len(self._buffer):
            self._buffer.clear()
            self._start = 0
        self._buffer += data

    def _pending(self) -> bool:
        """True when a whole frame may be buffered; handles NEED_DATA / end of stream."""
        return self.buffered_bytes >= max(self._needed, 1)

    def _not_ready(self, needed: int) -> type[NEED_DATA] | type[END_OF_STREAM]:
        if needed > self._max_buffer_bytes:
            raise WireError("frame exceeds the decoder's buffer cap", field="frame_bytes",
                            value=needed, limit=self._max_buffer_bytes)
        self._needed = needed
        if not self._closed:
            return NEED_DATA
        if self.buffered_bytes == 0:
            return END_OF_STREAM
        raise WireError("failed to fill whole buffer", field="frame_bytes",
                        value=self.buffered_bytes, limit=needed, end_of_stream=True)

    def _commit(self, length: int) -> bytes:
        start = self._start
        with memoryview(self._buffer) as view:
            frame = view[start:start + length].tobytes()
        self._start = start + length
        self._needed = 0
        if self._start == len(self._buffer):
            self._buffer.clear()
            self._start = 0
        elif self._start > 65536 and self._start * 2 > len(self._buffer):
            del self._buffer[:self._start]
            self._start = 0
        return frame


class MessageDecoder(_FrameDecoder):
    """Incremental :class:`StageMessage` decoder for one stream (``read_stage_message``).

    Args:
        width: the activation width (n_embd) agreed out of band.
        max_buffer_bytes: cap on buffered bytes (default: the largest legal frame plus 1 MiB).
    """

    def __init__(self, width: int, *, max_buffer_bytes: int = MAX_MESSAGE_FRAME_BYTES + (1 << 20)
                 ) -> None:
        super().__init__(max_buffer_bytes)
        self.width = width

    def next_message(self) -> StageMessage | type[NEED_DATA] | type[END_OF_STREAM]:
        """The next complete message, ``NEED_DATA``, or ``END_OF_STREAM`` after EOF.

        Raises:
            WireError: the frame is malformed, or the stream ended inside it.
        """
        if not self._pending():
            return self._not_ready(self._needed)
        result = _message_layout(self._buffer, self._start, len(self._buffer), self.width)
        if isinstance(result, int):
            return self._not_ready(result)
        return _build_message(self._commit(result.length), result, self.width)


class ReplyDecoder(_FrameDecoder):
    """Incremental :class:`StageReply` decoder for one stream (``recv_reply``).

    Args:
        max_buffer_bytes: cap on buffered bytes.
        extensions: also accept skippy's extension frames (:class:`ErrorFrame`,
            :class:`TimingsFrame`; docs/protocol.md "Extensions"). Set it only on a connection
            whose messages carry the extension flag; otherwise their kinds are unknown, as in v11.
    """

    def __init__(self, *, max_buffer_bytes: int = MAX_REPLY_FRAME_BYTES + (1 << 20),
                 extensions: bool = False) -> None:
        super().__init__(max_buffer_bytes)
        self.extensions = extensions

    def next_reply(self) -> (StageReply | ErrorFrame | TimingsFrame | type[NEED_DATA]
                             | type[END_OF_STREAM]):
        """The next complete reply (or extension frame), ``NEED_DATA``, or ``END_OF_STREAM``.

        Raises:
            WireError: the reply is malformed, or the stream ended inside it.
        """
        if not self._pending():
            return self._not_ready(self._needed)
        buffer, start, end = self._buffer, self._start, len(self._buffer)
        if self.extensions and end - start >= 4 and not 1 <= _I32.unpack_from(buffer, start)[0] <= 3:
            if _extension.is_extension_kind(_I32.unpack_from(buffer, start)[0]):
                length = _extension.extension_layout(buffer, start, end)
                if length < 0:
                    return self._not_ready(-length)
                return _extension.build_extension(self._commit(length))
        result = _reply_layout(buffer, start, end)
        if isinstance(result, int):
            return self._not_ready(result)
        return _build_reply(self._commit(result.length), result)
