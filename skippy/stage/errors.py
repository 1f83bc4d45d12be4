"""Why a stage closes a connection: one exception type, raised with a message that says what
arrived, what was expected, and (for downstream failures) which stage was lost.

``StageError`` ends the one connection it happens on (and its downstream lane); the stage itself
keeps serving.  ``DownstreamLost`` is the subclass for a next stage that refused, vanished or
answered out of protocol; ``DownstreamError`` is the one for a downstream that said why, with an
extension Error frame (relayed upstream unchanged).  ``UnsupportedKind`` and ``StateMismatch``
name two refusals precisely, so the extension Error frame sent upstream can carry their code
(:func:`skippy.stage.extensions.error_code` maps every exception to one).
"""

from __future__ import annotations

from skippy.protocol_ext import ErrorFrame


class StageError(Exception):
    """A message or condition this stage refuses; the connection it arrived on is closed."""


class UnsupportedKind(StageError):
    """A valid v11 kind this stage does not serve (StateImport, StateExport, ...)."""


class StateMismatch(StageError):
    """The state header does not match the kind, or the activation has the wrong width."""


class DownstreamLost(StageError):
    """The downstream stage could not be reached, closed the lane, or broke the protocol."""


class DownstreamError(DownstreamLost):
    """The downstream sent an extension Error frame (``frame``) and closed the lane."""

    def __init__(self, frame: ErrorFrame) -> None:
        super().__init__(f"downstream closed the lane: {frame.describe()}")
        self.frame = frame
