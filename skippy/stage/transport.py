"""Frames over trio streams: READY, framed readers, the downstream dialer and wire conditions.

Strategy: the codec is sans-IO (:mod:`skippy.codec.wire`); this module is the only place that moves its
bytes over sockets.  A reader owns one decoder and one stream and turns received chunks into whole
frames (``None`` at a clean end of stream).  trio's stream errors are mapped here, at the
transport boundary, to :class:`~skippy.lane.errors.MalformedFrame`, :class:`~skippy.lane.errors.UpstreamLost`
and :class:`~skippy.lane.errors.DownstreamLost` with the peer's address in the message, so the
connection logic above never sees ``BrokenResourceError`` and a log line always names the peer.

:class:`SocketIO` is the decode hot path's way to the socket.  ``SocketStream.receive_some`` /
``send_all`` always pass through trio's scheduler (a checkpoint even when the socket is ready) and
``receive_some(n)`` allocates an ``n``-byte object per call.  Measured on the 2-core bench host:
a relay chain of bare trio ``SocketStream`` processes costs about 100 us more per stage boundary
than the same relay on raw non-blocking sockets with ``wait_readable``, and reading a 16 KiB frame
with ``recv(1 MiB)`` costs ~30 us against ~4 us for ``readv`` into a reused buffer.  ``SocketIO`` instead tries
the non-blocking ``read``/``write`` on the socket's descriptor first, into one reusable receive
buffer, and parks in trio (``wait_readable`` / ``wait_writable``) only when the socket would
block.  It never owns the descriptor: the stream stays the owner (``aclose`` closes it, and trio's
``notify_closing`` wakes a parked reader or writer with ``ClosedResourceError``), and every call
asks the socket for its current descriptor, so a closed stream reads as closed, never as a reused
descriptor number.  Streams that are not sockets (memory streams in
tests) fall back to ``receive_some`` / ``send_all``.
``WireCondition`` simulates a slower link on downstream writes: the one-way delay counts from
when a frame was enqueued (queued frames overlap their delays, as on a real pipe), then the
bandwidth is modelled by sleeping for the frame's serialisation time after the write.
"""

from __future__ import annotations

import dataclasses
import math
import ssl
from typing import Callable

import trio

from skippy.codec import wire as codec

from skippy.codec.protocol import (
    END_OF_STREAM,
    NEED_DATA,
    READY_BYTES,
    StageMessage,
    StageReply,
    WireError,
    check_ready,
)
from skippy.codec.protocol_ext import Annotation, ErrorFrame, LogprobsFrame, SamplingAcceptedFrame, TimingsFrame
from skippy.lane.errors import DownstreamError, DownstreamLost, MalformedFrame, StageError, UpstreamLost
from skippy.net.address import Address
from skippy.net.socket_io import RECEIVE_CHUNK, SocketIO, set_no_delay
from skippy.net.tls import handshake_as_client
from skippy.stage.limits import SMALL_FRAME, BufferBudget

__all__ = [
    "MessageReader", "ReplyReader", "WireCondition", "codec", "connect_stage", "receive_ready", "send_ready",
]

#: Frames at least this big are decoded on a worker thread (their copy and dtype conversion).
LARGE_FRAME = 1 << 20


async def send_ready(stream: trio.abc.SendStream) -> None:
    """Send the 4-byte READY magic (the listening side speaks first)."""
    await stream.send_all(READY_BYTES)


async def receive_ready(stream: trio.abc.ReceiveStream, peer: str) -> None:
    """Read and check READY from ``peer``.

    Raises:
        DownstreamLost: the peer closed or sent something else.
    """
    data = b""
    try:
        while len(data) < 4:
            chunk = await stream.receive_some(4 - len(data))
            if not chunk:
                break
            data += chunk
        check_ready(data)
    except WireError as exc:
        raise DownstreamLost(f"stage {peer} did not answer READY: {exc}") from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise DownstreamLost(f"stage {peer} closed the connection before READY") from exc


class _Reader:
    def __init__(self, io: SocketIO, peer: str, decoder: object) -> None:
        self.io = io
        self.peer = peer
        self.decoder = decoder

    async def _fill(self) -> None:
        self.decoder.receive_data(await self.io.receive())  # type: ignore[attr-defined]


