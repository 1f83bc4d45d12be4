"""Skippy's negotiated extensions to the v11 stage protocol: wire values, frame types, limits.

Strategy
--------
v11 (``../shared/reference/protocol.md``) has no error frame and no per-stage timings. This module
is the vocabulary of the two extension reply frames skippy adds, and of the state-flag bit that
negotiates them; the layouts, limits and relay rules are in ``docs/protocol.md`` ("Extensions"),
which every ``#:`` comment below cites as ``ext §N``. Like :mod:`skippy.codec.protocol` it never reads or
writes bytes (the codec in :mod:`skippy.codec.wire` does) and never does I/O.

Negotiation is one-sided and per connection. A sender that understands the extensions sets
:data:`SKIPPY_EXTENSIONS_FLAG` in ``state.flags`` of every message it sends; a plain v11 peer
ignores the bit (protocol.md §2.4) and answers in v11. A receiver that saw the bit on a
connection *may* answer on that connection with :class:`ErrorFrame` and :class:`TimingsFrame`
frames; one that never saw it must not (:class:`ExtensionNegotiation` keeps that state). The
extension reply kinds lie outside v11's reply-kind range, so a reply decoder that was not told
to accept them (the default) rejects them exactly as v11 does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Final, final

from skippy.codec.protocol import MessageKind, StageMessage, StateHeader

__all__ = [
    "DECODE_RUN_FEATURE",
    "DECODE_RUN_FLAG",
    "DECODE_RUN_METADATA_KEY",
    "DIRECT_RETURN_FLAG",
    "ERROR_FRAME_BASE_BYTES",
    "MAX_ERROR_ADDRESS_BYTES",
    "MAX_ERROR_MESSAGE_BYTES",
    "MAX_ERROR_FRAME_BYTES",
    "MAX_TIMING_RECORDS",
    "PREFIX_EXTENT_FLAG",
    "REPLAY_FLAG",
    "RESUME_METADATA_KEY",
    "SKIPPY_EXTENSIONS_FLAG",
    "TIMING_RECORD_BYTES",
    "ErrorCode",
    "ExtensionNegotiation",
    "ExtensionReplyKind",
    "ErrorFrame",
    "IDENTITY_FRAME_BASE_BYTES",
    "IdentityFrame",
    "LIVENESS_FLAG",
    "MAX_IDENTITY_NAME_BYTES",
    "MODEL_IDENTITY_FLAG",
    "TimingsFrame",
    "TimingRecord",
    "LOGPROBS_FEATURE",
    "GRAMMAR_FEATURE",
    "MAX_LOGPROB_ROWS",
    "MAX_TOP_LOGPROBS",
    "SAMPLING_EXTENSION_FLAG",
    "SAMPLING_METADATA_KEY",
    "Annotation",
    "LogprobsFrame",
    "SamplingAcceptedFrame",
    "SamplingRequest",
    "TokenLogprobs",
    "append_timing",
    "identity_query",
    "is_identity_query",
    "is_liveness_query",
    "liveness_query",
    "requests_direct_return",
    "requests_extensions",
    "with_direct_return_flag",
    "with_extensions_flag",
]

#: ext §1: state flag bit 10, "skippy extensions v1" (error and timings reply frames).
SKIPPY_EXTENSIONS_FLAG: Final = 1 << 10
#: docs/protocol.md §8: state flag bit 11, "direct return".  On a PredictionReturnOpen: the sender
#: is a skippy driver opening a return lane for (request_id, session_id).  On a message of a kind
#: whose rule allows it: its prediction goes over that return lane, not back up the chain.
DIRECT_RETURN_FLAG: Final = 1 << 11
#: docs/prefix-cache.md §6: bit 9, the prefix-cache extension. Reserved here so nothing collides.
PREFIX_EXTENT_FLAG: Final = 1 << 9
#: docs/protocol.md §9: state flag bit 12, "model identity".  On a lane's first message, a
#: PredictionReturnOpen without bit 11: "send me your Identity frame" (the lane then closes).  On
#: any other message: the sender also understands ``ErrorCode.MODEL_MISMATCH``.
MODEL_IDENTITY_FLAG: Final = 1 << 12
#: docs/protocol.md §10: state flag bit 13, "sampling extension".  On a ConfigureGeneration: its chat
#: metadata carries the session's grammar / logprobs request under :data:`SAMPLING_METADATA_KEY`.
SAMPLING_EXTENSION_FLAG: Final = 1 << 13
#: docs/protocol.md §11: state flag bit 14, "decode run".  On a DecodeEmbd sent to the first stage:
#: the stage drives the session's decode loop itself, feeding each predicted token to the next
#: step, for at most the run's ``max_tokens`` predictions or until a stop token; its chat metadata
#: carries the run under :data:`DECODE_RUN_METADATA_KEY`.
DECODE_RUN_FLAG: Final = 1 << 14
#: docs/protocol.md §13: state flag bit 24, "liveness".  On a PredictionReturnOpen without bits 11
#: and 12 as a lane's first message: the lane is a heartbeat lane; the stage answers that message
#: and each later one like it with a v11 Ack, from its event loop, and the lane carries nothing else.
LIVENESS_FLAG: Final = 1 << 24
#: docs/protocol.md §14: state flag bit 22, "replay".  On a non-final PrefillEmbd of a resumed session:
#: a stage that still holds the frame's positions (its KV) answers it from its activation log (or,
#: without one, recomputes them) instead of extending the session; a fresh stage computes it.
#: (Not bit 16: bits 16..21 are the boundary rows' count when bit 15 is set.)
REPLAY_FLAG: Final = 1 << 22
#: docs/protocol.md §14: the chat-metadata key of a resume (a ConfigureGeneration after a lost stage).
RESUME_METADATA_KEY: Final = "skippy.resume"
#: docs/protocol.md §11: the chat-metadata key of a decode run.
DECODE_RUN_METADATA_KEY: Final = "skippy.decode_run"
#: docs/protocol.md §10: the chat-metadata key of the sampling extension.
SAMPLING_METADATA_KEY: Final = "skippy.sampling"
#: docs/protocol.md §10: SamplingAccepted feature bits.
GRAMMAR_FEATURE: Final = 1 << 0
LOGPROBS_FEATURE: Final = 1 << 1
#: docs/protocol.md §11: on the first reply of a decode run, the first stage runs it.
DECODE_RUN_FEATURE: Final = 1 << 2
#: docs/protocol.md §10: most positions in one Logprobs frame (a verify window's rows at most).
MAX_LOGPROB_ROWS: Final = 4096
#: docs/protocol.md §10: most alternatives per position (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS: Final = 20

#: ext §2: longest ``origin_address`` in UTF-8 bytes ("host:port", a URL at most).
MAX_ERROR_ADDRESS_BYTES: Final = 256
#: ext §2: longest ``message`` in UTF-8 bytes; senders truncate at a character boundary.
MAX_ERROR_MESSAGE_BYTES: Final = 4096
#: ext §2: kind, code, origin_stage_index, reporter_stage_index and the two u32 lengths.
ERROR_FRAME_BASE_BYTES: Final = 24
#: ext §2: the largest legal error frame.
MAX_ERROR_FRAME_BYTES: Final = (
    ERROR_FRAME_BASE_BYTES + MAX_ERROR_ADDRESS_BYTES + MAX_ERROR_MESSAGE_BYTES
)
#: ext §3: most records in one timings frame (one per stage; stage masks stop at 63 too).
MAX_TIMING_RECORDS: Final = 64
#: ext §3: four i32 then four i64.
TIMING_RECORD_BYTES: Final = 48
#: §9: kind, five i32 figures, the 32-byte digest and the u32 name length.
IDENTITY_FRAME_BASE_BYTES: Final = 60
#: §9: longest model file name in UTF-8 bytes.
MAX_IDENTITY_NAME_BYTES: Final = 256


class ExtensionReplyKind(IntEnum):
    """Reply-kind codes of the extension frames (ext §1); v11 uses only 1..3."""

    ERROR = 0x5E00  #: ext §2: the lane is closing; relayed upstream unchanged.
    TIMINGS = 0x5E01  #: ext §3: per-stage timings of the reply frame that follows.
    IDENTITY = 0x5E02  #: §9: the stage's model identity, answering an identity query.
    SAMPLING_ACCEPTED = 0x5E03  #: §10: the final stage installed a session's sampling extension.
    LOGPROBS = 0x5E04  #: §10: log-probabilities of the predicted reply that follows.


class ErrorCode(IntEnum):
    """Why a lane was closed (ext §2). Codes are never reused; new ones need a new flag bit."""

    DOWNSTREAM_LOST = 1  #: ext §2: the downstream connection closed, reset or timed out.
    MALFORMED_FRAME = 2  #: ext §2: a frame from upstream raised WireError.
    RUNTIME_ERROR = 3  #: ext §2: the runtime failed to execute the message.
    UNSUPPORTED_KIND = 4  #: ext §2: a valid kind this stage does not serve (StateImport ...).
    STATE_MISMATCH = 5  #: ext §2: the state header does not match the kind (§3.1 matches_kind).
    OVERLOADED = 6  #: ext §2: no lane, session or KV capacity for the request.
    SHUTTING_DOWN = 7  #: ext §2: the stage is draining (SIGTERM).
    INTERNAL = 8  #: ext §2: any other failure inside the stage.
    #: §9 (bit 12): the downstream stage serves another model file, a range that does not
    #: continue this one, or other context settings.  Sent only to an upstream flagging bit 12.
    MODEL_MISMATCH = 9


@final
@dataclass(frozen=True, slots=True)
class ErrorFrame:
    """Error frame (ext §2): sent upstream just before a stage closes a lane.

    ``origin_*`` name the stage the error is *about*: for ``DOWNSTREAM_LOST`` the lost stage
    (as far as the reporter knows it), otherwise the stage where it happened. ``reporter_stage_index``
    is the stage that wrote the frame. -1 means unknown (or the driver).
    """

    code: ErrorCode
    origin_stage_index: int
    reporter_stage_index: int
    origin_address: str = ""
    message: str = ""

    def describe(self) -> str:
        """One line for logs and client exceptions, naming the stage."""
        where = f"stage {self.origin_stage_index}" if self.origin_stage_index >= 0 else "stage ?"
        if self.origin_address:
            where += f" ({self.origin_address})"
        reporter = ""
        if self.reporter_stage_index != self.origin_stage_index:
            reporter = f", reported by stage {self.reporter_stage_index}"
        return f"{ErrorCode(self.code).name.lower()} at {where}{reporter}: {self.message}"


@final
@dataclass(frozen=True, slots=True)
class TimingRecord:
    """One stage's timings for one reply (ext §3). Durations are microseconds, all >= 0."""

    stage_index: int
    layer_start: int
    layer_end: int
    batch_size: int = 0  #: decode items in the llama batch that computed this message.
    compute_us: int = 0
    forward_write_us: int = 0  #: writing the activation downstream.
    downstream_wait_us: int = 0  #: from the downstream write to its reply.
    queue_wait_us: int = 0  #: from receipt to the scheduler starting the work.


