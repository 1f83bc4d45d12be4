"""One decode's walk through a middle stage: how many times it changes room (socket in -> frame out).

Run: ``PYTHONPATH=. .venv/bin/python bench/lane_rooms.py [--decodes 6] [--show] [--no-relay]``.

A *room* is one of skippy's source files; the walk is the sequence of skippy files whose Python
code runs, on any thread, between the moment a DecodeEmbd is written to the middle stage's
upstream socket and the moment its forwarded frame arrives downstream.  Every call into another
file, and every return into a different one, is a room change (library code in between -- trio,
the standard library -- is the corridor and is not counted; a C extension such as the Cython wire
codec or the decode relay's loop runs no Python and is not seen).

The stage under test is layers 1:3 of the generated tiny llama (the model the tests use, made on
first use), one thread, in this process; its upstream and downstream peers are plain blocking
sockets on threads of their own, which are not traced.  Two paths: hop by hop (the decode expects a
PredictedToken back, which the fake downstream sends; its *reply leg*, from the downstream's
reply written to this stage's answer read upstream, is walked too) and direct return (flagged:
nothing comes back).  After the first decode of either path the data plane, the ``nogil`` relay,
carries the next ones; ``--no-relay`` turns it off (the lane's Python path, as before it carried
hop-by-hop decodes).  Each decode after the first is walked; the shortest walk is reported (a
longer one picked up other work in its window), ``--show`` prints it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path and not any(Path(entry, "skippy").is_dir() for entry in sys.path if entry):
    sys.path.insert(0, str(ROOT))

from skippy.codec.protocol import (  # noqa: E402
    END_OF_STREAM, NEED_DATA, READY_BYTES, MessageKind, StageMessage, StageReply, WireDType,
)
from skippy.codec.protocol_ext import DIRECT_RETURN_FLAG, SKIPPY_EXTENSIONS_FLAG  # noqa: E402
from skippy.models.cache import ensure_model  # noqa: E402
from skippy.models.spec import tiny  # noqa: E402
from skippy.net.address import Address  # noqa: E402
from skippy.stage.config import config_from_mapping  # noqa: E402
from skippy.stage.server import StageServer, load_runtime  # noqa: E402
from skippy.stage.transport import codec  # noqa: E402

SKIPPY = str(Path(sys.modules["skippy"].__file__ or "").parent)  # the skippy imported (PYTHONPATH's)
PROMPT = 6


class Walk:
    """The skippy code that ran (profiler events of the traced threads), with timestamps."""

    def __init__(self) -> None:
        self.events: list[tuple[int, bool, str, str]] = []  # (ns, a call?, file, function)

    def __call__(self, frame: Any, event: str, arg: object) -> None:
        if event == "call":
            code = frame.f_code
        elif event == "return" and frame.f_back is not None:
            frame = frame.f_back  # back in the caller's room
            code = frame.f_code
        else:
            return
        if code.co_filename.startswith(SKIPPY):
            self.events.append((time.perf_counter_ns(), event == "call", code.co_filename[len(SKIPPY) + 1:],
                                code.co_name))

    def rooms(self, start_ns: int, end_ns: int) -> list[tuple[str, str, bool]]:
        """The (file, function, entered by a call) sequence between two instants, one entry per
        room visited in turn."""
        walk: list[tuple[str, str, bool]] = []
        for when, call, path, name in self.events:
            if start_ns <= when <= end_ns and (not walk or walk[-1][0] != path):
                walk.append((path, name, call))
        return walk


def _message(kind: MessageKind, position: int, count: int, width: int, flags: int = 0) -> bytes:
    activation = np.linspace(-1, 1, count * width, dtype=np.float32).reshape(count, width)
    message = StageMessage.create(kind, pos_start=position, token_count=count, session_id=1,
                                  tokens=np.arange(1, count + 1, dtype=np.int32), activation=activation,
                                  state_changes={"source_stage_index": 0, "current_token": count})
    if flags:
        import dataclasses
        message = dataclasses.replace(message, state=dataclasses.replace(message.state,
                                                                          flags=message.state.flags | flags))
    return codec.encode_message(message, WireDType.F32, width)


class FakeDownstream(threading.Thread):
    """The next stage: answers a PredictedToken to a predicted kind, an ACK to any other, nothing
    to a direct-return message; notes when each decode frame arrived."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = Address("127.0.0.1", self.listener.getsockname()[1])
        self.decode_arrivals: list[int] = []
        self.replies_sent: list[int] = []  #: when each decode's reply was written
        self.width = 0  #: the activation width (set once the stage is loaded)

    def run(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed: the bench is over
                return
            threading.Thread(target=self.serve, args=(connection,), daemon=True).start()

    def serve(self, connection: socket.socket) -> None:
        connection.sendall(READY_BYTES)
        decoder = codec.MessageDecoder(width=self.width)
        with connection:
            while data := connection.recv(1 << 20):
                decoder.receive_data(data)
                while (message := decoder.next_message()) is not NEED_DATA and message is not END_OF_STREAM:
                    if message.kind is MessageKind.DECODE_EMBD:
                        self.decode_arrivals.append(time.perf_counter_ns())
                    if message.state.flags & DIRECT_RETURN_FLAG:
                        continue
                    if message.kind in (MessageKind.DECODE_EMBD, MessageKind.PREFILL_FINAL_EMBD):
                        if message.kind is MessageKind.DECODE_EMBD:
                            self.replies_sent.append(time.perf_counter_ns())
                        connection.sendall(codec.encode_reply(StageReply.predicted_token(7)))
                    else:
                        connection.sendall(codec.encode_reply(StageReply.ack()))


def drive(address: Address, width: int, decodes: int, flags: int, downstream: FakeDownstream
          ) -> tuple[list[int], list[int]]:
    """The upstream stage: configure, prefill, then ``decodes`` decodes; the send instants, and
    (hop by hop) when each answer was read."""
    sent: list[int] = []
    answered: list[int] = []
    with socket.create_connection((address.host, address.port), timeout=10) as stream:
        assert stream.recv(4) == READY_BYTES
        decoder = codec.ReplyDecoder(extensions=True)

        def answer() -> None:
            while True:
                reply = decoder.next_reply()
                if isinstance(reply, StageReply):
                    return
                if reply is NEED_DATA:
                    decoder.receive_data(stream.recv(1 << 16))

        configure = StageMessage.create(MessageKind.CONFIGURE_GENERATION, session_id=1)
        stream.sendall(codec.encode_message(configure, WireDType.F32, width))
        answer()
        stream.sendall(_message(MessageKind.PREFILL_FINAL_EMBD, 0, PROMPT, width, SKIPPY_EXTENSIONS_FLAG))
        answer()
        for step in range(decodes):
            arrived = len(downstream.decode_arrivals)
            sent.append(time.perf_counter_ns())
            stream.sendall(_message(MessageKind.DECODE_EMBD, PROMPT + step, 1, width, SKIPPY_EXTENSIONS_FLAG | flags))
            if flags & DIRECT_RETURN_FLAG:
                while len(downstream.decode_arrivals) == arrived:
                    time.sleep(0.0005)
                    if time.perf_counter_ns() - sent[-1] > 10_000_000_000:
                        raise TimeoutError("the decode never reached the downstream")
            else:
                answer()
                answered.append(time.perf_counter_ns())
            time.sleep(0.02)  # the stage settles between decodes (the walk ends at the next send)
        stop = StageMessage.stop(session_id=1)
        stream.sendall(codec.encode_message(stop, WireDType.F32, width))
        answer()
    return sent, answered


Rooms = list[tuple[str, str, bool]]


async def walk_of(model: Path, decodes: int, flags: int, relay: bool) -> tuple[list[Rooms], list[Rooms]]:
    """The walks of each decode after the first: socket in -> frame out, and (hop by hop) the
    reply leg, downstream's reply written -> answer read upstream."""
    downstream = FakeDownstream()
    downstream.start()
    config = config_from_mapping({"model": str(model), "layers": "1:3", "downstream": downstream.address,
                                  "ctx_size": 256, "batch_size": 64, "connect_timeout": 2, "threads": 1,
                                  "decode_relay": relay})
    server = StageServer(config, load_runtime(config))
    downstream.width = server.settings.width
    walk = Walk()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve)
        await server.scheduler.call(lambda: sys.setprofile(walk))  # the runtime thread
        sys.setprofile(walk)  # the trio thread
        try:
            sent, answered = await trio.to_thread.run_sync(drive, address, server.settings.width, decodes, flags,
                                                           downstream)
        finally:
            sys.setprofile(None)
            await server.scheduler.call(lambda: sys.setprofile(None))
        server.shutdown()
    downstream.listener.close()
    arrivals = downstream.decode_arrivals[-len(sent):]
    replied = downstream.replies_sent[-len(answered):] if answered else []
    return ([walk.rooms(start, end) for start, end in zip(sent[1:], arrivals[1:])],  # (the first: a new path)
            [walk.rooms(start, end) for start, end in zip(replied[1:], answered[1:])])


