"""Skippy stage protocol, state version 11: wire values, frame types, predicates and limits.

Strategy
--------
This module is the vocabulary of the binary data plane and nothing else: it never reads or writes
bytes (that is :mod:`skippy.codec.wire`) and it never imports trio or socket (convention 1). Everything
here mirrors ``../shared/reference/protocol.md``; each wire value carries a ``#:`` comment citing
the section it comes from.

* Wire codes are ``IntEnum`` members, so they compare equal to the raw integers the codec reads.
  Header fields that the reader does *not* validate (``phase``, ``flags``) stay plain ``int`` in
  :class:`StateHeader`, because a v11 peer may legally send values we have no member for.
* Frames are frozen, slotted dataclasses. :class:`StageMessage` holds numpy arrays (token and
  position sidebands as int32, the activation as float32 ``(rows, width)``), so it defines its own
  ``__eq__`` and is unhashable.
* :class:`WireError` is the codec's single exception type. Its text starts with the reference's
  exact error string and then names the field, the offending value and the limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "ACTIVATIONLESS_PREFIX_CACHE_KINDS",
    "END_OF_STREAM",
    "MAX_STAGE_ACTIVATION_BYTES",
    "MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES",
    "MAX_STAGE_DECODED_ACTIVATION_BYTES",
    "MAX_STAGE_LOGIT_BIAS",
    "MAX_STAGE_PREDICTED_TOKENS",
    "MAX_STAGE_SIDEBAND_VALUES",
    "MAX_STAGE_STATE_IMPORT_BYTES",
    "NEED_DATA",
    "READY_BYTES",
    "READY_MAGIC",
    "STAGE_STATE_VERSION",
    "LogitBias",
    "MessageKind",
    "NativeMtpDraft",
    "Phase",
    "ReplyKind",
    "ReplyStats",
    "SamplingConfig",
    "StageMessage",
    "StageReply",
    "StateFlag",
    "StateHeader",
    "WireDType",
    "WireError",
    "activation_row_multiplier",
    "boundary_rows_flags",
    "BOUNDARY_ROWS_BITS",
    "BOUNDARY_ROWS_FLAG",
    "BOUNDARY_ROWS_SHIFT",
    "MAX_BOUNDARY_ROWS",
    "check_ready",
    "expected_phase",
]

# --------------------------------------------------------------------------------------------
# Limits (protocol.md §2.9)
# --------------------------------------------------------------------------------------------

#: §2.3: the only accepted ``StageStateHeader.version``.
STAGE_STATE_VERSION: Final = 11
#: §2.5: logit biases per sampling section (the reader rejects more, the writer truncates).
MAX_STAGE_LOGIT_BIAS: Final = 256
#: §5.1: reply token vectors and native MTP drafts.
MAX_STAGE_PREDICTED_TOKENS: Final = 262_144
#: §2.7: each of the token and position sidebands.
MAX_STAGE_SIDEBAND_VALUES: Final = 1_048_576
#: §2.5: chat sampling metadata bytes.
MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES: Final = 8 * 1024 * 1024
#: §2.7: StateImport raw bytes.
MAX_STAGE_STATE_IMPORT_BYTES: Final = 512 * 1024 * 1024
#: §2.6: activation bytes as they travel on the wire.
MAX_STAGE_ACTIVATION_BYTES: Final = 512 * 1024 * 1024
#: §2.6: activation bytes once decoded to f32 (decompression-bomb guard).
MAX_STAGE_DECODED_ACTIVATION_BYTES: Final = 512 * 1024 * 1024
#: §2.2: kind .. session_id.
STAGE_WIRE_FIXED_HEADER_BYTES: Final = 76
#: §2.3: ten i32 fields.
STAGE_STATE_HEADER_BYTES: Final = 40
#: §2.5: the ten scalar sampling fields (the u32 logit-bias count comes on top).
STAGE_SAMPLING_CONFIG_BASE_BYTES: Final = 40
#: §2.5: one (i32 token_id, f32 bias) pair.
STAGE_LOGIT_BIAS_WIRE_BYTES: Final = 8
#: §5.3: 23 i64 stats.
STAGE_REPLY_STATS_BYTES: Final = 23 * 8
#: §1: READY handshake magic, an i32 sent little-endian.
READY_MAGIC: Final = 0x53524459
#: §1: the four READY bytes as they appear on the wire ("YDRS").
READY_BYTES: Final = READY_MAGIC.to_bytes(4, "little")

#: Largest legal message frame (any width): header, full sampling section, maximal metadata,
#: both sidebands full, then the larger of the activation and StateImport payloads.
MAX_MESSAGE_FRAME_BYTES: Final = (
    STAGE_WIRE_FIXED_HEADER_BYTES
    + STAGE_SAMPLING_CONFIG_BASE_BYTES
    + 4
    + MAX_STAGE_LOGIT_BIAS * STAGE_LOGIT_BIAS_WIRE_BYTES
    + 4
    + MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES
    + 2 * 4 * MAX_STAGE_SIDEBAND_VALUES
    + max(MAX_STAGE_ACTIVATION_BYTES, MAX_STAGE_STATE_IMPORT_BYTES)
)
#: Largest legal reply frame: both token vectors full.
MAX_REPLY_FRAME_BYTES: Final = (
    12 + 4 * MAX_STAGE_PREDICTED_TOKENS + 8 + 4 + 4 * MAX_STAGE_PREDICTED_TOKENS + 8
    + STAGE_REPLY_STATS_BYTES
)


# --------------------------------------------------------------------------------------------
# Errors and sentinels
# --------------------------------------------------------------------------------------------


@final
class WireError(ValueError):
    """Malformed input to the codec, on either side of the wire.

    ``reason`` is the reference implementation's exact error text (``protocol.md`` §2.8, §5.1), so
    logs from a Rust peer and from skippy read the same. The full message adds the field, its
    value and the limit it broke. ``end_of_stream`` marks truncation (the reference's
    ``UnexpectedEof``); everything else is invalid data or, for writers, invalid input. Any
    WireError on the receive path desynchronises the stream: close the connection.
    """

    def __init__(
        self,
        reason: str,
        *,
        field: str | None = None,
        value: object = None,
        limit: object = None,
        end_of_stream: bool = False,
    ) -> None:
        detail = []
        if field is not None:
            detail.append(f"{field}={value!r}" if value is not None else field)
        if limit is not None:
            detail.append(f"limit {limit}")
        message = reason if not detail else f"{reason} ({', '.join(detail)})"
        super().__init__(message)
        self.reason = reason
        self.field = field
        self.value = value
        self.limit = limit
        self.end_of_stream = end_of_stream


class _SentinelType(type):
    def __repr__(cls) -> str:
        return cls.__name__


class NEED_DATA(metaclass=_SentinelType):
    """Returned by a decoder when the buffered bytes do not yet hold a whole frame."""


class END_OF_STREAM(metaclass=_SentinelType):
    """Returned by a decoder after ``receive_data(b"")`` once every buffered frame was taken."""


def check_ready(data: bytes) -> None:
    """Validate the 4-byte READY handshake (``protocol.md`` §1).

    Raises:
        WireError: ``stage ready magic mismatch``, or end of stream when fewer than 4 bytes came.
    """
    if len(data) < 4:
        raise WireError(
            "failed to fill whole buffer", field="ready", value=len(data), limit=4,
            end_of_stream=True,
        )
    if bytes(data[:4]) != READY_BYTES:
        raise WireError(
            "stage ready magic mismatch", field="ready", value=bytes(data[:4]).hex(),
            limit=READY_BYTES.hex(),
        )


# --------------------------------------------------------------------------------------------
# Wire enums
# --------------------------------------------------------------------------------------------


def _reference_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


class MessageKind(IntEnum):
    """``WireMessageKind`` (protocol.md §3). 10, 11 and 12 are retired and rejected."""

    PREFILL_EMBD = 1  #: §3: prefill chunk; ACKed (non-final chunks early).
    DECODE_EMBD = 2  #: §3: one decode token; pos_start is authoritative.
    STOP = 3  #: §3: header only; ends the session.
    PREFILL_FINAL_EMBD = 4  #: §3: last prefill chunk, FINAL_CHUNK set.
    DECODE_REPLAY_EMBD = 5  #: §3: replay decode, no prediction.
    DECODE_REPLAY_FINAL_EMBD = 6  #: §3: final replay step, FINAL_CHUNK set.
    STATE_IMPORT = 7  #: §3: token_count raw state bytes follow.
    DECODE_READOUT = 8  #: §3: decode with readout.
    DECODE_LIGHT_CTX = 9  #: §3: light-context decode, LIGHT_CONTEXT set.
    STATE_EXPORT = 13  #: §3: request a state export.
    CONFIGURE_GENERATION = 14  #: §3: sampling + chat metadata for a request.
    PROBE_PREFILL = 15  #: §3: prefix-cache probe, never an activation.
    RESTORE_PREFILL = 16  #: §3: prefix-cache restore, never an activation.
    TRY_RESTORE_PREFILL = 17  #: §3: prefix-cache try-restore, never an activation.
    TRY_RESTORE_PREFILL_DECODE = 18  #: §3: try-restore then decode (own reply path).
    TRIM_SESSION = 19  #: §3: token_count = new session length.
    PREDICTION_RETURN_OPEN = 20  #: §5.6: opens a direct prediction-return channel.
    VERIFY_WINDOW = 21  #: §5.2: speculative window; seq_id = window id.
    RETIRE_VERIFY_WINDOW = 22  #: §5.2: release verify checkpoints; no reply.

    @property
    def reference_name(self) -> str:
        """The Rust variant name used by the wire vectors (``PrefillEmbd``)."""
        return _reference_name(self.name)

    @property
    def is_prefill(self) -> bool:
        return self in _PREFILL_KINDS

    @property
    def is_decode_replay(self) -> bool:
        return self in _DECODE_REPLAY_KINDS

    @property
    def is_decode_light_context(self) -> bool:
        return self is MessageKind.DECODE_LIGHT_CTX

    @property
    def requires_predicted_reply(self) -> bool:
        """Kinds answered with PredictedToken(s); 18 is answered on its own path (§3.1)."""
        return self in _PREDICTED_REPLY_KINDS

    @property
    def is_session_control(self) -> bool:
        return self is MessageKind.TRIM_SESSION

    @property
    def is_verify_retirement(self) -> bool:
        return self is MessageKind.RETIRE_VERIFY_WINDOW

    @property
    def is_generation_control(self) -> bool:
        return self is MessageKind.CONFIGURE_GENERATION

    @property
    def is_prefix_cache_control(self) -> bool:
        return self in _PREFIX_CACHE_KINDS

    @property
    def is_activationless_prefix_cache_control(self) -> bool:
        return self in ACTIVATIONLESS_PREFIX_CACHE_KINDS

    @property
    def carries_authoritative_position(self) -> bool:
        """pos_start is the committed position a stage must hold before executing (§3.2)."""
        return self in _AUTHORITATIVE_POSITION_KINDS


_PREFILL_KINDS: Final = frozenset({MessageKind.PREFILL_EMBD, MessageKind.PREFILL_FINAL_EMBD})
_DECODE_REPLAY_KINDS: Final = frozenset(
    {MessageKind.DECODE_REPLAY_EMBD, MessageKind.DECODE_REPLAY_FINAL_EMBD}
)
_PREDICTED_REPLY_KINDS: Final = frozenset(
    {
        MessageKind.DECODE_EMBD,
        MessageKind.DECODE_READOUT,
        MessageKind.DECODE_LIGHT_CTX,
        MessageKind.VERIFY_WINDOW,
        MessageKind.PREFILL_FINAL_EMBD,
        MessageKind.DECODE_REPLAY_FINAL_EMBD,
    }
)
_PREFIX_CACHE_KINDS: Final = frozenset(
    {
        MessageKind.PROBE_PREFILL,
        MessageKind.RESTORE_PREFILL,
        MessageKind.TRY_RESTORE_PREFILL,
        MessageKind.TRY_RESTORE_PREFILL_DECODE,
    }
)
#: §2.6: kinds that never carry an activation, whatever source_stage_index says.
ACTIVATIONLESS_PREFIX_CACHE_KINDS: Final = frozenset(
    {MessageKind.PROBE_PREFILL, MessageKind.RESTORE_PREFILL, MessageKind.TRY_RESTORE_PREFILL}
)
_AUTHORITATIVE_POSITION_KINDS: Final = frozenset(
    {
        MessageKind.DECODE_EMBD,
        MessageKind.DECODE_READOUT,
        MessageKind.DECODE_LIGHT_CTX,
        MessageKind.VERIFY_WINDOW,
    }
)
_FINAL_CHUNK_KINDS: Final = frozenset(
    {MessageKind.PREFILL_FINAL_EMBD, MessageKind.DECODE_REPLAY_FINAL_EMBD}
)
_UNCHECKED_KINDS: Final = frozenset(
    {
        MessageKind.STATE_IMPORT,
        MessageKind.STATE_EXPORT,
        MessageKind.TRIM_SESSION,
        MessageKind.RETIRE_VERIFY_WINDOW,
        MessageKind.CONFIGURE_GENERATION,
    }
)


class Phase(IntEnum):
    """``WireStagePhase`` (protocol.md §2.3); the reader does not validate it."""

    PREFILL = 1  #: §2.3
    DECODE = 2  #: §2.3
    DECODE_REPLAY = 3  #: §2.3
    DECODE_LIGHT = 4  #: §2.3

    @property
    def reference_name(self) -> str:
        return _reference_name(self.name)


class StateFlag(IntFlag):
    """``state.flags`` bits (protocol.md §2.4). Unknown bits are carried through untouched."""

    FINAL_CHUNK = 1 << 0  #: §2.4: last prefill chunk (kinds 4 and 6).
    LIGHT_CONTEXT = 1 << 1  #: §2.4: DecodeLightCtx only.
    SAMPLING = 1 << 3  #: §2.4: a sampling section follows; the writer derives it.
    FULL_STATE = 1 << 4  #: §2.4: not interpreted by the codec.
    CHAT_SAMPLING_METADATA = 1 << 5  #: §2.4: a metadata section follows; the writer derives it.
    RWKV7_V_FIRST_SIDEBAND = 1 << 6  #: §2.4: activation holds 2x rows.
    GEMMA3N_ALTUP_SIDEBAND = 1 << 7  #: §2.4: activation holds 4x rows.
    INKLING_MTP_EMBD_SIDEBAND = 1 << 8  #: §2.4: activation holds 2x rows (new in v11).


class WireDType(IntEnum):
    """Activation wire dtype, stored in ``state.reserved`` (protocol.md §4.1)."""

    F32 = 0  #: §4.1: raw little-endian f32.
    F16 = 1  #: §4.1: IEEE binary16, ties rounded away from zero.
    Q8 = 2  #: §4.1: per-row f32 scales first, then int8 values.

    @property
    def reference_name(self) -> str:
        return self.name.lower()


class ReplyKind(IntEnum):
    """``StageReply`` kind (protocol.md §5.1)."""

    ACK = 1  #: §5.1: predicted 0, no tokens.
    PREDICTED_TOKEN = 2  #: §5.1: tokens default to [predicted].
    PREDICTED_TOKENS = 3  #: §5.1: predicted = tokens[0] or 0.

    @property
    def reference_name(self) -> str:
        return _reference_name(self.name)


_FINAL_CHUNK_BIT: Final = int(StateFlag.FINAL_CHUNK)
_LIGHT_CONTEXT_BIT: Final = int(StateFlag.LIGHT_CONTEXT)


def expected_phase(kind: MessageKind) -> Phase:
    """The phase ``StageStateHeader::new`` assigns to ``kind`` (protocol.md §3.1)."""
    if kind.is_decode_replay:
        return Phase.DECODE_REPLAY
    if kind is MessageKind.DECODE_LIGHT_CTX:
        return Phase.DECODE_LIGHT
    if kind in _PREFILL_KINDS or kind in _UNCHECKED_KINDS or kind in _PREFIX_CACHE_KINDS:
        return Phase.PREFILL
    return Phase.DECODE


#: docs/protocol.md §12 (a skippy extension, defined here because it sizes the activation): state
#: flag bit 15, "boundary rows".  With it, bits 16..21 hold the activation's rows per token ``k``
#: (2..:data:`MAX_BOUNDARY_ROWS`): a wide stage boundary of ``k x n_embd`` per token, part-major
#: on the wire as bits 6-8's rows are.  Legal only beside bit 10 (a negotiating sender) and
#: without bits 6-8; without bit 15, bits 16..21 mean nothing (v11: unknown bits carry through).
BOUNDARY_ROWS_FLAG: Final = 1 << 15
#: §12: the shift of the rows-per-token field.
BOUNDARY_ROWS_SHIFT: Final = 16
#: §12: the most rows per token a frame may announce (the field's six bits).
MAX_BOUNDARY_ROWS: Final = 63
#: §12: every bit of the extension (the flag and its field).
BOUNDARY_ROWS_BITS: Final = BOUNDARY_ROWS_FLAG | MAX_BOUNDARY_ROWS << BOUNDARY_ROWS_SHIFT


def boundary_rows_flags(rows: int) -> int:
    """The state flags announcing ``rows`` n_embd-wide parts per token (§12); 0 for one part.

    Raises:
        ValueError: ``rows`` outside 1..MAX_BOUNDARY_ROWS.
    """
    if not 1 <= rows <= MAX_BOUNDARY_ROWS:
        raise ValueError(f"a stage boundary of {rows} rows per token: the protocol announces 1..{MAX_BOUNDARY_ROWS}")
    return 0 if rows == 1 else BOUNDARY_ROWS_FLAG | rows << BOUNDARY_ROWS_SHIFT


def activation_row_multiplier(flags: int) -> int:
    """Rows per token implied by the sideband flags (protocol.md §2.6; Gemma wins), or by the
    boundary-rows extension (§12: its field, unvalidated here; the codec refuses a bad one)."""
    if flags & BOUNDARY_ROWS_FLAG:
        return flags >> BOUNDARY_ROWS_SHIFT & MAX_BOUNDARY_ROWS
    if flags & StateFlag.GEMMA3N_ALTUP_SIDEBAND:
        return 4
    if flags & (StateFlag.INKLING_MTP_EMBD_SIDEBAND | StateFlag.RWKV7_V_FIRST_SIDEBAND):
        return 2
    return 1


# --------------------------------------------------------------------------------------------
# Message types
# --------------------------------------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True)
class StateHeader:
    """``StageStateHeader``: the ten i32 fields at offset 20 (protocol.md §2.3)."""

    version: int = STAGE_STATE_VERSION
    seq_id: int = 0
    phase: int = Phase.PREFILL
    flags: int = 0
    checkpoint_generation: int = 0
    prompt_token_count: int = 0
    decode_step: int = -1
    current_token: int = -1
    source_stage_index: int = -1
    #: The activation wire dtype; the writer overwrites it with its ``wire_dtype`` argument.
    reserved: int = WireDType.F32

    @classmethod
    def for_kind(cls, kind: MessageKind, wire_dtype: WireDType = WireDType.F32) -> StateHeader:
        """The reference's ``StageStateHeader::new(kind, dtype)`` defaults."""
        flags = 0
        if kind in _FINAL_CHUNK_KINDS:
            flags = StateFlag.FINAL_CHUNK
        elif kind is MessageKind.DECODE_LIGHT_CTX:
            flags = StateFlag.LIGHT_CONTEXT
        return cls(phase=expected_phase(kind), flags=int(flags), reserved=int(wire_dtype))

    def matches_kind(self, kind: MessageKind) -> bool:
        """The server-side consistency check (protocol.md §3.1); the reader never calls it."""
        if kind in _UNCHECKED_KINDS:
            return True
        if self.phase != expected_phase(kind):
            return False
        flags = int(self.flags)  # plain ints: IntFlag arithmetic goes through enum machinery
        if bool(flags & _FINAL_CHUNK_BIT) != (kind in _FINAL_CHUNK_KINDS):
            return False
        return bool(flags & _LIGHT_CONTEXT_BIT) == (kind is MessageKind.DECODE_LIGHT_CTX)

    @property
    def activation_row_multiplier(self) -> int:
        return activation_row_multiplier(self.flags)


