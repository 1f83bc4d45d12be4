"""``python -m skippy.codec.wire``: decode and encode stage frames when debugging a chain.

Strategy
--------
The JSON notation is the one of ``../shared/wire-vectors`` (a case's ``fields``), so a frame
captured from a live chain can be compared with the golden vectors directly, and a vector can be
turned back into bytes:

* ``decode --width N [--replies] [--hex] [FILE]`` reads frames (binary, or hex text with
  ``--hex``) from FILE or stdin and prints one JSON object per frame, one per line.
* ``encode [--dtype D] [--width N] [--replies] [--hex] [FILE]`` reads JSON values (a ``fields``
  object, a whole vector case, or arrays of those) and writes the frames (binary, or one hex
  line per frame with ``--hex``).
* With ``--replies`` both commands also handle skippy's extension frames (``"kind": "Error"`` /
  ``"Timings"``, docs/protocol.md "Extensions"), mixed freely with v11 replies.

Floats are written as the shortest decimal that round-trips to the float32; non-finite values
are ``"NaN"``/``"Infinity"``/``"-Infinity"``; the ``*_hex`` fields are exact. Malformed input:
the codec's error on stderr, exit status 2. The converters (``message_to_fields`` ...) are
public because the tests drive the shared vectors through them too.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np

from skippy.codec import wire
from skippy.codec.protocol import (
    REPLY_STATS_FIELDS,
    END_OF_STREAM,
    NEED_DATA,
    LogitBias,
    MessageKind,
    NativeMtpDraft,
    Phase,
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
)
from skippy.codec.protocol_ext import (
    ErrorCode,
    ErrorFrame,
    IdentityFrame,
    ExtensionReplyKind,
    LogprobsFrame,
    SamplingAcceptedFrame,
    TimingRecord,
    TimingsFrame,
    TokenLogprobs,
)

ExtensionFrame = ErrorFrame | TimingsFrame | IdentityFrame | SamplingAcceptedFrame | LogprobsFrame

__all__ = [
    "extension_from_fields",
    "extension_to_fields",
    "main",
    "message_from_fields",
    "message_to_fields",
    "reply_from_fields",
    "reply_to_fields",
]

_KINDS_BY_NAME = {kind.reference_name: kind for kind in MessageKind}
_REPLY_KINDS_BY_NAME = {kind.reference_name: kind for kind in ReplyKind}
_EXTENSION_KINDS_BY_NAME = {"".join(part.title() for part in kind.name.split("_")): kind
                            for kind in ExtensionReplyKind}
_ERROR_CODES_BY_NAME = {code.name.title().replace("_", ""): code for code in ErrorCode}
_TIMING_FIELDS = tuple(TimingRecord.__dataclass_fields__)
_IDENTITY_FIELDS = ("layer_start", "layer_end", "layer_count", "ctx_size", "batch_size")
_DTYPES_BY_NAME = {dtype.reference_name: dtype for dtype in WireDType}
_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repeat_penalty")
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


# --------------------------------------------------------------------------------------------
# Float notation
# --------------------------------------------------------------------------------------------


def float32_to_json(value: float) -> float | str:
    """Shortest decimal that round-trips to the float32 ``value``, or a non-finite string."""
    single = np.float32(value)
    if np.isnan(single):
        return "NaN"
    if np.isinf(single):
        return "Infinity" if single > 0 else "-Infinity"
    return float(str(single))


def float32_from_json(value: object) -> float:
    """A JSON float or non-finite string, rounded to float32 and returned as a Python float."""
    if isinstance(value, str):
        if value not in _NON_FINITE:
            raise WireError("not a float", field="float", value=value)
        return _NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError("not a float", field="float", value=value)
    return float(np.float32(value))


def _floats_to_json(values: np.ndarray) -> list[float | str]:
    return [float32_to_json(v) for v in values.reshape(-1)]


def _float32_array_from_fields(fields: dict[str, Any]) -> np.ndarray | None:
    exact = fields.get("activation_f32_hex")
    if exact is not None:
        return np.frombuffer(bytes.fromhex(exact), dtype="<f4").astype(np.float32)
    values = fields.get("activation")
    if values is None:
        return None
    return np.array([np.float32(float32_from_json(v)) for v in values], dtype=np.float32)


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


def flag_names(flags: int) -> list[str]:
    """Names of the set state-flag bits, unknown ones as ``bit_N``, lowest bit first."""
    names = []
    for bit in range(32):
        if flags & (1 << bit):
            try:
                names.append(StateFlag(1 << bit).name or f"bit_{bit}")
            except ValueError:  # a bit v11 does not define
                names.append(f"bit_{bit}")
    return names


def _kind_from_fields(fields: dict[str, Any]) -> int:
    if "kind_code" in fields:
        return int(fields["kind_code"])
    name = fields.get("kind")
    if name not in _KINDS_BY_NAME:
        raise WireError("unknown stage message kind", field="kind", value=name)
    return _KINDS_BY_NAME[name]


def message_from_fields(fields: dict[str, Any], width: int | None = None) -> StageMessage:
    """Build a :class:`StageMessage` from the vectors' ``fields`` notation.

    The activation comes from ``activation_f32_hex`` (exact) or ``activation`` and is shaped
    ``(token_count x rows_per_token, width)``; ``width`` is derived from its length when omitted.
    """
    kind_code = _kind_from_fields(fields)
    kind = MessageKind(kind_code) if kind_code in MessageKind._value2member_map_ else kind_code
    state = StateHeader(**fields.get("state", {}))
    sampling = None
    if fields.get("sampling") is not None:
        raw_sampling = dict(fields["sampling"])
        biases = tuple(
            LogitBias(int(b["token_id"]), float32_from_json(b["bias"]))
            for b in raw_sampling.pop("logit_bias", [])
        )
        raw_sampling.pop("logit_bias_count", None)
        for name in _SAMPLING_FLOATS:
            if name in raw_sampling:
                raw_sampling[name] = float32_from_json(raw_sampling[name])
        sampling = SamplingConfig(**raw_sampling, logit_bias=biases)
    token_count = int(fields.get("token_count", 0))
    activation = _float32_array_from_fields(fields)
    if activation is not None:
        rows = max(token_count, 0) * activation_row_multiplier(state.flags)
        if width is None:
            width = activation.size // rows if rows else 0
        if rows * width != activation.size:
            raise WireError("F32 activation payload size mismatch", field="activation",
                            value=activation.size, limit=f"rows {rows} x width {width}")
        activation = activation.reshape(rows, width)
    raw_hex = fields.get("raw_bytes_hex")
    return StageMessage(
        kind=kind,  # type: ignore[arg-type]
        pos_start=int(fields.get("pos_start", 0)),
        token_count=token_count,
        state=state,
        request_id=int(fields.get("request_id", 0)),
        session_id=int(fields.get("session_id", 0)),
        sampling=sampling,
        chat_sampling_metadata=fields.get("chat_sampling_metadata"),
        tokens=np.array(fields.get("tokens", []), dtype=np.int64),
        positions=np.array(fields.get("positions", []), dtype=np.int64),
        activation=activation,
        raw_bytes=bytes.fromhex(raw_hex) if raw_hex else b"",
    )


def _sampling_to_fields(sampling: SamplingConfig) -> dict[str, Any]:
    return {
        "flags": sampling.flags,
        "seed": sampling.seed,
        "temperature": float32_to_json(sampling.temperature),
        "top_p": float32_to_json(sampling.top_p),
        "top_k": sampling.top_k,
        "min_p": float32_to_json(sampling.min_p),
        "presence_penalty": float32_to_json(sampling.presence_penalty),
        "frequency_penalty": float32_to_json(sampling.frequency_penalty),
        "repeat_penalty": float32_to_json(sampling.repeat_penalty),
        "penalty_last_n": sampling.penalty_last_n,
        "logit_bias_count": len(sampling.logit_bias),
        "logit_bias": [{"token_id": b.token_id, "bias": float32_to_json(b.bias)}
                       for b in sampling.logit_bias],
    }


def message_to_fields(message: StageMessage, frame: bytes | None = None) -> dict[str, Any]:
    """The vectors' ``fields`` notation of a decoded message.

    ``frame`` (the message's bytes) supplies what the message itself does not keep: the
    sideband counts of Stop/StateImport headers, whose values the reader never reads, and the
    exact activation wire bytes.
    """
    state = message.state
    token_sideband_count, position_sideband_count = len(message.tokens), len(message.positions)
    if frame is not None:
        token_sideband_count, position_sideband_count = struct.unpack_from("<ii", frame, 12)
    try:
        phase_name: str | None = Phase(state.phase).reference_name
    except ValueError:  # the reader does not validate the phase
        phase_name = None
    dtype = WireDType(state.reserved)
    activation = message.activation
    fields: dict[str, Any] = {
        "kind": MessageKind(message.kind).reference_name,
        "kind_code": int(message.kind),
        "pos_start": message.pos_start,
        "token_count": message.token_count,
        "token_sideband_count": token_sideband_count,
        "position_sideband_count": position_sideband_count,
        "state": {name: int(getattr(state, name)) for name in StateHeader.__dataclass_fields__},
        "phase_name": phase_name,
        "flag_names": flag_names(state.flags),
        "request_id": message.request_id,
        "session_id": message.session_id,
        "sampling": None if message.sampling is None else _sampling_to_fields(message.sampling),
        "chat_sampling_metadata": message.chat_sampling_metadata,
        "tokens": [int(t) for t in message.tokens],
        "positions": [int(p) for p in message.positions],
        "raw_bytes_hex": bytes(message.raw_bytes).hex()
        if message.kind == MessageKind.STATE_IMPORT else None,
        "activation_present": activation is not None,
        "activation_rows": 0 if activation is None else int(activation.shape[0]),
        "activation_wire_bytes": 0,
        "activation": None,
        "activation_f32_hex": None,
        "activation_wire_hex": None,
    }
    if activation is not None:
        f32_hex = activation.astype("<f4").tobytes().hex()
        if frame is not None:
            rows, width = activation.shape
            wire_bytes = {WireDType.F32: 4 * rows * width, WireDType.F16: 2 * rows * width,
                          WireDType.Q8: rows * (4 + width)}[dtype]
            wire_hex = frame[len(frame) - wire_bytes:].hex()
        else:
            wire_hex = wire.encode_activation(activation, dtype).hex()
        fields["activation_wire_bytes"] = len(wire_hex) // 2
        fields["activation_wire_hex"] = wire_hex
        if dtype == WireDType.F32:
            fields["activation"] = _floats_to_json(activation)
            fields["activation_f32_hex"] = f32_hex
        else:
            fields["decoded_activation"] = _floats_to_json(activation)
            fields["decoded_activation_f32_hex"] = f32_hex
    return fields


# --------------------------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------------------------


def reply_from_fields(fields: dict[str, Any]) -> StageReply:
    """Build a :class:`StageReply` from the vectors' ``fields`` notation."""
    if "kind_code" in fields:
        kind: Any = int(fields["kind_code"])
        kind = ReplyKind(kind) if kind in ReplyKind._value2member_map_ else kind
    elif fields.get("kind") in _REPLY_KINDS_BY_NAME:
        kind = _REPLY_KINDS_BY_NAME[fields["kind"]]
    else:
        raise WireError("unknown stage reply kind", field="kind", value=fields.get("kind"))
    draft_fields = fields.get("native_mtp_draft")
    draft = None
    if draft_fields is not None:
        draft = NativeMtpDraft(tuple(draft_fields.get("token_ids", ())),
                               int(draft_fields.get("proposal_compute_us", 0)))
    stats = ReplyStats(**fields.get("stats", {}))
    return StageReply(kind, int(fields.get("predicted", 0)),
                      tuple(fields.get("predicted_tokens", ())), int(fields.get("window_id", 0)),
                      draft, stats)


def reply_to_fields(reply: StageReply) -> dict[str, Any]:
    """The vectors' ``fields`` notation of a reply."""
    draft = reply.native_mtp_draft
    return {
        "kind": ReplyKind(reply.kind).reference_name,
        "kind_code": int(reply.kind),
        "predicted": reply.predicted,
        "predicted_token_count": len(reply.predicted_tokens),
        "predicted_tokens": list(reply.predicted_tokens),
        "window_id": reply.window_id,
        "native_mtp_draft": None if draft is None else {
            "token_ids": list(draft.token_ids),
            "proposal_compute_us": draft.proposal_compute_us,
        },
        "stats": dict(zip(REPLY_STATS_FIELDS, reply.stats.as_tuple())),
    }


def _is_extension(fields: dict[str, Any]) -> bool:
    if "kind_code" in fields:
        return int(fields["kind_code"]) in ExtensionReplyKind._value2member_map_
    return fields.get("kind") in _EXTENSION_KINDS_BY_NAME


def extension_from_fields(fields: dict[str, Any]) -> ExtensionFrame:
    """Build an extension frame (docs/protocol.md "Extensions") from its JSON notation:
    ``{"kind": "Error", "code": "DownstreamLost", ...}`` or ``{"kind": "Timings", "records":
    [...]}``; ``kind_code`` / ``code_value`` may replace the names."""
    kind = (int(fields["kind_code"]) if "kind_code" in fields
            else _EXTENSION_KINDS_BY_NAME[fields["kind"]])
    if kind == ExtensionReplyKind.ERROR:
        code: Any = fields.get("code_value", fields.get("code"))
        if isinstance(code, str):
            if code not in _ERROR_CODES_BY_NAME:
                raise WireError("unknown stage error code", field="code", value=code)
            code = _ERROR_CODES_BY_NAME[code]
        return ErrorFrame(code, fields.get("origin_stage_index", -1),
                          fields.get("reporter_stage_index", -1),
                          fields.get("origin_address", ""), fields.get("message", ""))
    if kind == ExtensionReplyKind.IDENTITY:
        try:
            digest = bytes.fromhex(str(fields.get("digest", "")))
        except ValueError as error:  # not hex: report it like any bad field
            raise WireError("identity digest is not hex", field="digest") from error
        return IdentityFrame(*(fields.get(name, 0) for name in _IDENTITY_FIELDS), digest,
                             fields.get("model_name", ""))
    if kind == ExtensionReplyKind.SAMPLING_ACCEPTED:
        return SamplingAcceptedFrame(fields.get("features", 0))
    if kind == ExtensionReplyKind.LOGPROBS:
        return LogprobsFrame(fields.get("top_count", 0), tuple(
            TokenLogprobs(row["token"], row["logprob"], tuple((int(t), float(lp)) for t, lp in row.get("top", ())))
            for row in fields.get("rows", ())))
    return TimingsFrame(tuple(TimingRecord(**record) for record in fields.get("records", ())))


def extension_to_fields(frame: ExtensionFrame) -> dict[str, Any]:
    """The JSON notation of an extension frame (the inverse of :func:`extension_from_fields`)."""
    if isinstance(frame, IdentityFrame):
        return {"kind": "Identity", "kind_code": int(ExtensionReplyKind.IDENTITY),
                **{name: getattr(frame, name) for name in _IDENTITY_FIELDS},
                "digest": frame.digest.hex(), "model_name": frame.model_name}
    if isinstance(frame, SamplingAcceptedFrame):
        return {"kind": "SamplingAccepted", "kind_code": int(ExtensionReplyKind.SAMPLING_ACCEPTED),
                "features": frame.features}
    if isinstance(frame, LogprobsFrame):
        return {"kind": "Logprobs", "kind_code": int(ExtensionReplyKind.LOGPROBS), "top_count": frame.top_count,
                "rows": [{"token": row.token, "logprob": float32_to_json(row.logprob),
                          "top": [[token, float32_to_json(logprob)] for token, logprob in row.top]}
                         for row in frame.rows]}
    if isinstance(frame, ErrorFrame):
        code = ErrorCode(frame.code)
        return {
            "kind": "Error",
            "kind_code": int(ExtensionReplyKind.ERROR),
            "code": code.name.title().replace("_", ""),
            "code_value": int(code),
            "origin_stage_index": frame.origin_stage_index,
            "reporter_stage_index": frame.reporter_stage_index,
            "origin_address": frame.origin_address,
            "message": frame.message,
        }
    return {
        "kind": "Timings",
        "kind_code": int(ExtensionReplyKind.TIMINGS),
        "record_count": len(frame.records),
        "records": [{name: getattr(record, name) for name in _TIMING_FIELDS}
                    for record in frame.records],
    }


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def _read_input(path: str | None, as_hex: bool) -> bytes:
    stream: BinaryIO = sys.stdin.buffer if path in (None, "-") else open(path, "rb")  # noqa: SIM115
    with stream:
        data = stream.read()
    if as_hex:
        try:
            return bytes.fromhex("".join(data.decode("ascii").split()))
        except (UnicodeDecodeError, ValueError) as error:  # not hex text: a usage error
            raise WireError("input is not hex text", field="input") from error
    return data


def decode_frames(data: bytes, width: int, replies: bool) -> Iterator[dict[str, Any]]:
    """Yield the fields of every frame in ``data``; the end of ``data`` ends the stream."""
    offset = 0
    if replies:
        reply_decoder = wire.ReplyDecoder(extensions=True)  # a debugging tool accepts them all
        reply_decoder.receive_data(data)
        reply_decoder.receive_data(b"")
        while (reply := reply_decoder.next_reply()) is not END_OF_STREAM:
            assert reply is not NEED_DATA  # the stream is closed: never NEED_DATA
            if isinstance(reply, (ErrorFrame, TimingsFrame, IdentityFrame, SamplingAcceptedFrame, LogprobsFrame)):
                yield extension_to_fields(reply)
            else:
                assert isinstance(reply, StageReply)
                yield reply_to_fields(reply)
        return
    decoder = wire.MessageDecoder(width)
    decoder.receive_data(data)
    decoder.receive_data(b"")
    while (message := decoder.next_message()) is not END_OF_STREAM:
        assert isinstance(message, StageMessage)
        end = len(data) - decoder.buffered_bytes
        yield message_to_fields(message, data[offset:end])
        offset = end


def _json_values(text: str) -> Iterator[dict[str, Any]]:
    decoder = json.JSONDecoder()
    position = 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position >= len(text):
            return
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:  # report malformed JSON like any bad input
            raise WireError("input is not JSON", field="input", value=str(error)) from error
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict):
                raise WireError("expected a JSON object", field="input", value=type(item).__name__)
            yield item