def report(name: str, walks: list[Rooms], show: bool) -> None:
    rooms = min(walks, key=len)  # the steady walk (a longer one picked up other work: a tick, a timer)
    print(f"{name}: room changes per decode {sorted(max(0, len(walk) - 1) for walk in walks)}; the shortest:")
    files = sorted({path for path, _, _ in rooms})
    calls = sum(call for _, _, call in rooms[1:])
    lane = sum(path == "stage/connection.py" for path, _, _ in rooms)
    print(f"{name}: {max(0, len(rooms) - 1)} room changes ({calls} of them calls into another file, "
          f"stage/connection.py entered {lane} times) over {len(files)} files: {', '.join(files)}")
    if show:
        for path, function, call in rooms:
            print(f"    {'->' if call else '<-'} {path}:{function}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--decodes", type=int, default=6)
    parser.add_argument("--show", action="store_true", help="print each walk")
    parser.add_argument("--no-relay", action="store_true", help="the lane's Python path (no data plane)")
    args = parser.parse_args()
    model = ensure_model(tiny("llama"))
    for name, flags in (("hop by hop", 0), ("direct return", DIRECT_RETURN_FLAG)):
        walks, reply_walks = trio.run(walk_of, model, args.decodes, flags, not args.no_relay)
        report(name, walks, args.show)
        if reply_walks:
            report(f"{name}, reply leg", reply_walks, args.show)


if __name__ == "__main__":
    main()
