"""The machine's floor for a stage boundary: relay chains that do nothing but move the bytes.

Run: ``PYTHONPATH=. .venv/bin/python bench/boundary_floor.py [--rounds N]``.

Each chain is a client, ``n - 1`` relay processes and a final process on loopback, moving frames
of a 4096-wide f32 decode message (16464 bytes) down and 120-byte replies back, like a null-runtime
stage chain; ``(t3 - t1) / 2`` is the cost of one boundary, as in ``stage_chain.py``.  Three
relay shapes, each a floor for a layer of the stage server:

* ``blocking``: blocking sockets, one thread (the operating system's part: two wake-ups and four
  copies per boundary);
* ``trio, 1 task``: one trio task on non-blocking sockets parking in ``wait_readable``;
* ``trio, 2 tasks``: a task per direction, the shape of a stage lane's receive and relay tasks.

A stage adds the codec, its bookkeeping and the runtime call on top; compare the figures with
``stage_chain.py --null-only`` run in the same minutes (this host's figures drift).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import time
from typing import Callable

import trio

FRAME = 16464
REPLY = 120
TOKENS = 4000


def _listen(port: int) -> socket.socket:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    return listener


def _accept_and_dial(port: int, downstream: int | None, ready: Callable[[], None],
                     blocking: bool) -> tuple[socket.socket, socket.socket | None]:
    listener = _listen(port)
    ready()
    upstream, _ = listener.accept()
    listener.close()
    down = socket.create_connection(("127.0.0.1", downstream)) if downstream is not None else None
    for sock in (upstream, down):
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(blocking)
    return upstream, down


def _receive_exactly(sock: socket.socket, count: int, buffer: bytearray) -> None:
    view = memoryview(buffer)
    got = 0
    while got < count:
        received = sock.recv_into(view[got:count])
        if not received:
            raise EOFError
        got += received


async def _receive_exactly_trio(sock: socket.socket, count: int, buffer: bytearray) -> None:
    view = memoryview(buffer)
    got = 0
    while got < count:
        try:
            received = sock.recv_into(view[got:count])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            continue
        if not received:
            raise EOFError
        got += received


async def _send_all_trio(sock: socket.socket, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


def _stage(shape: str, port: int, downstream: int | None, ready: multiprocessing.synchronize.Event) -> None:
    upstream, down = _accept_and_dial(port, downstream, ready.set, blocking=shape == "blocking")
    frame, reply = bytearray(FRAME), bytearray(REPLY)
    answer = b"r" * REPLY
    try:
        if shape == "blocking":
            while True:
                _receive_exactly(upstream, FRAME, frame)
                if down is None:
                    upstream.sendall(answer)
                    continue
                down.sendall(frame)
                _receive_exactly(down, REPLY, reply)
                upstream.sendall(reply)
        trio.run(_trio_stage, shape, upstream, down, frame, reply, answer)
    except (EOFError, OSError):
        pass


async def _trio_stage(shape: str, upstream: socket.socket, down: socket.socket | None, frame: bytearray,
                      reply: bytearray, answer: bytes) -> None:
    async def downward() -> None:
        while True:
            await _receive_exactly_trio(upstream, FRAME, frame)
            if down is None:
                await _send_all_trio(upstream, answer)
                continue
            await _send_all_trio(down, frame)
            if shape == "trio1":
                await _receive_exactly_trio(down, REPLY, reply)
                await _send_all_trio(upstream, reply)

    async def upward() -> None:
        assert down is not None
        while True:
            await _receive_exactly_trio(down, REPLY, reply)
            await _send_all_trio(upstream, reply)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(downward)
            if shape == "trio2" and down is not None:
                nursery.start_soon(upward)
    except* (EOFError, OSError):
        pass


def chain_us_per_token(shape: str, stages: int, base_port: int) -> float:
    processes = []
    for index in reversed(range(stages)):
        ready = multiprocessing.Event()
        downstream = base_port + index + 1 if index < stages - 1 else None
        process = multiprocessing.Process(target=_stage, args=(shape, base_port + index, downstream, ready))
        process.start()
        ready.wait(10)
        processes.append(process)
    client = socket.create_connection(("127.0.0.1", base_port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    frame, reply = b"x" * FRAME, bytearray(REPLY)
    try:
        for _ in range(300):  # warm-up
            client.sendall(frame)
            _receive_exactly(client, REPLY, reply)
        started = time.perf_counter()
        for _ in range(TOKENS):
            client.sendall(frame)
            _receive_exactly(client, REPLY, reply)
        return (time.perf_counter() - started) / TOKENS * 1e6
    finally:
        client.close()
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = 46100
    names = {"blocking": "blocking", "trio1": "trio, 1 task", "trio2": "trio, 2 tasks"}
    for round_index in range(args.rounds):
        for shape, name in names.items():
            one = chain_us_per_token(shape, 1, port)
            three = chain_us_per_token(shape, 3, port + 10)
            port += 20
            print(f"round {round_index + 1}, {name}: 1 stage {one:.0f} us/token, 3 stages {three:.0f} us/token, "
                  f"per boundary {(three - one) / 2:.0f} us")


if __name__ == "__main__":
    main()
