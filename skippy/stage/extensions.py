"""A stage's side of skippy's negotiated protocol extensions: Error and Timings frames.

Strategy (the rules are ``docs/protocol.md`` §2-§4; the frame types ``skippy.protocol_ext``):

* Negotiation is per upstream connection (:class:`~skippy.protocol_ext.ExtensionNegotiation`,
  fed every decoded message by the connection). Nothing here is sent on a lane that did not
  negotiate: :func:`reply_bytes` then gives the plain v11 reply and the connection sends no
  Error frame, so a plain v11 client sees v11 only.
* Stage index. The frames name stages by index. A stage infers its own from what arrives
  (:class:`StageIdentity`): a first stage (layer 0) is index 0; any other stage takes
  ``source_stage_index + 1`` of the first activation-bearing message on any of its lanes
  (a stage forwards with ``source_stage_index`` + 1, and the driver sends -1). Until then the
  index is -1 ("unknown", which the frames allow). No setting is needed and none can disagree
  with the chain actually built.
* Errors. Every refusal carries its own :class:`ErrorCode` (:mod:`skippy.lane.errors`; anything
  else is a bug: ``INTERNAL``, :func:`is_bug`); :func:`error_frame` builds the frame (origin =
  this stage, except ``DOWNSTREAM_LOST``, whose origin is the lost stage: index + 1 and the
  configured downstream address; a downstream Error frame is relayed unchanged).
* Timings. :func:`own_record` is this stage's record for one reply, every value clamped >= 0.
* Annotations (docs/protocol.md §10: SamplingAccepted, Logprobs). The final stage writes them
  before the reply they belong to; every other stage relays them unchanged, and only to an
  upstream that negotiated the extensions (a v11 upstream cannot have asked for them).
"""

from __future__ import annotations

import weakref
from typing import Any

from skippy.protocol import StageMessage, StageReply
from skippy.protocol_ext import (
    MAX_ERROR_ADDRESS_BYTES,
    MAX_ERROR_MESSAGE_BYTES,
    Annotation,
    ErrorCode,
    ErrorFrame,
    LogprobsFrame,
    SamplingAcceptedFrame,
    TimingRecord,
    TimingsFrame,
)
from skippy.lane.errors import DownstreamError, StageError, error_code
from skippy.stage.transport import codec

__all__ = [
    "StageIdentity", "error_frame", "identity_for", "is_bug", "own_record", "reply_bytes",
    "shutting_down_frame",
]

class StageIdentity:
    """This stage's index (inferred, see the module notes), layer range and listen address."""

    __slots__ = ("index", "layer_start", "layer_end")

    def __init__(self, is_first: bool, layer_start: int, layer_end: int) -> None:
        self.index = 0 if is_first else -1
        self.layer_start = layer_start
        self.layer_end = layer_end

    def observe(self, message: StageMessage) -> None:
        """Learn the index from an activation-bearing message (call until ``index >= 0``)."""
        source = message.state.source_stage_index
        if source >= 0 and message.activation is not None:
            self.index = source + 1


_identities: weakref.WeakKeyDictionary[Any, StageIdentity] = weakref.WeakKeyDictionary()


def identity_for(executor: Any) -> StageIdentity:
    """The one :class:`StageIdentity` of the stage that owns ``executor`` (shared by its lanes)."""
    identity = _identities.get(executor)
    if identity is None:
        layers = executor.model.layers
        identity = _identities[executor] = StageIdentity(bool(executor.is_first), int(layers.start), int(layers.end))
    return identity


def is_bug(exc: BaseException) -> bool:
    """Whether ``exc`` is a bug rather than a refusal: not a :class:`StageError` at all, or the
    bare base class (a broken invariant); the lane logs those with their traceback."""
    return not isinstance(exc, StageError) or type(exc) is StageError


def _cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` UTF-8 bytes at a character boundary."""
    data = text.encode("utf-8", "replace")  # lone surrogates cannot be encoded: replaced
    return data[:limit].decode("utf-8", "ignore")


def error_frame(exc: BaseException, reason: str, *, index: int, address: str,
                downstream_address: str) -> ErrorFrame:
    """The Error frame to send upstream before closing a lane because of ``exc``.

    Args:
        reason: the text for the frame (the connection's log reason).
        index: this stage's index (-1 when unknown).
        address: this stage's listen address; downstream_address: its configured downstream.
    """
    if isinstance(exc, DownstreamError):
        return exc.frame  # ext §3 relay rule: unchanged
    code = error_code(exc)
    if code is ErrorCode.DOWNSTREAM_LOST:
        origin, origin_address = (index + 1 if index >= 0 else -1), downstream_address
    else:
        origin, origin_address = index, address
    return ErrorFrame(code, origin, index, _cut(origin_address, MAX_ERROR_ADDRESS_BYTES),
                      _cut(reason, MAX_ERROR_MESSAGE_BYTES))


def shutting_down_frame(index: int, address: str) -> ErrorFrame:
    """The Error frame of a lane closed because the stage is draining (SIGTERM)."""
    return ErrorFrame(ErrorCode.SHUTTING_DOWN, index, index, _cut(address, MAX_ERROR_ADDRESS_BYTES),
                      "the stage is shutting down")


def own_record(identity: StageIdentity, *, batch_size: int, compute_us: int, write_us: int = 0,
               wait_us: int = 0, queue_us: int = 0) -> TimingRecord:
    """This stage's timing record for one reply (ext §4), every value clamped to >= 0."""
    return TimingRecord(
        max(identity.index, 0), identity.layer_start, identity.layer_end, max(batch_size, 0),
        max(compute_us, 0), max(write_us, 0), max(wait_us, 0), max(queue_us, 0),
    )


def prediction_frames(identity: StageIdentity, result: Any, queue_us: int, *, negotiated: bool
                      ) -> tuple[TimingsFrame | None, tuple[Annotation, ...]]:
    """What precedes the final stage's prediction of ``result`` (a WorkResult) on a lane that
    negotiated the extensions: its Timings frame (docs/protocol.md §4: the producing stage starts
    it) and its Logprobs frame (§10, when the session asked); (None, ()) on a v11 lane."""
    if not negotiated:
        return None, ()
    record = own_record(identity, batch_size=result.batch_size, compute_us=result.compute_us, queue_us=queue_us)
    return TimingsFrame((record,)), logprobs_annotation(result.logprobs)


def reply_bytes(reply: StageReply, timings: TimingsFrame | None, annotations: tuple[Annotation, ...] = ()) -> bytes:
    """The bytes of one upstream reply: its annotations and Timings frame (when given), then the
    reply, for one write."""
    if not annotations:
        if timings is None:
            return codec.encode_reply(reply)
        return codec.encode_timings(timings) + codec.encode_reply(reply)
    parts = [codec.encode_logprobs(frame) if type(frame) is LogprobsFrame
             else codec.encode_sampling_accepted(frame) for frame in annotations]  # type: ignore[arg-type]
    if timings is not None:
        parts.append(codec.encode_timings(timings))
    parts.append(codec.encode_reply(reply))
    return b"".join(parts)


def logprobs_annotation(result_logprobs: object, top: int | None = None) -> tuple[Annotation, ...]:
    """The Logprobs annotation of a final-stage result (``WorkResult.logprobs``; () when none)."""
    if not result_logprobs:
        return ()
    rows = tuple(result_logprobs)  # type: ignore[call-overload]
    return (LogprobsFrame(len(rows[0].top) if top is None else top, rows),)


def sampling_accepted(features: int) -> tuple[Annotation, ...]:
    """The SamplingAccepted annotation of a configure ACK."""
    return (SamplingAcceptedFrame(features),)
