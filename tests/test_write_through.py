"""Write-through (:mod:`skippy.stage.write_through`): the gate, partial writes, failures."""

from __future__ import annotations

import os
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
import trio

from skippy.lane.errors import DownstreamLost, StageError
from skippy.net.socket_io import SocketIO
from skippy.stage.executor import WorkResult
from skippy.stage.write_through import StreamGate, WriteThrough


@asynccontextmanager
async def _stream_pair(send_buffer: int = 0) -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    left, right = trio.socket.socketpair()
    if send_buffer:
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, send_buffer)
    async with trio.SocketStream(left) as writer, trio.SocketStream(right) as reader:
        yield writer, reader


def _waiting_bytes(stream: trio.SocketStream) -> bytes:
    """What the stream has to read now, without waiting (the writes here are the socket's, made
    before this returns: nothing is in flight)."""
    with socket.socket(fileno=os.dup(stream.socket.fileno())) as probe:
        try:
            return probe.recv(1 << 16, socket.MSG_DONTWAIT | socket.MSG_PEEK)
        except BlockingIOError:
            return b""


async def _read_exactly(stream: trio.SocketStream, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = await stream.receive_some(count - len(data))
        assert chunk, "stream closed early"
        data += chunk
    return data


async def test_a_write_the_socket_takes_whole_needs_no_trio_side_write() -> None:
    async with _stream_pair() as (writer, reader):
        sent: list[tuple[int, int]] = []
        through = WriteThrough(StreamGate(), SocketIO(writer, 0), lambda result, queue_us: b"frame:%d" % queue_us,
                               lambda sent_us, write_us: sent.append((sent_us, write_us)))
        through(WorkResult(), 7)
        assert through.written == len(b"frame:7") and len(sent) == 1 and sent[0][1] >= 0
        assert await through.finish("peer", downstream=True) == 0
        assert await _read_exactly(reader, 7) == b"frame:7"


async def test_the_rest_of_a_partial_write_is_written_by_finish() -> None:
    async with _stream_pair(send_buffer=4096) as (writer, reader):
        frame = bytes(range(256)) * 4096  # 1 MiB: far more than the socket buffers take at once
        through = WriteThrough(StreamGate(), SocketIO(writer, 0), lambda result, queue_us: frame)
        through(WorkResult(), 0)
        assert 0 < through.written < len(frame)
        received = bytearray()

        async def drain() -> None:
            received.extend(await _read_exactly(reader, len(frame)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await through.finish("peer", downstream=True)
        assert bytes(received) == frame


async def test_a_closed_gate_stops_the_write_and_finish_names_the_peer() -> None:
    async with _stream_pair() as (writer, reader):
        gate = StreamGate()
        gate.close()
        through = WriteThrough(gate, SocketIO(writer, 0), lambda result, queue_us: b"late")
        through(WorkResult(), 0)
        assert through.written == 0
        with pytest.raises(DownstreamLost, match="downstream stage 10.0.0.9:1 closed the lane"):
            await through.finish("10.0.0.9:1", downstream=True)
        assert _waiting_bytes(reader) == b"", "nothing may be written after the gate closed"


async def test_a_failed_build_or_missing_emit_is_reported() -> None:
    async with _stream_pair() as (writer, _):

        def refuse(result: WorkResult, queue_us: int) -> bytes:
            raise StageError("stage has a downstream but produced no activation")

        through = WriteThrough(StreamGate(), SocketIO(writer, 0), refuse)
        through(WorkResult(), 0)
        with pytest.raises(StageError, match="produced no activation"):
            await through.finish("peer", downstream=True)
        never_ran = WriteThrough(StreamGate(), SocketIO(writer, 0), refuse)
        with pytest.raises(StageError, match="without its write-through"):
            await never_ran.finish("peer", downstream=True)


async def test_a_reset_peer_is_a_lost_stream() -> None:
    async with _stream_pair() as (writer, reader):
        await reader.aclose()
        through = WriteThrough(StreamGate(), SocketIO(writer, 0), lambda result, queue_us: b"x" * 65536)
        through(WorkResult(), 0)
        through(WorkResult(), 0)  # the first write may still land in the buffer; the second sees the reset
        with pytest.raises(StageError, match="upstream peer closed the connection"):
            await through.finish("peer", downstream=False)
