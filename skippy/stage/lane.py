"""What a lane's tasks pass between them: reply slots, forwarded frames, settings, reply stats.

Strategy: plain data and pure helpers, kept apart from :mod:`skippy.stage.connection` (the tasks
themselves).  A :class:`ReplySlot` is one upstream reply in message order; a :class:`Forward` is
one frame on its way downstream with what its reply means (:class:`Expect`) and the timings the
relay reports; :func:`merge_stats` / :func:`timing_stats` are the reply-stats arithmetic of a
relayed reply.  ``put`` / ``take`` are the channel hand-offs that park only when they must.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Awaitable, Callable, TypeVar

import trio

from skippy.protocol import EMPTY_REPLY_STATS, ReplyStats, StageMessage, StageReply, WireDType
from skippy.protocol_ext import TimingsFrame
from skippy.stage.transport import WireCondition

__all__ = [
    "Expect", "Forward", "LaneSettings", "ReplySlot", "merge_stats", "now_us", "put", "take", "timing_stats",
]

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


class Expect(enum.Enum):
    """What the relay does with the downstream reply to a forwarded frame."""

    ABSORB_ACK = "absorb"  #: an early-ACKed chunk: keep its stats, return its credit
    RELAY_ACK = "ack"  #: relay an ACK upstream
    STOP_ACK = "stop"  #: release the session, then relay the ACK
    RELAY_PREDICTION = "prediction"  #: relay PredictedToken(s) upstream
    RELAY_EITHER = "either"  #: TryRestorePrefillDecode: PredictedToken on a hit, ACK on a miss


@dataclasses.dataclass(slots=True, eq=False)
class ReplySlot:
    """One upstream reply, filled by whichever task produces it, written in message order.

    A queued slot's event is set when it is filled (the writer waits for it); a direct slot's
    when its reply has been written (a queued slot behind it waits for that).  The event is made
    only when someone waits: on the hot path nobody does.
    """

    direct: bool = False
    reply: StageReply | None = None
    event: trio.Event | None = None
    #: The extension Timings frame written just before the reply (negotiated lanes only).
    timings: TimingsFrame | None = None

    def wait_event(self) -> trio.Event:
        if self.event is None:
            self.event = trio.Event()
        return self.event


@dataclasses.dataclass(slots=True, eq=False)
class Forward:
    """A frame on its way downstream and what to do with its reply."""

    message: StageMessage
    expect: Expect | None
    slot: ReplySlot | None
    session: int
    received_us: int
    enqueued_at: float
    compute_us: int = 0
    queue_us: int = 0
    batch_size: int = 0
    sent_us: int = 0
    write_us: int = 0
    frame_bytes: int = 0
    #: Turns the downstream ACK's stats into this stage's reply stats (prefix-cache control).
    on_reply: Callable[[ReplyStats], Awaitable[ReplyStats]] | None = None


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


def timing_stats(base: ReplyStats, *, compute_us: int, write_us: int, wait_us: int, total_us: int,
                 batch_size: int) -> ReplyStats:
    """Add one stage's share to a VerifyWindow reply's ``verify_window_*`` stats (summed along the
    chain, ``verify_window_stage_count`` += 1, the largest batch in ``verify_window_max_tokens``)."""
    return dataclasses.replace(
        base,
        verify_window_compute_us=base.verify_window_compute_us + compute_us,
        verify_window_forward_write_us=base.verify_window_forward_write_us + write_us,
        verify_window_downstream_wait_us=base.verify_window_downstream_wait_us + wait_us,
        verify_window_total_us=base.verify_window_total_us + total_us,
        verify_window_stage_count=base.verify_window_stage_count + 1,
        verify_window_max_tokens=max(base.verify_window_max_tokens, batch_size),
    )


def merge_stats(pending: ReplyStats, reply: ReplyStats) -> ReplyStats:
    """``pending.merge(reply)``, without the copy when nothing is pending (the decode hot path).

    Merging into empty stats gives back ``reply`` unchanged unless a max-merged field of it is
    negative or its prefill-edge fields are set without a positive total: only then is the full
    merge needed.
    """
    if pending is EMPTY_REPLY_STATS and reply.prefill_edge_total_us_max >= 0 and min(
        reply.verify_window_max_tokens, reply.prefill_edge_write_us_max, reply.prefill_edge_wait_us_max
    ) >= 0 and (reply.prefill_edge_total_us_max > 0 or not (
        reply.prefill_edge_stage_index or reply.prefill_edge_activation_bytes_max
    )):
        return reply
    return pending.merge(reply)
