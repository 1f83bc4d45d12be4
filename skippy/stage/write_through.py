"""Write-through: the runtime thread writes a decode's frame the moment its compute ends.

Strategy: without it, a finished compute wakes the trio thread (the worker's ``run_sync_soon``,
a run-loop pass for the entry queue, one for the waiting task), and only then does the lane build,
encode and write the frame.  On the 2-stage llama-16x1024 chain that hand-back took 290-310 us
per stage per token (median, compute end to write), all of it on the chain's critical path: the
next stage (or the driver) waits for those bytes, and the Python it runs is cold after the
compute streamed the weights through the caches.  With write-through (a placement:
:func:`skippy.lane.placement.placement` chooses the runtime thread as the writer) the lane hands
the scheduler a :class:`WriteThrough` beside the work item (``Scheduler.execute(item, then)``;
the item itself stays plain data); the scheduler calls it on the runtime thread right after the
item's result exists, and it builds the frame and writes it with one non-blocking write.  The lane's trio side then
finishes (the rest of a partial write, counters, the reply slot) off the critical path.

Safety rules, each kept by the connection that sets one up:

* **One writer.**  A write-through is made only when nothing else may write that stream until it
  is done: downstream, when nothing is queued to the forwarder (the connection holds its forward
  backlog for the duration); upstream, when the lane protocol hands it the writer token for
  that reply (``LaneProtocol.claim_reply_write``: next in line, nobody writing), which every
  reply behind it waits for.
* **Order.**  The downstream frame's :class:`~skippy.lane.protocol.Forward` is in the
  lane's expected replies before the job is submitted, so its reply always finds it.
* **No write after close.**  Every write-through of a lane writes under the lane's
  :class:`StreamGate`, and only while the gate is open.  The lane closes the gate before it
  writes an Error frame or closes its streams, so a write-through whose requester was cancelled
  (a queued job still runs) never writes into a closed stream, or into a descriptor number the
  process has reused since.
* **Partial writes.**  A socket buffer that takes only part of the frame leaves the rest to
  :meth:`WriteThrough.finish`, on the trio side, before anything else may write that stream.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import trio

from skippy.lane.errors import StageError
from skippy.net.socket_io import SocketIO
from skippy.stage.executor import WorkResult
from skippy.stage.transport import send_frame, write_failed

__all__ = ["StreamGate", "WriteThrough"]


class StreamGate:
    """The lock and open flag every write-through of one lane writes under."""

    __slots__ = ("_lock", "_open")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    def close(self) -> None:
        """No write-through writes after this returns (one already writing finishes first)."""
        with self._lock:
            self._open = False

    def write(self, io: SocketIO, frame: bytes) -> int:
        """Write what the socket takes now; returns the byte count.

        Raises:
            trio.ClosedResourceError: the gate is closed.
            trio.BrokenResourceError: the peer reset the connection.
        """
        with self._lock:
            if not self._open:
                raise trio.ClosedResourceError("the lane is closing")
            return io.send_now(frame)


class WriteThrough:
    """One frame, built and written by the runtime thread when the item's compute ends.

    Args:
        gate: the lane's gate.
        io: the stream to write (a socket stream with no other writer until :meth:`finish`).
        build: runtime-thread side, ``(result, queue_us) -> frame``; it may record what it built
            on the lane's objects (it runs before the frame can leave).
        on_sent: runtime-thread side, called with (sent_us, write_us) right after the write.
    """

    __slots__ = ("gate", "io", "build", "on_sent", "frame", "written", "error", "ran")

    def __init__(self, gate: StreamGate, io: SocketIO, build: Callable[[WorkResult, int], bytes],
                 on_sent: Callable[[int, int], None] | None = None) -> None:
        self.gate = gate
        self.io = io
        self.build = build
        self.on_sent = on_sent
        self.frame = b""
        self.written = 0
        self.error: BaseException | None = None
        self.ran = False

    def __call__(self, result: WorkResult, queue_us: int) -> None:
        """The emit step (runtime thread, or inline for a runtime that never blocks); never raises."""
        self.ran = True
        try:
            frame = self.frame = self.build(result, queue_us)
            sent_ns = time.perf_counter_ns()
            self.written = self.gate.write(self.io, frame)
            if self.on_sent is not None:
                self.on_sent(sent_ns // 1000, (time.perf_counter_ns() - sent_ns) // 1000)
        except BaseException as exc:  # reported on the trio side by finish()
            self.error = exc

    async def finish(self, peer: str, *, downstream: bool) -> int:
        """Trio side: write what the socket did not take; returns the microseconds that took.

        Raises:
            StageError / DownstreamLost: the build failed, or the stream broke (naming ``peer``).
        """
        if not self.ran:
            raise StageError("internal error: the runtime finished an item without its write-through")
        if self.error is not None:
            if isinstance(self.error, (trio.BrokenResourceError, trio.ClosedResourceError)):
                raise write_failed(peer, downstream=downstream) from self.error
            raise self.error
        if self.written == len(self.frame):
            return 0
        started = time.perf_counter_ns()
        await send_frame(self.io, memoryview(self.frame)[self.written:], peer, downstream=downstream)
        return (time.perf_counter_ns() - started) // 1000