@final
@dataclass(frozen=True, slots=True)
class TimingsFrame:
    """Timings frame (ext §3): annotates the next v11 reply frame on the same connection.

    Records are in the order stages appended them: the deepest stage first, stage 0 last.
    """

    records: tuple[TimingRecord, ...] = ()


@final
@dataclass(frozen=True, slots=True)
class IdentityFrame:
    """Identity frame (docs/protocol.md §9): what model a stage serves, and how.

    ``digest`` is the sha256 of the GGUF file's header (metadata and tensor index, not the
    weights); ``model_name`` its file name, for messages only.
    """

    layer_start: int
    layer_end: int
    layer_count: int
    ctx_size: int
    batch_size: int
    digest: bytes
    model_name: str = ""

    def describe(self) -> str:
        """``NAME (sha256 1234abcd…) layers A:B of N, ctx C, batch B``."""
        return (f"{self.model_name or '?'} (header sha256 {self.digest.hex()[:12]}) layers "
                f"{self.layer_start}:{self.layer_end} of {self.layer_count}, ctx {self.ctx_size}, "
                f"batch {self.batch_size}")

    def mismatch(self, downstream: "IdentityFrame") -> str | None:
        """Why ``downstream`` cannot follow this stage in a chain (None: it can)."""
        if downstream.digest != self.digest:
            return "the model files differ"
        if downstream.layer_start != self.layer_end:
            return f"its layers start at {downstream.layer_start}, not at {self.layer_end}"
        if (downstream.ctx_size, downstream.batch_size) != (self.ctx_size, self.batch_size):
            return "the context settings (ctx, batch) differ"
        return None


