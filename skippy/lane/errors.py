"""Why a stage closes a lane: one exception type per refusal, each carrying its wire error code.

Strategy: blame is assigned once, where the refusal is found.  Every class below is a
:class:`StageError` whose ``code`` is the extension :class:`~skippy.codec.protocol_ext.ErrorCode` the
lane's Error frame carries (``docs/protocol.md`` §3), so nothing downstream of the raise ever
inspects a message text to classify it.  A ``StageError`` ends the one lane it happens on (and
that lane's downstream lane); the stage and its other lanes carry on.

Anything that is *not* a ``StageError`` reaching a lane is a bug: the lane logs it with its
traceback and reports it as ``INTERNAL`` (:func:`error_code`).

* :class:`MalformedFrame`: a frame from upstream that the codec rejected.
* :class:`UnsupportedKind`: a valid v11 kind this stage does not serve.
* :class:`InvalidMessage`: a well-formed message that does not fit its kind or the session
  (state header vs kind, activation shape, counts, a position gap): ``STATE_MISMATCH``.
* :class:`Overloaded`: no sequence id or KV room for the request.
* :class:`RuntimeFailure`: the runtime failed to execute the message.
* :class:`ShuttingDown`: the stage is draining.
* :class:`UpstreamLost`: the upstream went away mid-write (nothing can be reported to it).
* :class:`DownstreamLost`: the next stage refused, vanished or broke the protocol;
  :class:`DownstreamError` is the one that said why with an Error frame (relayed unchanged).

(The runtime's :class:`skippy.runtime.StateMismatch` is the one class of that name: a saved
state blob that does not fit the model.  A message that does not fit its kind is
:class:`InvalidMessage` here, whose *wire* code is ``STATE_MISMATCH``.)
"""

from __future__ import annotations

from skippy.codec.protocol_ext import ErrorCode, ErrorFrame

__all__ = [
    "DownstreamError", "DownstreamLost", "InvalidMessage", "MalformedFrame", "Overloaded", "RuntimeFailure",
    "ReturnLaneLost", "ShuttingDown", "StageError", "UnsupportedKind", "UpstreamLost", "error_code",
]


class StageError(Exception):
    """A message or condition this stage refuses; the lane it arrived on is closed.

    ``code`` is the wire error code of the refusal; the base class itself is ``INTERNAL`` (a
    broken invariant inside the stage, logged with its traceback like any unexpected error).
    """

    code: ErrorCode = ErrorCode.INTERNAL


class MalformedFrame(StageError):
    """A frame from upstream raised :class:`~skippy.codec.protocol.WireError` (the reason is kept)."""

    code = ErrorCode.MALFORMED_FRAME


class UnsupportedKind(StageError):
    """A valid v11 kind this stage does not serve (StateImport, StateExport, ...)."""

    code = ErrorCode.UNSUPPORTED_KIND


class InvalidMessage(StageError):
    """A message that does not match its kind or the session it names."""

    code = ErrorCode.STATE_MISMATCH


class Overloaded(StageError):
    """No lane, session or KV capacity for the request."""

    code = ErrorCode.OVERLOADED


class RuntimeFailure(StageError):
    """The runtime refused or failed to execute the message."""

    code = ErrorCode.RUNTIME_ERROR


class ShuttingDown(StageError):
    """The stage is draining and takes no more work."""

    code = ErrorCode.SHUTTING_DOWN


class UpstreamLost(StageError):
    """The upstream closed or reset the lane while a reply was being written.

    Its code is never sent: there is no one left on that lane to send it to.
    """

    code = ErrorCode.INTERNAL


class ReturnLaneLost(StageError):
    """A session's return lane (docs/protocol.md §8) closed or failed a write: the driver that
    opened it is gone or gave up on it.  The session's chain lane is closed with this code."""

    code = ErrorCode.INTERNAL


class DownstreamLost(StageError):
    """The downstream stage could not be reached, closed the lane, or broke the protocol."""

    code = ErrorCode.DOWNSTREAM_LOST


class DownstreamError(DownstreamLost):
    """The downstream sent an extension Error frame (``frame``) and closed the lane."""

    def __init__(self, frame: ErrorFrame) -> None:
        super().__init__(f"downstream closed the lane: {frame.describe()}")
        self.frame = frame
        self.code = ErrorCode(frame.code)


def error_code(exc: BaseException) -> ErrorCode:
    """The wire code for the exception that closed a lane: its own, or ``INTERNAL`` for a bug."""
    if isinstance(exc, StageError):
        return exc.code
    return ErrorCode.INTERNAL
