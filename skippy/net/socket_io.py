"""Non-blocking socket I/O on trio streams, for the stage's lanes and the driver's client alike.

Strategy: :class:`SocketIO` tries the non-blocking ``readv`` / ``write`` on the socket's descriptor
first, into one reusable receive buffer, and parks in trio (``wait_readable`` /
``wait_writable``) only when the socket would block; the stream keeps owning the descriptor.
Streams that are not sockets (memory streams in tests) fall back to ``receive_some`` /
``send_all``.  Why (measured): :mod:`skippy.stage.transport`, which frames stage traffic over it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import trio

__all__ = ["SocketIO", "set_no_delay"]


#: Largest chunk read from a socket at once (the size of each reader's reusable buffer).
RECEIVE_CHUNK = 1 << 18
#: A reader's first buffer (grown to its full size when a read fills it).
FIRST_CHUNK = 1 << 12


class SocketIO:
    """Non-blocking reads and writes on a stream's socket, parking in trio only when it would block.

    Args:
        stream: the stream; it keeps owning (and closing) the socket.
        receive_size: the reusable receive buffer's size (0 for a write-only user).

    ``send_now`` writes what the socket takes without waiting; ``send_all`` completes a frame.
    Errors are reported as trio's: ``BrokenResourceError`` (reset, broken pipe) and
    ``ClosedResourceError`` (the stream was closed), so callers map them as for any trio stream.
    """

    __slots__ = ("stream", "_socket", "_buffer", "_view", "_drained", "_receive_size", "bytes_in", "bytes_out")

    def __init__(self, stream: trio.abc.Stream, receive_size: int = RECEIVE_CHUNK) -> None:
        self.stream = stream
        self._socket: Any = stream.socket if isinstance(stream, trio.SocketStream) else None
        #: The buffer starts small and grows to ``receive_size`` once a read fills it: an idle
        #: or slow lane pins a few KiB, not a full chunk.
        self._receive_size = receive_size
        self._buffer = bytearray()  # allocated when the first bytes are there to read
        self._view = memoryview(self._buffer)
        #: The last read came back short, so the socket was empty then: wait before reading.
        #: (True at first: a new lane waits for its first bytes without a buffer.)
        self._drained = self._socket is not None
        #: Bytes received and sent through this object (the stage's per-lane metrics).
        self.bytes_in = 0
        self.bytes_out = 0

    async def receive(self) -> memoryview | bytes | bytearray:
        """The next chunk of bytes (valid until the next call); empty at end of stream.

        A reset or a stream closed under the reader also reads as end of stream.
        """
        if self._socket is None:
            try:
                # a TLS record holds at most 16 KiB: asking for more only allocates more per read
                data = await self.stream.receive_some(min(self._receive_size, 1 << 14))
                self.bytes_in += len(data)
                return data
            except (trio.BrokenResourceError, trio.ClosedResourceError):  # a reset reads as end of stream
                return b""
        while True:
            if self._drained:  # skip the read that would fail: park until the socket is readable
                self._drained = False
                try:
                    await trio.lowlevel.wait_readable(self._socket)
                except trio.ClosedResourceError:  # closed by another task: end of stream
                    return b""
            fd = self._socket.fileno()
            if fd < 0:  # the stream was closed
                return b""
            if not self._buffer:
                self._buffer = bytearray(min(self._receive_size, FIRST_CHUNK))
                self._view = memoryview(self._buffer)
            try:
                count = os.readv(fd, (self._buffer,))
            except BlockingIOError:  # nothing buffered yet: wait, then read again
                self._drained = True
                continue
            except InterruptedError:  # a signal arrived mid-call: retry
                continue
            except OSError:  # reset, or the descriptor went away: end of stream
                return b""
            view = self._view[:count]
            self._drained = count < len(self._buffer)
            self.bytes_in += count
            if not self._drained and count < self._receive_size:  # full: grow for the next read
                self._buffer = bytearray(self._receive_size)
                self._view = memoryview(self._buffer)
            return view

    def fileno(self) -> int:
        """The socket's descriptor (-1 when closed or not a socket): the decode relay reads or
        writes it directly while the lane waits for it."""
        return self._socket.fileno() if self._socket is not None else -1

    def mark_drained(self) -> None:
        """Someone else read the socket: wait for readability before the next read."""
        self._drained = self._socket is not None

    @property
    def is_socket(self) -> bool:
        """Whether the stream is a socket (non-blocking writes from another thread are possible)."""
        return self._socket is not None

    def send_now(self, data: bytes | memoryview) -> int:
        """Write as much of ``data`` as the socket takes now; returns the byte count (may be 0).

        Raises:
            trio.BrokenResourceError: the peer reset the connection or the pipe is broken.
            trio.ClosedResourceError: the stream is not a socket (use :meth:`send_all`).
        """
        fd = self._socket.fileno() if self._socket is not None else -1
        if fd < 0:
            raise trio.ClosedResourceError("the stream is closed (or not a socket stream)")
        try:
            written = os.write(fd, data)
        except (BlockingIOError, InterruptedError):  # full (or interrupted): nothing written now
            return 0
        except OSError as exc:  # reset / broken pipe / closed descriptor
            raise trio.BrokenResourceError(str(exc)) from exc
        self.bytes_out += written
        return written

    async def send_all(self, data: bytes | memoryview) -> None:
        """Write all of ``data`` (one call per frame), parking only while the socket is full.

        Raises:
            trio.BrokenResourceError / trio.ClosedResourceError: as ``SocketStream.send_all``.
        """
        if self._socket is None:
            await self.stream.send_all(data)
            self.bytes_out += len(data)
            return
        sent = self.send_now(data)
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        while view:
            await trio.lowlevel.wait_writable(self._socket)
            view = view[self.send_now(view):]


def set_no_delay(stream: trio.abc.Stream) -> None:
    """TCP_NODELAY on a socket stream (trio sets it too; frames are whole, so Nagle only delays)."""
    if isinstance(stream, trio.SocketStream):
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