@final
@dataclass(frozen=True, slots=True)
class LogitBias:
    """One (token_id: i32, bias: f32) pair of the sampling section (protocol.md §2.5)."""

    token_id: int
    bias: float


@final
@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """The optional sampling section (protocol.md §2.5), present iff ``flags & SAMPLING``."""

    flags: int = 0
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    penalty_last_n: int = -1
    #: The writer sends at most MAX_STAGE_LOGIT_BIAS entries and drops the rest.
    logit_bias: tuple[LogitBias, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.flags != 0


Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]

_EMPTY_INT32: Final[Int32Array] = np.zeros(0, dtype=np.int32)
_EMPTY_INT32.flags.writeable = False


def _arrays_equal(left: Any, right: Any) -> bool:
    if left is None or right is None:
        return left is right
    a = np.asarray(left)
    b = np.asarray(right)
    if a.shape != b.shape and a.size == b.size == 0:
        return True
    return a.shape == b.shape and a.tobytes() == b.tobytes()


@final
@dataclass(frozen=True, slots=True, eq=False)
class StageMessage:
    """``StageWireMessage`` (protocol.md §2).

    ``tokens``/``positions`` are int32 arrays (decoded frames give read-only views of the frame
    bytes). ``activation`` is the float32 activation, shape ``(rows, width)`` with
    ``rows = token_count * state.activation_row_multiplier``, or None when the frame carries
    none (§2.6); the codec quantizes it to the wire dtype. ``raw_bytes`` is StateImport's payload.
    Equality compares arrays bitwise (so NaNs compare equal to themselves).
    """

    kind: MessageKind
    pos_start: int = 0
    token_count: int = 0
    state: StateHeader = field(default_factory=StateHeader)
    request_id: int = 0
    session_id: int = 0
    sampling: SamplingConfig | None = None
    chat_sampling_metadata: str | None = None
    tokens: Int32Array = field(default_factory=lambda: _EMPTY_INT32)
    positions: Int32Array = field(default_factory=lambda: _EMPTY_INT32)
    activation: Float32Array | None = None
    raw_bytes: bytes = b""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StageMessage):
            return NotImplemented
        return (
            self.kind == other.kind
            and self.pos_start == other.pos_start
            and self.token_count == other.token_count
            and self.state == other.state
            and self.request_id == other.request_id
            and self.session_id == other.session_id
            and self.sampling == other.sampling
            and self.chat_sampling_metadata == other.chat_sampling_metadata
            and _arrays_equal(self.tokens, other.tokens)
            and _arrays_equal(self.positions, other.positions)
            and _arrays_equal(self.activation, other.activation)
            and bytes(self.raw_bytes) == bytes(other.raw_bytes)
        )

    @classmethod
    def create(
        cls, kind: MessageKind, wire_dtype: WireDType = WireDType.F32, **changes: Any
    ) -> StageMessage:
        """A message of ``kind`` with the reference's default header, then ``changes``.

        ``state_changes`` (a dict) is applied to the default header.
        """
        state_changes = changes.pop("state_changes", {})
        state = dataclasses.replace(StateHeader.for_kind(kind, wire_dtype), **state_changes)
        return cls(kind=kind, state=state, **changes)

    @classmethod
    def stop(cls, wire_dtype: WireDType = WireDType.F32, request_id: int = 0,
             session_id: int = 0) -> StageMessage:
        """``stop`` / ``stop_with_identity`` (protocol.md §3.2)."""
        return cls.create(MessageKind.STOP, wire_dtype, request_id=request_id,
                          session_id=session_id)

    @property
    def wire_dtype(self) -> WireDType:
        """The dtype in ``state.reserved`` (validated by the decoder)."""
        return WireDType(self.state.reserved)

    @property
    def carries_activation(self) -> bool:
        """Whether the frame has an activation segment (protocol.md §2.6)."""
        return carries_activation(self.kind, self.state.source_stage_index)

    @property
    def authoritative_session_position(self) -> int | None:
        """pos_start for decode-like kinds when non-negative (protocol.md §3.2)."""
        if self.kind in _AUTHORITATIVE_POSITION_KINDS and self.pos_start >= 0:
            return self.pos_start
        return None

    @property
    def verify_window_id(self) -> int | None:
        return self.state.seq_id if self.kind is MessageKind.VERIFY_WINDOW else None

    @property
    def verify_window_base_position(self) -> int | None:
        return self.pos_start if self.kind is MessageKind.VERIFY_WINDOW else None

    @property
    def verify_window_token_count(self) -> int | None:
        return self.token_count if self.kind is MessageKind.VERIFY_WINDOW else None


