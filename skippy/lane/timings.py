"""Per-session timing totals of the messages a stage forwards for direct return (docs/protocol.md §8).

Strategy: with direct return, a stage with a downstream answers no flagged message upstream, so
its Timings record for it (compute, forward write, queue wait: docs/protocol.md §4) would be
lost.  :class:`DirectTimings` sums those records per session instead; when the session's Stop is
ACKed hop by hop, the stage appends the session's total record to the Timings frame in front of
that ACK (the driver adds it to ``usage.skippy_timing``).  A record that never ran (a session
that never forwarded a flagged message) adds nothing, so a hop-by-hop chain sends the same bytes
as before.
"""

from __future__ import annotations

from typing import final

from skippy.codec.protocol_ext import TimingRecord

__all__ = ["DirectTimings"]


@final
class DirectTimings:
    """The summed timings of each session's direct-return messages forwarded by one lane."""

    __slots__ = ("_totals",)

    def __init__(self) -> None:
        #: session key -> [messages, compute_us, forward_write_us, queue_wait_us, largest batch]
        self._totals: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._totals)

    def add(self, session: int, *, compute_us: int, write_us: int, queue_us: int = 0, batch_size: int = 1,
            messages: int = 1) -> None:
        """Account ``messages`` forwarded messages of ``session`` (durations summed, microseconds)."""
        total = self._totals.get(session)
        if total is None:
            total = self._totals[session] = [0, 0, 0, 0, 0]
        total[0] += messages
        total[1] += max(compute_us, 0)
        total[2] += max(write_us, 0)
        total[3] += max(queue_us, 0)
        total[4] = max(total[4], batch_size)

    def take(self, session: int, *, stage_index: int, layer_start: int, layer_end: int) -> TimingRecord | None:
        """The session's total record (and forget it), or None when it forwarded nothing flagged."""
        total = self._totals.pop(session, None)
        if total is None or not total[0]:
            return None
        return TimingRecord(max(stage_index, 0), layer_start, layer_end, total[4], total[1], total[2], 0, total[3])

    def discard(self, session: int) -> None:
        """Forget ``session`` (released without a Stop)."""
        self._totals.pop(session, None)
