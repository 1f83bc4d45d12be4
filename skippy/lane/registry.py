"""The stage's registry of working lanes: the lanes that may bring work to its runtime.

Strategy: the scheduler's placement policy (inline decode on the trio thread, the idle fast
path's gathering of other lanes' rows) depends on how many lanes can bring work at once.  That
count is kept here explicitly, by the lanes themselves (a chain lane registers when it starts
serving, leaves when it closes or becomes a return lane, which only carries predictions written
into it), never inferred from statistics counters.
"""

from __future__ import annotations

from typing import final

__all__ = ["LaneRegistry"]


@final
class LaneRegistry:
    """Lane ids of the stage's working lanes."""

    __slots__ = ("_working", "working")

    def __init__(self) -> None:
        self._working: set[int] = set()
        #: How many lanes may bring work now (a plain attribute: read on every decode).
        self.working = 0

    def opened(self, lane_id: int) -> None:
        """Lane ``lane_id`` serves messages (it may bring work)."""
        self._working.add(lane_id)
        self.working = len(self._working)

    def resting(self, lane_id: int) -> None:
        """Lane ``lane_id`` closed, or became a return lane: it brings no work (idempotent)."""
        self._working.discard(lane_id)
        self.working = len(self._working)

    def __contains__(self, lane_id: object) -> bool:
        return lane_id in self._working