def carries_activation(kind: int, source_stage_index: int) -> bool:
    """True iff a frame of ``kind`` from ``source_stage_index`` has activation bytes (§2.6)."""
    if kind == MessageKind.STOP or kind == MessageKind.STATE_IMPORT:
        return False
    if kind in ACTIVATIONLESS_PREFIX_CACHE_KINDS:
        return False
    return source_stage_index >= 0


# --------------------------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------------------------

_SUM_FIELDS: Final = (
    "kv_lookup_hits", "kv_lookup_misses", "kv_lookup_errors", "kv_imported_pages",
    "kv_imported_tokens", "kv_recorded_pages", "kv_recorded_bytes",
    "verify_window_compute_us", "verify_window_forward_write_us",
    "verify_window_downstream_wait_us", "verify_window_total_us", "verify_window_stage_count",
    "verify_window_request_count", "verify_window_token_count", "prefill_edge_observation_count",
)
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1


def _saturating(value: int) -> int:
    return max(_I64_MIN, min(_I64_MAX, value))


def _sum(left: int, right: int) -> int:
    """``left + right`` saturated to i64 (the comparison alone when it fits: the usual case)."""
    total = left + right
    if _I64_MIN <= total <= _I64_MAX:
        return total
    return _I64_MAX if total > 0 else _I64_MIN


