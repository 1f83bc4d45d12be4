"""What one peer, and all peers together, may hold of a stage: sessions, lanes, bytes and time.

Strategy: every limit is a number in :class:`StageLimits` (from ``python -m skippy.stage`` flags,
see :func:`limits_for`), enforced where the resource is taken, before it is taken:

* **sessions per lane** (``session_quota``, default a fair share: half of ``--max-sessions``,
  at least one): a lane that would open one more session than its quota is refused
  (``OVERLOADED``), so one peer cannot lock every other client out (checked by the connection).
* **lanes** (``max_connections``): the listener closes a connection beyond it before READY.
* **bytes**: one frame may not exceed ``max_frame_bytes`` (by default what the stage's KV could
  ever take: ``ctx_size`` rows of activation plus sidebands), and the frames being read by all
  lanes together hold at most ``max_buffered_bytes`` (:class:`BufferBudget`): a large frame
  reserves its size before its bytes are read, waits while the budget is spent (its read timeout
  runs meanwhile) and is released once its message has been handled; a frame bigger than the
  whole budget is refused at once.  Frames under ``SMALL_FRAME`` (every decode) reserve nothing.
* **time** (checked by the server's watchdog, :meth:`StageLimits.overdue`): a frame's first 76
  bytes must arrive within ``header_timeout`` of its first byte, the whole frame within
  ``frame_timeout``, and a lane with nothing in flight is closed after ``idle_timeout``.  A
  timeout of 0 disables that check.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import logging
import math

import trio

from skippy.codec.protocol import MAX_MESSAGE_FRAME_BYTES
from skippy.lane.errors import MalformedFrame, Overloaded

__all__ = [
    "SMALL_FRAME", "BufferBudget", "IdleLane", "SlowFrame", "StageLimits", "fair_share", "frame_limit",
    "return_freed_memory",
]

log = logging.getLogger("skippy.stage")

#: Frames up to this size reserve nothing from the budget (decodes, control messages).
SMALL_FRAME = 1 << 16
#: The fixed header every frame starts with (docs/protocol.md §2.2).
HEADER_BYTES = 76
#: Room a frame may need besides its rows: sampling section, metadata, slack.
_FRAME_OVERHEAD = 1 << 20


class SlowFrame(MalformedFrame):
    """A frame whose header or body did not arrive within its read timeout (a slowloris)."""


class IdleLane(Overloaded):
    """A lane with nothing in flight stayed silent past the idle timeout."""


def fair_share(max_sessions: int) -> int:
    """The default per-lane session quota: half of the stage's sessions, at least one."""
    return max(1, max_sessions // 2)


@dataclasses.dataclass(frozen=True, slots=True)
class StageLimits:
    """A stage's per-peer and total limits (0 disables a timeout or a quota)."""

    session_quota: int = 0
    max_connections: int = 0
    idle_timeout: float = 0.0
    header_timeout: float = 0.0
    frame_timeout: float = 0.0
    max_frame_bytes: int = MAX_MESSAGE_FRAME_BYTES
    max_buffered_bytes: int = 0

    @property
    def watch_period(self) -> float:
        """How often the watchdog looks (a quarter of the shortest timeout, within 50 ms..1 s)."""
        timeouts = [t for t in (self.idle_timeout, self.header_timeout, self.frame_timeout) if t > 0]
        return min(1.0, max(0.05, min(timeouts) / 4)) if timeouts else math.inf

    def overdue(self, now: float, *, frame_started: float | None, buffered: int, needed: int,
                idle_since: float | None) -> Exception | None:
        """The timeout a lane has passed, or None.

        Args:
            frame_started: when the first byte of the frame being read arrived (None: between frames).
            buffered / needed: bytes of that frame received / known to be needed so far.
            idle_since: since when the lane has had nothing in flight (None: it has work).
        """
        if frame_started is not None:
            elapsed = now - frame_started
            if self.header_timeout > 0 and buffered < HEADER_BYTES and elapsed > self.header_timeout:
                return SlowFrame(f"frame header incomplete after {self.header_timeout:g} s ({buffered} of "
                                 f"{HEADER_BYTES} bytes; --header-timeout)")
            if self.frame_timeout > 0 and elapsed > self.frame_timeout:
                return SlowFrame(f"frame incomplete after {self.frame_timeout:g} s ({buffered} of {needed} bytes; "
                                 "--frame-timeout)")
        elif idle_since is not None and self.idle_timeout > 0 and now - idle_since > self.idle_timeout:
            return IdleLane(f"lane idle for {self.idle_timeout:g} s (--idle-timeout)")
        return None


def frame_limit(ctx_size: int, width: int) -> int:
    """The largest frame a stage of ``ctx_size`` KV cells and activation ``width`` can use:
    every row it could hold, as f32 activation plus token and position ids, plus the sections."""
    return min(MAX_MESSAGE_FRAME_BYTES, _FRAME_OVERHEAD + ctx_size * (4 * width + 8))


class BufferBudget:
    """Bytes the lanes of a stage may hold in frames being read and messages being handled.

    Args:
        capacity: the total (0: unlimited).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._freed = trio.Event()

    async def reserve(self, size: int, peer: str) -> None:
        """Take ``size`` bytes, waiting while they are not free.

        Raises:
            Overloaded: ``size`` exceeds the whole budget.
        """
        if self.capacity <= 0:
            return
        if size > self.capacity:
            raise Overloaded(f"a {size}-byte frame from {peer} exceeds the stage's {self.capacity}-byte buffer "
                             "budget (--max-buffered-mib)")
        while self.used + size > self.capacity:
            await self._freed.wait()
        self.used += size
        self.peak = max(self.peak, self.used)

    def release(self, size: int) -> None:
        if self.capacity <= 0 or size <= 0:
            return
        self.used -= size
        self._freed.set()
        self._freed = trio.Event()


_libc: ctypes.CDLL | None | bool = None


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing).

    Closed lanes free their buffers into the heap, which keeps them; this returns them, so the
    resident size comes back down after a burst of connections.  A lane's objects form reference
    cycles and the stage runs the cycle collector rarely (``python -m skippy.stage`` raises its
    thresholds), so a collection comes first.  Python's small objects live in the interpreter's
    own 1 MiB arenas, which this cannot reach: one goes back only once it is empty, which is why
    lanes that have sent nothing hold no Connection (:class:`skippy.stage.server.WaitingLanes`).
    """
    global _libc
    gc.collect()
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
            if _libc and not hasattr(_libc, "malloc_trim"):
                _libc = False
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)  # type: ignore[union-attr]
