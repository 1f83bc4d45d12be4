"""Frames over trio streams: READY, framed readers, the downstream dialer and wire conditions.

Strategy: the codec is sans-IO (:mod:`skippy.wire`); this module is the only place that moves its
bytes over sockets.  A reader owns one decoder and one stream and turns ``receive_some`` chunks
into whole frames (``None`` at a clean end of stream).  trio's stream errors are mapped here, at
the transport boundary, to :class:`~skippy.stage.errors.StageError` /
:class:`~skippy.stage.errors.DownstreamLost` with the peer's address in the message, so the
connection logic above never sees ``BrokenResourceError`` and a log line always names the peer.
``WireCondition`` simulates a slower link on downstream writes: the one-way delay counts from
when a frame was enqueued (queued frames overlap their delays, as on a real pipe), then the
bandwidth is modelled by sleeping for the frame's serialisation time after the write.
"""

from __future__ import annotations

import dataclasses
import math
import socket

import trio

from skippy import wire as codec

from skippy.protocol import (
    END_OF_STREAM,
    NEED_DATA,
    READY_BYTES,
    StageMessage,
    StageReply,
    WireError,
    check_ready,
)
from skippy.stage.config import Address
from skippy.stage.errors import DownstreamLost, StageError

__all__ = [
    "MessageReader", "ReplyReader", "WireCondition", "codec", "connect_stage", "receive_ready",
    "send_ready",
]

#: Largest chunk read from a socket at once.
RECEIVE_CHUNK = 1 << 20


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
    def __init__(self, stream: trio.abc.ReceiveStream, peer: str, decoder: object) -> None:
        self.stream = stream
        self.peer = peer
        self.decoder = decoder

    async def _fill(self) -> None:
        try:
            data = await self.stream.receive_some(RECEIVE_CHUNK)
        except (trio.BrokenResourceError, trio.ClosedResourceError):  # a reset reads as end of stream
            data = b""
        self.decoder.receive_data(data)  # type: ignore[attr-defined]


class MessageReader(_Reader):
    """Whole :class:`StageMessage` frames from an upstream stream.

    Raises (from :meth:`next`):
        StageError: a malformed, unknown or truncated frame (the codec's reason is kept).
    """

    def __init__(self, stream: trio.abc.ReceiveStream, peer: str, width: int) -> None:
        super().__init__(stream, peer, codec.MessageDecoder(width))

    async def next(self) -> StageMessage | None:
        """The next message, or None when the peer closed the stream between frames."""
        while True:
            try:
                result = self.decoder.next_message()  # type: ignore[attr-defined]
            except WireError as exc:
                raise StageError(f"malformed frame from {self.peer}: {exc}") from exc
            if result is END_OF_STREAM:
                return None
            if result is not NEED_DATA:
                assert isinstance(result, StageMessage)
                return result
            await self._fill()


class ReplyReader(_Reader):
    """Whole :class:`StageReply` frames from a downstream stream.

    Raises (from :meth:`next`):
        DownstreamLost: the downstream closed the lane or sent a malformed reply.
    """

    def __init__(self, stream: trio.abc.ReceiveStream, peer: str) -> None:
        super().__init__(stream, peer, codec.ReplyDecoder())

    async def next(self) -> StageReply:
        """The next reply.

        Raises:
            DownstreamLost: end of stream (the downstream stage is gone) or a malformed reply.
        """
        while True:
            try:
                result = self.decoder.next_reply()  # type: ignore[attr-defined]
            except WireError as exc:
                raise DownstreamLost(f"downstream stage {self.peer} sent a malformed reply: {exc}") from exc
            if result is END_OF_STREAM:
                raise DownstreamLost(f"downstream stage {self.peer} closed the lane (stage lost)")
            if result is not NEED_DATA:
                assert isinstance(result, StageReply)
                return result
            await self._fill()


async def send_frame(stream: trio.abc.SendStream, frame: bytes, peer: str, *, downstream: bool) -> None:
    """Write one frame, mapping a broken stream to StageError / DownstreamLost."""
    try:
        await stream.send_all(frame)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        if downstream:
            raise DownstreamLost(f"downstream stage {peer} closed the lane (write failed)") from exc
        raise StageError(f"upstream {peer} closed the connection (write failed)") from exc


def _no_delay(stream: trio.SocketStream) -> None:
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


async def connect_stage(address: Address, timeout: float, *, attempt_timeout: float = 2.0,
                        ready_timeout: float = 10.0) -> trio.SocketStream:
    """Dial a stage and complete READY, retrying until ``timeout`` seconds have passed.

    Raises:
        DownstreamLost: the deadline passed; the message names the address and the last error.
    """
    deadline = trio.current_time() + timeout
    delay = 0.1
    last_error = "no attempt made"
    while True:
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            raise DownstreamLost(
                f"cannot reach downstream stage {address} within {timeout:g} s: {last_error}"
            )
        stream: trio.SocketStream | None = None
        try:
            with trio.fail_after(min(attempt_timeout, remaining)):
                stream = await trio.open_tcp_stream(address.host, address.port)
            _no_delay(stream)
            with trio.fail_after(min(ready_timeout, max(remaining, 0.01))):
                await receive_ready(stream, str(address))
            return stream
        except (OSError, trio.TooSlowError, DownstreamLost) as exc:  # refused / slow / no READY: retry
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

    async def write(self, stream: trio.abc.SendStream, frame: bytes, peer: str, enqueued_at: float) -> None:
        """Write ``frame`` as if it crossed the simulated link (``enqueued_at``: trio clock)."""
        if self.delay_s > 0:
            await trio.sleep_until(enqueued_at + self.delay_s)
        await send_frame(stream, frame, peer, downstream=True)
        if math.isfinite(self.bytes_per_s):
            await trio.sleep(len(frame) / self.bytes_per_s)
