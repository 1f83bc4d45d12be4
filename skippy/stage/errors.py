"""Why a stage closes a connection: one exception type, raised with a message that says what
arrived, what was expected, and (for downstream failures) which stage was lost.

``StageError`` ends the one connection it happens on (and its downstream lane); the stage itself
keeps serving.  ``DownstreamLost`` is the subclass for a next stage that refused, vanished or
answered out of protocol.
"""

from __future__ import annotations


class StageError(Exception):
    """A message or condition this stage refuses; the connection it arrived on is closed."""


class DownstreamLost(StageError):
    """The downstream stage could not be reached, closed the lane, or broke the protocol."""
