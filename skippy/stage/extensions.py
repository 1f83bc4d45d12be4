"""A stage's side of skippy's negotiated protocol extensions: Error and Timings frames.

Strategy (the rules are ``docs/protocol.md`` §2-§4; the frame types ``skippy.codec.protocol_ext``):

* Negotiation is per upstream connection (:class:`~skippy.codec.protocol_ext.ExtensionNegotiation`,
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
* Timings. :func:`own_record` (:mod:`skippy.lane.replies`) is this stage's record for one reply.
* Annotations (docs/protocol.md §10: SamplingAccepted, Logprobs). The final stage writes them
  before the reply they belong to; every other stage relays them unchanged, and only to an
  upstream that negotiated the extensions (a v11 upstream cannot have asked for them).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import trio

from skippy.codec.protocol import StageMessage, StageReply
from skippy.codec.protocol_ext import (
    MAX_ERROR_ADDRESS_BYTES,
    MAX_ERROR_MESSAGE_BYTES,
    Annotation,
    ErrorCode,
    ErrorFrame,
    LogprobsFrame,
    SamplingAcceptedFrame,
    TimingsFrame,
)
from skippy.lane.errors import DownstreamError, StageError, error_code
from skippy.lane.replies import logprobs_annotation, own_record, prediction_frames
from skippy.net.socket_io import SocketIO
from skippy.stage.transport import codec

log = logging.getLogger("skippy.stage")

__all__ = [
    "StageIdentity", "closing_error", "describe", "error_frame", "identity_for", "is_bug", "leaves",
    "logprobs_annotation", "own_record", "prediction_frames", "reply_bytes", "send_error", "shutting_down_frame",
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


def leaves(group: BaseExceptionGroup[Exception]) -> list[BaseException]:
    """The exceptions of ``group`` and of its nested groups, flattened."""
    result: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            result += leaves(exc)
        else:
            result.append(exc)
    return result


def describe(exc: BaseException) -> str:
    """A failure for the log and the Error frame: a refusal's own text, a bug's type too."""
    if isinstance(exc, StageError) and not is_bug(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def closing_error(failures: list[BaseException], log: logging.Logger, lane_id: int, peer: str, *, idle: bool,
                  identity_aware: bool, index: int, address: str, downstream_address: str) -> ErrorFrame:
    """A lane closes for ``failures``: log one line naming the reason (INFO when it only sat idle
    too long; a bug also with its traceback) and return the Error frame it ends with (a
    downstream's Error relayed unchanged; §9: MODEL_MISMATCH is STATE_MISMATCH to an upstream
    that does not flag bit 12)."""
    reason = "; ".join(map(describe, failures))
    log.log(logging.INFO if idle else logging.ERROR, "closing lane %d from %s: %s", lane_id, peer, reason)
    for exc in failures:
        if is_bug(exc):
            log.error("lane %d: internal error", lane_id, exc_info=exc)
    cause = next((exc for exc in failures if isinstance(exc, DownstreamError)), failures[0])
    error = error_frame(cause, describe(cause), index=index, address=address, downstream_address=downstream_address)
    if error.code is ErrorCode.MODEL_MISMATCH and not identity_aware:
        error = dataclasses.replace(error, code=ErrorCode.STATE_MISMATCH)  # §9: the v11-era code
    return error


def shutting_down_frame(index: int, address: str) -> ErrorFrame:
    """The Error frame of a lane closed because the stage is draining (SIGTERM)."""
    return ErrorFrame(ErrorCode.SHUTTING_DOWN, index, index, _cut(address, MAX_ERROR_ADDRESS_BYTES),
                      "the stage is shutting down")


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


def sampling_accepted(features: int) -> tuple[Annotation, ...]:
    """The SamplingAccepted annotation of a configure ACK."""
    return (SamplingAcceptedFrame(features),)


async def send_error(io: SocketIO, error: ErrorFrame, lane_id: int) -> None:
    """docs/protocol.md §3: the Error frame, last thing on a lane (best effort, bounded)."""
    try:
        frame = codec.encode_error(error)
        with trio.move_on_after(0.5):
            await io.send_all(frame)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ValueError) as exc:
        log.debug("lane %d: could not send the Error frame: %s", lane_id, exc)
