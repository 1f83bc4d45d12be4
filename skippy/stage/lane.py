"""What a lane's tasks share: the stage's lane settings, reply-stats arithmetic, channel hand-offs.

Strategy: plain data and pure helpers, kept apart from :mod:`skippy.stage.connection` (the tasks
themselves) and :mod:`skippy.stage.lane_protocol` (the rules).  :class:`LaneSettings` carries
the three measured shortcuts' switches (``bench/RESULTS-stage.md``); :func:`merge_stats` /
:func:`timing_stats` are the reply-stats arithmetic of a relayed reply; ``put`` / ``take`` are
the channel hand-offs that park only when they must.
"""

from __future__ import annotations

import dataclasses
import ssl
import time
from typing import TypeVar

import trio

from skippy.protocol import EMPTY_REPLY_STATS, ReplyStats, WireDType
from skippy.stage.transport import WireCondition

__all__ = [
    "LaneSettings", "merge_stats", "now_us", "put", "take", "timing_stats",
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
    #: its checker of the downstream (``skippy.identity.DownstreamIdentities``; None: no check).
    identity: object | None = None
    identities: object | None = None
    #: TLS context of the downstream link (:mod:`skippy.stage.tls`; None: plain TCP).
    downstream_tls: ssl.SSLContext | None = None
    #: A file naming the downstream, read at every dial (``--downstream-file``; None: none).
    downstream_file: object | None = None


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