def identity_query(request_id: int = 0) -> StageMessage:
    """The identity query (§9): a flagged PredictionReturnOpen, a lane's only message."""
    message = StageMessage.create(MessageKind.PREDICTION_RETURN_OPEN, request_id=request_id, session_id=0)
    return replace(message, state=replace(
        message.state, flags=message.state.flags | SKIPPY_EXTENSIONS_FLAG | MODEL_IDENTITY_FLAG))


def is_identity_query(message: StageMessage) -> bool:
    """Whether ``message`` asks for the Identity frame (§9): kind 20 with bit 12, without bit 11."""
    flags = message.state.flags
    return (message.kind is MessageKind.PREDICTION_RETURN_OPEN and bool(flags & MODEL_IDENTITY_FLAG)
            and not flags & DIRECT_RETURN_FLAG)


def liveness_query(request_id: int = 0) -> StageMessage:
    """A heartbeat (§13): a PredictionReturnOpen flagged ``SKIPPY_EXTENSIONS | LIVENESS``."""
    message = StageMessage.create(MessageKind.PREDICTION_RETURN_OPEN, request_id=request_id, session_id=0)
    return replace(message, state=replace(message.state, flags=message.state.flags | SKIPPY_EXTENSIONS_FLAG
                                          | LIVENESS_FLAG))