@final
@dataclass(frozen=True, slots=True)
class ReplyStats:
    """``StageReplyStats``: 23 i64 fields in wire order (protocol.md §5.3)."""

    kv_lookup_hits: int = 0
    kv_lookup_misses: int = 0
    kv_lookup_errors: int = 0
    kv_imported_pages: int = 0
    kv_imported_tokens: int = 0
    kv_recorded_pages: int = 0
    kv_recorded_bytes: int = 0
    kv_hit_stage_mask: int = 0
    kv_record_stage_mask: int = 0
    verify_window_compute_us: int = 0
    verify_window_forward_write_us: int = 0
    verify_window_downstream_wait_us: int = 0
    verify_window_total_us: int = 0
    verify_window_stage_count: int = 0
    verify_window_request_count: int = 0
    verify_window_token_count: int = 0
    verify_window_max_tokens: int = 0
    prefill_edge_write_us_max: int = 0
    prefill_edge_wait_us_max: int = 0
    prefill_edge_total_us_max: int = 0
    prefill_edge_stage_index: int = 0
    prefill_edge_activation_bytes_max: int = 0
    prefill_edge_observation_count: int = 0

    def as_tuple(self) -> tuple[int, ...]:
        """The 23 values in wire order (a plain field tuple: no deep copy, on every encode)."""
        return (
            self.kv_lookup_hits, self.kv_lookup_misses, self.kv_lookup_errors,
            self.kv_imported_pages, self.kv_imported_tokens, self.kv_recorded_pages,
            self.kv_recorded_bytes, self.kv_hit_stage_mask, self.kv_record_stage_mask,
            self.verify_window_compute_us, self.verify_window_forward_write_us,
            self.verify_window_downstream_wait_us, self.verify_window_total_us,
            self.verify_window_stage_count, self.verify_window_request_count,
            self.verify_window_token_count, self.verify_window_max_tokens,
            self.prefill_edge_write_us_max, self.prefill_edge_wait_us_max,
            self.prefill_edge_total_us_max, self.prefill_edge_stage_index,
            self.prefill_edge_activation_bytes_max, self.prefill_edge_observation_count,
        )

    def is_empty(self) -> bool:
        """True when nothing was recorded; fields 17-21 are ignored, as in the reference."""
        values = self.as_tuple()
        return not any(values[:17]) and values[22] == 0

    def merge(self, other: ReplyStats) -> ReplyStats:
        """Combine a downstream reply's stats into ours (the §5.3 merge rules, saturating).

        Field by field into one constructor call (this runs once per relayed reply): sums for
        ``_SUM_FIELDS``, OR for the stage masks, max for the ``*_max`` fields, and the prefill
        edge triple taken from the side with the larger total (ties keep ours).
        """
        a, b = self, other
        if b.prefill_edge_total_us_max > a.prefill_edge_total_us_max:
            edge = b
        else:
            edge = a
        return ReplyStats(
            _sum(a.kv_lookup_hits, b.kv_lookup_hits),
            _sum(a.kv_lookup_misses, b.kv_lookup_misses),
            _sum(a.kv_lookup_errors, b.kv_lookup_errors),
            _sum(a.kv_imported_pages, b.kv_imported_pages),
            _sum(a.kv_imported_tokens, b.kv_imported_tokens),
            _sum(a.kv_recorded_pages, b.kv_recorded_pages),
            _sum(a.kv_recorded_bytes, b.kv_recorded_bytes),
            a.kv_hit_stage_mask | b.kv_hit_stage_mask,
            a.kv_record_stage_mask | b.kv_record_stage_mask,
            _sum(a.verify_window_compute_us, b.verify_window_compute_us),
            _sum(a.verify_window_forward_write_us, b.verify_window_forward_write_us),
            _sum(a.verify_window_downstream_wait_us, b.verify_window_downstream_wait_us),
            _sum(a.verify_window_total_us, b.verify_window_total_us),
            _sum(a.verify_window_stage_count, b.verify_window_stage_count),
            _sum(a.verify_window_request_count, b.verify_window_request_count),
            _sum(a.verify_window_token_count, b.verify_window_token_count),
            max(a.verify_window_max_tokens, b.verify_window_max_tokens),
            max(a.prefill_edge_write_us_max, b.prefill_edge_write_us_max),
            max(a.prefill_edge_wait_us_max, b.prefill_edge_wait_us_max),
            edge.prefill_edge_total_us_max,
            edge.prefill_edge_stage_index,
            edge.prefill_edge_activation_bytes_max,
            _sum(a.prefill_edge_observation_count, b.prefill_edge_observation_count),
        )

    def observe_prefill_edge_transport(
        self, stage_index: int, write_us: int, wait_us: int, activation_bytes: int
    ) -> ReplyStats:
        """Record one prefill edge transfer (``observe_prefill_edge_transport``, §5.3)."""
        write_us, wait_us = max(write_us, 0), max(wait_us, 0)
        activation_bytes = max(activation_bytes, 0)
        total = _saturating(write_us + wait_us)
        changes = {
            "prefill_edge_write_us_max": max(self.prefill_edge_write_us_max, write_us),
            "prefill_edge_wait_us_max": max(self.prefill_edge_wait_us_max, wait_us),
            "prefill_edge_observation_count": _saturating(self.prefill_edge_observation_count + 1),
        }
        if total > self.prefill_edge_total_us_max:
            changes["prefill_edge_total_us_max"] = total
            changes["prefill_edge_stage_index"] = stage_index
            changes["prefill_edge_activation_bytes_max"] = activation_bytes
        return dataclasses.replace(self, **changes)