def encode_frames(text: str, dtype_name: str | None, width: int | None,
                  replies: bool) -> Iterator[bytes]:
    """Yield the frame of every JSON value in ``text``."""
    for item in _json_values(text):
        fields = item.get("fields", item)
        if replies:
            if not _is_extension(fields):
                yield wire.encode_reply(reply_from_fields(fields))
                continue
            frame = extension_from_fields(fields)
            if isinstance(frame, IdentityFrame):
                yield wire.encode_identity(frame)
            elif isinstance(frame, ErrorFrame):
                yield wire.encode_error(frame)
            elif isinstance(frame, SamplingAcceptedFrame):
                yield wire.encode_sampling_accepted(frame)
            elif isinstance(frame, LogprobsFrame):
                yield wire.encode_logprobs(frame)
            else:
                yield wire.encode_timings(frame)
            continue
        name = dtype_name or item.get("wire_dtype")
        if name is not None:
            if name not in _DTYPES_BY_NAME:
                raise WireError("unknown activation wire dtype", field="dtype", value=name)
            dtype = _DTYPES_BY_NAME[name]
        else:
            dtype = WireDType(fields.get("state", {}).get("reserved", 0))
        frame_width = width if width is not None else item.get("activation_width")
        message = message_from_fields(fields, frame_width)
        yield wire.encode_message(message, dtype, frame_width)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m skippy.codec.wire``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m skippy.codec.wire", description=__doc__.split(
        "\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    decode = commands.add_parser("decode", help="frames in, one JSON object per frame out")
    decode.add_argument("--width", type=int, default=0, help="activation width (n_embd)")
    decode.add_argument("--replies", action="store_true", help="decode StageReply frames (and extension frames)")
    decode.add_argument("--hex", action="store_true", help="input is hex text")
    decode.add_argument("file", nargs="?", help="input file (default: stdin)")
    encode = commands.add_parser("encode", help="JSON objects in, frames out")
    encode.add_argument("--dtype", choices=sorted(_DTYPES_BY_NAME), help="activation wire dtype")
    encode.add_argument("--width", type=int, help="activation width (n_embd)")
    encode.add_argument("--replies", action="store_true", help="encode StageReply frames (and extension frames)")
    encode.add_argument("--hex", action="store_true", help="write one hex line per frame")
    encode.add_argument("file", nargs="?", help="input file (default: stdin)")
    arguments = parser.parse_args(argv)
    try:
        if arguments.command == "decode":
            data = _read_input(arguments.file, arguments.hex)
            for fields in decode_frames(data, arguments.width, arguments.replies):
                sys.stdout.write(json.dumps(fields) + "\n")
                sys.stdout.flush()
        else:
            text = _read_input(arguments.file, False).decode("utf-8")
            for frame in encode_frames(text, arguments.dtype, arguments.width,
                                       arguments.replies):
                if arguments.hex:
                    sys.stdout.write(frame.hex() + "\n")
                    sys.stdout.flush()
                else:
                    sys.stdout.buffer.write(frame)
                    sys.stdout.buffer.flush()
    except (WireError, UnicodeDecodeError, TypeError, ValueError) as error:
        # Malformed input of any kind is reported, never a traceback: status 2.
        print(f"skippy.codec.wire: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return 0