def is_liveness_query(message: StageMessage) -> bool:
    """Whether ``message`` is a heartbeat (§13): kind 20 with bit 24, without bits 11 and 12."""
    flags = message.state.flags
    return (message.kind is MessageKind.PREDICTION_RETURN_OPEN and bool(flags & LIVENESS_FLAG)
            and not flags & (DIRECT_RETURN_FLAG | MODEL_IDENTITY_FLAG))


@final
@dataclass(frozen=True, slots=True)
class SamplingAcceptedFrame:
    """SamplingAccepted frame (docs/protocol.md §10): precedes the ACK of a ConfigureGeneration
    whose sampling extension the final stage installed; relayed upstream unchanged.

    ``features``: :data:`GRAMMAR_FEATURE` | :data:`LOGPROBS_FEATURE`, the parts installed.
    """

    features: int


@final
@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One predicted position: the token, its log-probability under the model (the log-softmax of
    the final stage's logits row, before any sampling transform) and the ``top`` alternatives
    (token, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@final
@dataclass(frozen=True, slots=True)
class LogprobsFrame:
    """Logprobs frame (docs/protocol.md §10): one entry per predicted token of the reply that
    follows on the same connection (PredictedToken: 1; PredictedTokens: one per token), each with
    ``top_count`` alternatives; relayed upstream unchanged."""

    top_count: int
    rows: tuple[TokenLogprobs, ...] = ()


@final
@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """A session's sampling extension (docs/protocol.md §10), carried in ConfigureGeneration's chat
    metadata as ``{"skippy.sampling": {"grammar": ..., "grammar_root": ..., "logprobs": ...}}``.

    ``grammar``: GBNF text the final stage samples under (None: unconstrained); ``logprobs``: the
    number of alternatives per position to report (0: the sampled token's only; None: no report).
    """

    grammar: str | None = None
    grammar_root: str = "root"
    logprobs: int | None = None

    @property
    def features(self) -> int:
        """The SamplingAccepted feature bits this request asks for."""
        return (GRAMMAR_FEATURE if self.grammar is not None else 0) | (
            LOGPROBS_FEATURE if self.logprobs is not None else 0)

    def section(self) -> dict[str, object]:
        """The JSON object that goes under :data:`SAMPLING_METADATA_KEY`."""
        return {"grammar": self.grammar, "grammar_root": self.grammar_root, "logprobs": self.logprobs}

    @classmethod
    def from_section(cls, section: object) -> "SamplingRequest":
        """Parse the metadata section (hostile input: every field is checked).

        Raises:
            ValueError: not an object, or a field of the wrong type or out of range (named).
        """
        if not isinstance(section, dict):
            raise ValueError(f"{SAMPLING_METADATA_KEY} must be an object")
        grammar = section.get("grammar")
        root = section.get("grammar_root", "root")
        logprobs = section.get("logprobs")
        if grammar is not None and not isinstance(grammar, str):
            raise ValueError(f"{SAMPLING_METADATA_KEY}.grammar must be a string or null")
        if not isinstance(root, str) or not root:
            raise ValueError(f"{SAMPLING_METADATA_KEY}.grammar_root must be a non-empty string")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"{SAMPLING_METADATA_KEY}.logprobs must be null or an integer in 0..{MAX_TOP_LOGPROBS}")
        return cls(grammar, root, logprobs)


#: Extension frames a stage relays upstream unchanged, before the reply they precede.
Annotation = SamplingAcceptedFrame | LogprobsFrame


def append_timing(timings: TimingsFrame | None, record: TimingRecord) -> TimingsFrame:
    """The relay step of ext §3: ``timings`` from downstream (or None) plus this stage's record."""
    previous = () if timings is None else timings.records
    return TimingsFrame((*previous, record))


def requests_extensions(flags: int) -> bool:
    """True when ``state.flags`` carries the extension bit (ext §1)."""
    return bool(flags & SKIPPY_EXTENSIONS_FLAG)


def requests_direct_return(flags: int) -> bool:
    """True when ``state.flags`` carries the direct-return bit (docs/protocol.md §8)."""
    return bool(flags & DIRECT_RETURN_FLAG)


def with_direct_return_flag(message: StageMessage) -> StageMessage:
    """``message`` with the direct-return bit set (docs/protocol.md §8: the driver's side)."""
    state = message.state
    if state.flags & DIRECT_RETURN_FLAG:
        return message
    return replace(message, state=replace(state, flags=state.flags | DIRECT_RETURN_FLAG))


def with_extensions_flag(message: StageMessage) -> StageMessage:
    """``message`` with the extension bit set in its state flags (ext §1: what a sender does)."""
    state = message.state
    if state.flags & SKIPPY_EXTENSIONS_FLAG:
        return message
    new_state: StateHeader = replace(state, flags=state.flags | SKIPPY_EXTENSIONS_FLAG)
    return replace(message, state=new_state)


@final
class ExtensionNegotiation:
    """Receiver-side negotiation state of one upstream connection (ext §1).

    Call :meth:`observe` with every decoded message before answering it. ``enabled`` turns true
    at the first message carrying the bit and stays true for the connection's life; until then
    only v11 reply frames may be sent on it.
    """

    __slots__ = ("enabled",)

    def __init__(self) -> None:
        self.enabled = False

    def observe(self, message: StageMessage) -> bool:
        """Record ``message``'s flag; returns whether extension replies may now be sent."""
        if not self.enabled and message.state.flags & SKIPPY_EXTENSIONS_FLAG:
            self.enabled = True
        return self.enabled