class MessageReader(_Reader):
    """Whole :class:`StageMessage` frames from an upstream stream, within the stage's limits.

    Args:
        max_frame_bytes: the largest frame accepted (None: the codec's own limit).
        budget: the stage's buffer budget; a frame over ``SMALL_FRAME`` reserves its size from
            it before its bytes are read (:mod:`skippy.stage.limits`); :meth:`take_reserved`
            hands the reservation of the frame just returned to the caller, who releases it.

    ``frame_started`` is when the first byte of the frame being read arrived (None between
    frames) and ``last_frame`` when the last whole frame did, for the read and idle timeouts.

    Raises (from :meth:`next`):
        MalformedFrame: a malformed, unknown, truncated or oversized frame (the codec's reason is kept).
        Overloaded: a frame bigger than the whole buffer budget.
    """

    def __init__(self, io: SocketIO, peer: str, width: int, *, max_frame_bytes: int | None = None,
                 budget: BufferBudget | None = None) -> None:
        decoder = (codec.MessageDecoder(width) if max_frame_bytes is None
                   else codec.MessageDecoder(width, max_buffer_bytes=max_frame_bytes + RECEIVE_CHUNK))
        super().__init__(io, peer, decoder)
        self.max_frame_bytes = max_frame_bytes
        self.budget = budget
        self.reserved = 0
        self.frame_started: float | None = None
        self.last_frame = trio.current_time()

    def take_reserved(self) -> int:
        """The budget bytes held for the frame just returned (the caller releases them)."""
        reserved, self.reserved = self.reserved, 0
        return reserved

    async def next(self) -> StageMessage | None:
        """The next message, or None when the peer closed the stream between frames."""
        decoder = self.decoder
        while True:
            needed = decoder.bytes_needed  # type: ignore[attr-defined]
            try:
                if needed >= LARGE_FRAME and decoder.buffered_bytes >= needed:  # type: ignore[attr-defined]
                    result = await trio.to_thread.run_sync(decoder.next_message)  # type: ignore[attr-defined]
                else:
                    result = decoder.next_message()  # type: ignore[attr-defined]
            except WireError as exc:  # the codec's verdict on the upstream's bytes
                raise MalformedFrame(f"malformed frame from {self.peer}: {exc}") from exc
            if result is END_OF_STREAM:
                return None
            if result is not NEED_DATA:
                assert isinstance(result, StageMessage)
                self.last_frame = now = trio.current_time()
                self.frame_started = now if decoder.buffered_bytes else None  # type: ignore[attr-defined]
                return result
            needed = decoder.bytes_needed  # type: ignore[attr-defined]
            if self.max_frame_bytes is not None and needed > self.max_frame_bytes:
                raise MalformedFrame(f"malformed frame from {self.peer}: a {needed}-byte frame exceeds this "
                                     f"stage's {self.max_frame_bytes}-byte limit (--max-frame-mib)")
            if self.budget is not None and needed > SMALL_FRAME and needed > self.reserved:
                await self.budget.reserve(needed - self.reserved, self.peer)
                self.reserved = needed
            await self._fill()
            if self.frame_started is None:
                self.frame_started = trio.current_time()


class ReplyReader(_Reader):
    """Whole :class:`StageReply` frames from a downstream stream, with the extension frames.

    The lane's messages are always flagged (``docs/protocol.md`` §2), so its replies are decoded
    with ``extensions=True``: a Timings frame is kept for the reply it precedes, an Error frame
    ends the lane as :class:`DownstreamError`.

    Raises (from :meth:`next`):
        DownstreamLost: the downstream closed the lane or sent a malformed reply.
    """

    def __init__(self, io: SocketIO, peer: str) -> None:
        super().__init__(io, peer, codec.ReplyDecoder(extensions=True))
        #: The annotation frames (docs/protocol.md §10) that preceded the last reply :meth:`next`
        #: returned, to relay with it.
        self.annotations: tuple[Annotation, ...] = ()
        #: A reply's leading frames read by a :meth:`next` that was cancelled before the reply came
        #: (kept for the next call), and whether ``annotations`` are the last reply's.
        self._timings: TimingsFrame | None = None
        self._returned = True

    @property
    def mid_reply(self) -> bool:
        """Part of a reply is read (bytes buffered, or its leading frames): the next bytes on the
        stream are not a reply's first."""
        return bool(self.decoder.buffered_bytes or self._timings is not None  # type: ignore[attr-defined]
                    or (self.annotations and not self._returned))

    async def next(self) -> tuple[StageReply, TimingsFrame | None]:
        """The next reply and the Timings frame that preceded it (None without one).

        Raises:
            DownstreamError: the downstream sent an Error frame (it closes the lane after it).
            DownstreamLost: end of stream (the downstream stage is gone) or a malformed reply.
        """
        if self._returned:
            self._returned = False
            if self.annotations:
                self.annotations = ()
        while True:
            try:
                result = self.decoder.next_reply()  # type: ignore[attr-defined]
            except WireError as exc:
                raise DownstreamLost(f"downstream stage {self.peer} sent a malformed reply: {exc}") from exc
            if result is END_OF_STREAM:
                raise DownstreamLost(f"downstream stage {self.peer} closed the lane (stage lost)")
            if result is NEED_DATA:
                await self._fill()
            elif type(result) is StageReply:
                timings, self._timings = self._timings, None
                self._returned = True
                return result, timings
            elif type(result) is TimingsFrame:
                self._timings = result  # at most one precedes a reply; a second one replaces it
            elif type(result) is LogprobsFrame or type(result) is SamplingAcceptedFrame:
                self.annotations += (result,)  # docs/protocol.md §10: relayed with the reply
            else:
                assert isinstance(result, ErrorFrame)
                raise DownstreamError(result)


