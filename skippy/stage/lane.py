"""What a lane's tasks share: the stage's lane settings and channel hand-offs.

Strategy: plain data and pure helpers, kept apart from :mod:`skippy.stage.connection` (the tasks
themselves) and :mod:`skippy.lane` (the rules; its :mod:`skippy.lane.stats` holds the reply-stats
arithmetic).  :class:`LaneSettings` carries the measured shortcuts' switches
(``bench/RESULTS-stage.md``); ``put`` / ``take`` are the channel hand-offs that park only when
they must.
"""

from __future__ import annotations

import dataclasses
import ssl
import time
from typing import TypeVar

import trio

from skippy.codec.protocol import WireDType
from skippy.stage.transport import WireCondition

__all__ = ["LaneSettings", "now_us", "put", "take"]

T = TypeVar("T")


def now_us() -> int:
    return time.perf_counter_ns() // 1000


async def put(channel: trio.MemorySendChannel[T], value: T) -> None:
    """Send on a bounded channel, parking only when it is full (no checkpoint otherwise)."""
    try:
        channel.send_nowait(value)
    except trio.WouldBlock:  # full: this is the backpressure, wait for room
        await channel.send(value)


async def take(channel: trio.MemoryReceiveChannel[T]) -> T:
    """Receive from a channel, parking only when it is empty; EndOfChannel when closed."""
    try:
        return channel.receive_nowait()
    except trio.WouldBlock:  # empty: wait for the producer
        return await channel.receive()


@dataclasses.dataclass(frozen=True, slots=True)
class LaneSettings:
    """What every connection of a stage shares."""

    width: int
    is_last: bool
    downstream: object | None  # an Address; typed loosely to keep config out of the hot path
    wire_dtype: WireDType
    credit_limit: int
    max_inflight: int
    connect_timeout: float
    wire: WireCondition
    #: Shortcut 1, write-through: the runtime thread writes a decode's frame (or a final stage's
    #: lone PredictedToken) the moment its compute ends (:mod:`skippy.stage.write_through`).
    write_through: bool = True
    #: Shortcut 2, inline hand-offs: a task whose next task is idle does that task's step itself
    #: (the receiver handles a message when the compute task has nothing queued; a handler writes
    #: a frame when the forwarder has nothing queued) instead of waking it.
    inline_hand_offs: bool = True
    #: Shortcut 3, the decode relay: a non-final stage carries a direct-return session's steady
    #: decode in a loop outside Python (:mod:`skippy.stage.decode_relay`).
    decode_relay: bool = True
    #: Simulated one-way delay of every reply a stage writes (upstream and into return lanes,
    #: docs/protocol.md §8), seconds; benchmarks only (``--wire-reply-delay-ms``).
    reply_delay_s: float = 0.0
    #: The most rows one message may carry (the stage's KV cells; 0: no limit).
    max_rows: int = 0
    #: Sessions one lane may hold (0: no quota) and the largest frame it may send (0: the
    #: codec's limit); :mod:`skippy.stage.limits`.
    session_quota: int = 0
    max_frame_bytes: int = 0
    #: docs/protocol.md §9: this stage's Identity frame (answers identity queries; None: none) and
    #: its checker of the downstream (``skippy.stage.identity_check.DownstreamIdentities``; None: no check).
    identity: object | None = None
    identities: object | None = None
    #: TLS context of the downstream link (:mod:`skippy.net.tls`; None: plain TCP).
    downstream_tls: ssl.SSLContext | None = None
    #: A file naming the downstream, read at every dial (``--downstream-file``; None: none).
    downstream_file: object | None = None