REPLY_STATS_FIELDS: Final = tuple(f.name for f in dataclasses.fields(ReplyStats))
EMPTY_REPLY_STATS: Final = ReplyStats()


@final
@dataclass(frozen=True, slots=True)
class NativeMtpDraft:
    """A native MTP draft proposal carried beside the target prediction (protocol.md §5.1)."""

    token_ids: tuple[int, ...] = ()
    proposal_compute_us: int = 0


@final
@dataclass(frozen=True, slots=True)
class StageReply:
    """``StageReply`` (protocol.md §5.1). Replies carry no ids; they match messages by order."""

    kind: ReplyKind
    predicted: int = 0
    predicted_tokens: tuple[int, ...] = ()
    #: ``StageReplyWindow.window_id``: echoes a VerifyWindow's seq_id (§5.2).
    window_id: int = 0
    native_mtp_draft: NativeMtpDraft | None = None
    stats: ReplyStats = EMPTY_REPLY_STATS

    @classmethod
    def ack(cls, stats: ReplyStats = EMPTY_REPLY_STATS) -> StageReply:
        """``send_reply_ack[_with_stats]``."""
        return cls(ReplyKind.ACK, stats=stats)

    @classmethod
    def predicted_token(
        cls,
        predicted: int,
        tokens: tuple[int, ...] | None = None,
        *,
        window_id: int = 0,
        native_mtp_draft: NativeMtpDraft | None = None,
        stats: ReplyStats = EMPTY_REPLY_STATS,
    ) -> StageReply:
        """``send_reply_predicted*``: kind 2, tokens default to ``(predicted,)``."""
        return cls(
            ReplyKind.PREDICTED_TOKEN, predicted,
            (predicted,) if tokens is None else tuple(tokens), window_id, native_mtp_draft, stats,
        )

    @classmethod
    def predicted_token_vector(
        cls, tokens: tuple[int, ...], *, window_id: int = 0,
        stats: ReplyStats = EMPTY_REPLY_STATS,
    ) -> StageReply:
        """``send_reply_predicted_tokens*``: kind 3, predicted = tokens[0] or 0."""
        tokens = tuple(tokens)
        return cls(ReplyKind.PREDICTED_TOKENS, tokens[0] if tokens else 0, tokens, window_id,
                   None, stats)