def write_failed(peer: str, *, downstream: bool) -> StageError:
    """The error for a failed write to ``peer`` (raise it ``from`` the trio error)."""
    if downstream:
        return DownstreamLost(f"downstream stage {peer} closed the lane (write failed)")
    return UpstreamLost(f"upstream {peer} closed the connection (write failed)")


async def send_frame(io: SocketIO, frame: bytes | memoryview, peer: str, *, downstream: bool) -> None:
    """Write one frame, mapping a broken stream to UpstreamLost / DownstreamLost."""
    try:
        await io.send_all(frame)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise write_failed(peer, downstream=downstream) from exc


async def connect_stage(address: Address, timeout: float, *, attempt_timeout: float = 2.0,
                        ready_timeout: float = 10.0, tls: ssl.SSLContext | None = None,
                        resolve: Callable[[], Address] | None = None) -> trio.abc.Stream:
    """Dial a stage and complete READY, retrying until ``timeout`` seconds have passed (with
    ``tls``, READY comes after a mutually authenticated TLS handshake: :mod:`skippy.net.tls`).
    ``resolve``: where to dial, asked again before every attempt (a launcher that re-wires the
    chain moves the address meanwhile); ``address`` is then only its first answer.

    Raises:
        DownstreamLost: the deadline passed; the message names the address and the last error.
    """
    deadline = trio.current_time() + timeout
    delay = 0.1
    last_error = "no attempt made"
    while True:
        if resolve is not None:
            address = resolve()
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            raise DownstreamLost(
                f"cannot reach downstream stage {address} within {timeout:g} s: {last_error}"
            )
        stream: trio.abc.Stream | None = None
        try:
            with trio.fail_after(min(attempt_timeout, remaining)):
                stream = await trio.open_tcp_stream(address.host, address.port)
                set_no_delay(stream)
                if tls is not None:
                    stream = await handshake_as_client(stream, tls, address.host)
            with trio.fail_after(min(ready_timeout, max(remaining, 0.01))):
                await receive_ready(stream, str(address))
            return stream
        except (OSError, trio.TooSlowError, DownstreamLost) as exc:  # refused / slow / no READY / TLS: retry
            last_error = str(exc) or type(exc).__name__
            if stream is not None:
                await trio.aclose_forcefully(stream)
        await trio.sleep(min(delay, max(0.0, deadline - trio.current_time())))
        delay = min(delay * 2, 0.5)


@dataclasses.dataclass(frozen=True, slots=True)
class WireCondition:
    """Simulated one-way delay and bandwidth of a downstream link (none by default)."""

    delay_s: float = 0.0
    bytes_per_s: float = math.inf

    @classmethod
    def from_settings(cls, delay_ms: float, mbps: float) -> "WireCondition":
        if not math.isfinite(delay_ms) or delay_ms < 0:
            raise ValueError(f"wire delay must be finite and >= 0 ms (got {delay_ms})")
        if not math.isfinite(mbps) or mbps < 0:
            raise ValueError(f"wire bandwidth must be finite and >= 0 Mbit/s (got {mbps})")
        return cls(delay_ms / 1000.0, mbps * 1e6 / 8 if mbps > 0 else math.inf)

    @property
    def active(self) -> bool:
        return self.delay_s > 0 or math.isfinite(self.bytes_per_s)

    async def write(self, io: SocketIO, frame: bytes, peer: str, enqueued_at: float) -> None:
        """Write ``frame`` as if it crossed the simulated link (``enqueued_at``: trio clock)."""
        if self.delay_s > 0:
            await trio.sleep_until(enqueued_at + self.delay_s)
        await send_frame(io, frame, peer, downstream=True)
        if math.isfinite(self.bytes_per_s):
            await trio.sleep(len(frame) / self.bytes_per_s)
