"""Stage server behaviour with the null runtime, in this trio run: ordering, credits, faults.

These tests are about the server (framing, replies, credits, sessions, failures), so the stages
compute nothing: a chain of null stages answers token ``t`` with ``t + 1`` (see
``skippy/runtime/null.py``).  Real models and processes are in ``test_stage_chain.py``.

Every test runs twice, with the lane's shortcuts (write-through, inline hand-offs) on and off
(the ``shortcuts`` fixture), and in virtual time (``virtual_time``): a sleep here costs no real time.
``test_shortcuts_change_no_byte`` runs one scripted exchange under each combination and compares
what the client and the next stage receive.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import struct
from typing import Iterator

import numpy as np
import pytest
import trio
from trio.testing import MockClock

from skippy.codec.protocol import MessageKind, ReplyKind, StageMessage, StageReply, WireDType
from skippy.driver import StageClient, StageClientError, StageLost
from skippy.stage.server import StageServer
from skippy.stage.transport import codec, send_ready

from stage_helpers import inprocess_chain

WIDTH = 8


@pytest.fixture
def virtual_time() -> MockClock:
    """Trio's clock jumps to the next timeout once every task has waited 10 ms of real time with
    nothing to do: a sleep or a timeout here costs no real time, and a sleep before a check ends
    only when the stages have done all they could.  (Not 0: the sockets are real, and the clock
    must not jump while bytes are in flight, trio.testing.MockClock.)

    pytest-trio hands trio.run a clock that the *test function* takes as an argument, never one
    that a fixture takes: every async test here takes this one (``shortcuts`` checks it)."""
    return MockClock(autojump_threshold=0.01)


@pytest.fixture(autouse=True, params=["shortcuts-on", "shortcuts-off"])
def shortcuts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Run the test with both lane shortcuts on, then off (every StageServer it starts)."""
    if inspect.iscoroutinefunction(request.function):
        assert "virtual_time" in inspect.signature(request.function).parameters, \
            f"{request.function.__name__} must take virtual_time itself to run in virtual time"
    on = request.param == "shortcuts-on"
    _with_shortcuts(monkeypatch, write_through=on, inline_hand_offs=on)
    yield on


def _with_shortcuts(monkeypatch: pytest.MonkeyPatch, **switches: bool) -> None:
    original = StageServer.__init__

    def init(self: StageServer, config: object, executor: object) -> None:
        original(self, dataclasses.replace(config, **switches), executor)  # type: ignore[type-var, arg-type]

    monkeypatch.setattr(StageServer, "__init__", init)


async def test_the_tests_here_run_in_virtual_time(virtual_time: MockClock) -> None:
    assert trio.lowlevel.current_clock() is virtual_time


async def test_chain_of_null_stages_answers_in_order(virtual_time: MockClock, shortcuts: bool) -> None:
    async with inprocess_chain(["0:1", "1:3", "3:4"]) as servers:
        async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
            tokens = await client.generate_greedy(7, list(range(1, 30)), 5, chunk_size=8)
            assert tokens == [30, 31, 32, 33, 34]
            reply = await client.verify(8, [5, 6, 7], 0, window_id=42)
            assert reply.predicted_tokens == (6, 7, 8) and reply.window_id == 42
            assert reply.stats.verify_window_stage_count == 3
            await client.retire(8, 0, 3)
            assert (await client.stop(8)).kind == ReplyKind.ACK
        await trio.sleep(0.05)
        for server in servers:
            assert server.stats.connection_errors == 0
            assert server.executor.session_count == 0
        # the 4 decodes went out by write-through on every stage, the verify window on the two
        # that forward it (a final stage answers verify windows on the trio side)
        assert [server.stats.write_throughs for server in servers] == ([5, 5, 4] if shortcuts else [0, 0, 0])


async def test_prefix_cache_kinds_are_misses_and_trim_is_acked(virtual_time: MockClock) -> None:
    async with inprocess_chain(["0:2", "2:4"]) as servers:
        async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
            await client.prefill(1, [1, 2, 3, 4])
            probe = StageMessage.create(MessageKind.PROBE_PREFILL, token_count=2, session_id=1,
                                        tokens=np.asarray([1, 2], dtype=np.int32))
            reply = await client.request(probe, ReplyKind.ACK)
            assert reply.stats.kv_lookup_misses == 1
            assert (await client.trim(1, 2)).kind == ReplyKind.ACK
            # the trimmed session continues from position 2 on every stage
            assert (await client.decode(1, 9, 2)).predicted == 10
            await client.stop(1)


async def test_decode_behind_the_kv_trims_it_first(virtual_time: MockClock) -> None:
    async with inprocess_chain(["0:2", "2:4"]) as servers:
        async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
            await client.prefill(1, [1, 2, 3])
            for position, token in ((3, 4), (4, 5), (5, 6)):
                await client.decode(1, token, position)
            reply = await client.decode(1, 50, 3)  # the coordinator rejected positions 3..5
            assert reply.predicted == 51
            for server in servers:
                assert server.stats.auto_aligns == 1 and server.stats.trimmed_tokens == 3
            with pytest.raises(StageLost):  # a gap (position ahead of the KV) is refused
                await client.decode(1, 7, 9)


class RecordingDownstream:
    """A fake final stage: READY, then ACKs slowly, recording how many early-ACKed chunks are pending."""

    def __init__(self) -> None:
        self.max_outstanding = 0
        self.kinds: list[int] = []

    async def serve(self, stream: trio.SocketStream) -> None:
        await send_ready(stream)
        decoder = codec.MessageDecoder(WIDTH)
        received = 0
        acked = 0
        async with trio.open_nursery() as nursery:
            send, receive = trio.open_memory_channel[StageMessage](100)

            async def answer() -> None:
                nonlocal acked
                async for message in receive:
                    await trio.sleep(0.02)
                    if message.kind is MessageKind.PREFILL_FINAL_EMBD:
                        reply = StageReply.predicted_token(99)
                    else:
                        reply = StageReply.ack()
                        acked += 1
                    await stream.send_all(codec.encode_reply(reply))

            nursery.start_soon(answer)
            while True:
                data = await stream.receive_some(1 << 16)
                decoder.receive_data(data)
                while True:
                    message = decoder.next_message()
                    if not isinstance(message, StageMessage):
                        break
                    received += message.kind is MessageKind.PREFILL_EMBD
                    self.kinds.append(int(message.kind))
                    self.max_outstanding = max(self.max_outstanding, received - acked)
                    await send.send(message)
                if not data:
                    send.close()
                    return


async def test_credit_limit_bounds_unacknowledged_chunks(virtual_time: MockClock) -> None:
    downstream = RecordingDownstream()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, downstream.serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        from stage_helpers import config_from_mapping, load_runtime, StageServer

        config = config_from_mapping({"model": "null:n_embd=8,n_layer=4", "layers": "0:2",
                                      "downstream": f"127.0.0.1:{port}", "reply_credit_limit": 2})
        server = StageServer(config, load_runtime(config))
        address = await nursery.start(server.serve)
        async with await StageClient.connect(address) as client:
            result = await client.prefill(1, list(range(1, 33)), chunk_size=8, credit=4)
            assert result.token == 99 and len(result.acks) == 3
        # (kind 20 first: the stage's model-identity query, docs/protocol.md §9, on its own connection)
        assert [kind for kind in downstream.kinds if kind != 20][:4] == [1, 1, 1, 4]
        assert downstream.max_outstanding <= 2
        assert server.stats.max_pending_prefill_acks == 2
        server.shutdown()
        nursery.cancel_scope.cancel()


def _frame(kind: int, *, source: int = -1, token_count: int = 1, tokens: int = 1, extra: bytes = b"") -> bytes:
    header = struct.pack("<5i10i2Q", kind, 0, token_count, tokens, 0, 11, 0, 1, 0, 0, 0, -1, 5, source, 0, 0, 3)
    return header + struct.pack(f"<{tokens}i", *([5] * tokens)) + extra


@pytest.mark.parametrize(
    "case, frame, reason",
    [
        ("garbage", b"\xff" * 80, "unknown stage message kind"),
        ("unknown kind", _frame(10), "unknown stage message kind"),
        ("truncated", _frame(1)[:50], "failed to fill whole buffer"),
        ("wrong width", _frame(2, source=0, extra=b"\0" * 4 * (WIDTH // 2)), "failed to fill whole buffer"),
        ("state import", StageMessage.create(MessageKind.STATE_IMPORT, token_count=2, raw_bytes=b"ab"), "refused"),
        ("kind mismatch", _frame(2), "does not match message kind"),
    ],
)
async def test_bad_frame_closes_only_its_connection(virtual_time: MockClock, case: str, frame: object, reason: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="skippy.stage")
    async with inprocess_chain(["0:2", "2:4"]) as servers:
        target = servers[1] if case == "wrong width" else servers[0]
        async with await StageClient.connect(servers[0].address) as good:  # type: ignore[arg-type]
            await good.configure(1)
            await good.prefill(1, [1, 2, 3])
            bad = await StageClient.connect(target.address)  # type: ignore[arg-type]
            if isinstance(frame, StageMessage):
                await bad.send(frame)
            else:
                await bad.send_raw(frame)
                if case in ("truncated", "wrong width"):
                    await bad.stream.send_eof()
            with pytest.raises(StageLost):
                await bad.receive()
            await bad.aclose()
            # the parallel session on the same stage carries on
            assert (await good.decode(1, 3, 3)).predicted == 4
            await good.stop(1)
        await trio.sleep(0.05)
        assert target.stats.connection_errors == 1
        assert target.executor.session_count == 0
    assert any(reason in record.getMessage() and "closing lane" in record.getMessage() for record in caplog.records)


async def test_lost_downstream_fails_the_client_fast_and_stage_keeps_serving(virtual_time: MockClock,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="skippy.stage")
    async with trio.open_nursery() as outer:
        async with inprocess_chain(["0:2", "2:4"]) as servers:
            first = servers[0]
            async with await StageClient.connect(first.address) as client:  # type: ignore[arg-type]
                await client.prefill(1, [1, 2, 3])
                servers[1].shutdown()  # the final stage goes away
                await trio.sleep(0.3)
                with trio.fail_after(2):
                    with pytest.raises(StageLost, match="first stage"):
                        await client.decode(1, 3, 3)
            await trio.sleep(0.05)
            assert first.stats.connections_open == 0 and first.executor.session_count == 0
        outer.cancel_scope.cancel()


async def test_downstream_unreachable_is_a_clear_error(virtual_time: MockClock,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="skippy.stage")
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with inprocess_chain(["0:2"], model="null:n_embd=8,n_layer=4",
                               downstream=f"127.0.0.1:{port}", connect_timeout=0.3) as servers:
        async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
            with pytest.raises(StageLost):
                await client.configure(1)
    assert any("cannot reach downstream stage" in r.getMessage() for r in caplog.records)


async def test_many_sessions_return_to_idle(virtual_time: MockClock) -> None:
    async with inprocess_chain(["0:2", "2:4"], max_sessions=4) as servers:
        for batch in range(20):
            async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
                for session in range(10):
                    await client.prefill(session + 1, [1, 2, 3])
                    await client.decode(session + 1, 3, 3)
                    if session % 2 == 0:
                        await client.stop(session + 1)
                    else:
                        await client.trim(session + 1, 0)
                        await client.stop(session + 1)
        await trio.sleep(0.05)
        for server in servers:
            await server.refresh_runtime_stats()
            assert server.stats.sessions_in_use == 0
            assert server.stats.kv_cells_used == 0
            assert server.stats.connections_open == 0
            assert server.stats.connection_errors == 0


async def test_concurrent_decodes_share_a_batch(virtual_time: MockClock) -> None:
    async with inprocess_chain(["0:2", "2:4"], batch_window_ms=5) as servers:
        async def session(number: int) -> None:
            async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
                tokens = await client.generate_greedy(number, [number, number + 1], 6)
                assert tokens == [number + 2 + i for i in range(6)]

        async with trio.open_nursery() as nursery:
            for number in range(1, 9):
                nursery.start_soon(session, number)
        assert servers[0].stats.max_decode_batch > 1


async def test_client_reports_unexpected_reply_kind(virtual_time: MockClock) -> None:
    async with inprocess_chain(["0:4"]) as servers:
        async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
            message = StageMessage.create(MessageKind.PREFILL_FINAL_EMBD, token_count=1, session_id=1,
                                          tokens=np.asarray([3], dtype=np.int32))
            with pytest.raises(StageClientError, match="answered PredictedToken"):
                await client.request(message, ReplyKind.ACK)


def test_wire_dtype_default_is_f32() -> None:
    from skippy.stage.config import StageConfig

    assert StageConfig(model="m", layers="0:1").wire_dtype is WireDType.F32


class SlowDownstream:
    """A fake final stage: READY, then answers every frame in order after ``delay`` seconds."""

    def __init__(self, delay: float = 0.05, extra_reply: bool = False) -> None:
        self.delay = delay
        self.extra_reply = extra_reply

    async def serve(self, stream: trio.SocketStream) -> None:
        await send_ready(stream)
        decoder = codec.MessageDecoder(WIDTH)
        while True:
            data = await stream.receive_some(1 << 16)
            decoder.receive_data(data)
            while isinstance(message := decoder.next_message(), StageMessage):
                await trio.sleep(self.delay)
                if message.kind is MessageKind.VERIFY_WINDOW:
                    reply = StageReply.predicted_token_vector((7, 8), window_id=message.state.seq_id)
                else:
                    reply = StageReply.ack()
                await stream.send_all(codec.encode_reply(reply))
                if self.extra_reply:  # a reply to a frame that was never sent
                    await stream.send_all(codec.encode_reply(StageReply.ack()))
            if not data:
                return


async def _stage_before(downstream: SlowDownstream, nursery: trio.Nursery) -> object:
    listeners = await nursery.start(functools.partial(trio.serve_tcp, downstream.serve, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    from stage_helpers import config_from_mapping, load_runtime, StageServer

    config = config_from_mapping({"model": "null:n_embd=8,n_layer=4", "layers": "0:2",
                                  "downstream": f"127.0.0.1:{port}"})
    server = StageServer(config, load_runtime(config))
    await nursery.start(server.serve)
    return server


async def test_an_early_ack_waits_for_the_reply_ahead_of_it(virtual_time: MockClock) -> None:
    # The verify window's reply is written directly (idle lane) but only after the slow
    # downstream answers; the chunk's early ACK, ready at once, must still come second.
    async with trio.open_nursery() as nursery:
        server = await _stage_before(SlowDownstream(), nursery)
        async with await StageClient.connect(server.address) as client:  # type: ignore[attr-defined]
            verify = StageMessage.create(MessageKind.VERIFY_WINDOW, pos_start=0, token_count=2, session_id=1,
                                         tokens=np.asarray([5, 6], dtype=np.int32), state_changes={"seq_id": 42})
            chunk = StageMessage.create(MessageKind.PREFILL_EMBD, pos_start=2, token_count=2, session_id=1,
                                        tokens=np.asarray([7, 8], dtype=np.int32))
            await client.send(verify)
            await client.send(chunk)
            first, second = await client.receive(), await client.receive()
            assert first.kind == ReplyKind.PREDICTED_TOKENS and first.window_id == 42
            assert second.kind == ReplyKind.ACK
            assert all(lane.inflight == 0 for lane in server.connections)  # type: ignore[attr-defined]
        server.shutdown()  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()


async def test_an_unsolicited_downstream_reply_closes_the_lane(virtual_time: MockClock,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="skippy.stage")
    async with trio.open_nursery() as nursery:
        server = await _stage_before(SlowDownstream(delay=0, extra_reply=True), nursery)
        async with await StageClient.connect(server.address) as client:  # type: ignore[attr-defined]
            await client.configure(1)
            await trio.sleep(0.2)  # the extra reply arrives while nothing is outstanding
            with trio.fail_after(2), pytest.raises(StageLost):
                await client.decode(1, 3, 0)
        server.shutdown()  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
    assert any("with no frame outstanding" in r.getMessage() for r in caplog.records)


async def test_runtime_thread_runs_calls_in_order_off_the_trio_thread(virtual_time: MockClock) -> None:
    import threading

    from skippy.stage.worker import RuntimeThread

    worker = RuntimeThread()
    try:
        names = [await worker.run_sync(lambda: threading.current_thread().name) for _ in range(3)]
        assert names == ["skippy-runtime"] * 3
        with pytest.raises(ZeroDivisionError):
            await worker.run_sync(lambda: 1 // 0)
        finished = threading.Event()

        def slow() -> None:
            finished.wait(0.2)
            finished.set()

        with trio.move_on_after(0.01) as scope:  # cancelled mid-call: it still waits for the call
            await worker.run_sync(slow)
            assert finished.is_set()  # never abandoned: the call finished first
            await trio.lowlevel.checkpoint()  # the cancellation is delivered here
        assert scope.cancelled_caught
    finally:
        worker.close()


# -- negotiated extensions (docs/protocol.md §2-§4) ------------------------------------------------

async def test_negotiated_client_gets_one_timing_record_per_stage(virtual_time: MockClock) -> None:
    async with inprocess_chain(["0:1", "1:3", "3:4"]) as servers:
        async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
            await client.configure(1)
            assert client.last_timings is None  # ACKs carry no timings
            result = await client.prefill(1, list(range(1, 20)), chunk_size=8)
            prefill_timings = client.last_timings
            reply = await client.decode(1, result.token, 19)
            timings = client.last_timings
            assert prefill_timings is not None and timings is not None
            records = timings.records
            assert [r.stage_index for r in records] == [2, 1, 0]  # deepest first
            assert [(r.layer_start, r.layer_end) for r in records] == [(3, 4), (1, 3), (0, 1)]
            assert all(r.batch_size == 1 for r in records)
            assert records[0].forward_write_us == records[0].downstream_wait_us == 0  # the final stage
            assert all(r.downstream_wait_us > 0 for r in records[1:])
            assert reply.stats.verify_window_stage_count == 0  # v11 verify stats: VerifyWindow replies only
            assert client.take_timings() == [prefill_timings, timings] and client.take_timings() == []
            await client.stop(1)


async def _read_plain(stream: trio.SocketStream, decoder: object) -> object:
    from skippy.codec.protocol import END_OF_STREAM, NEED_DATA

    while True:
        result = decoder.next_reply()  # type: ignore[attr-defined]
        if result is not NEED_DATA:
            return result
        data = await stream.receive_some(1 << 16)
        decoder.receive_data(data)  # type: ignore[attr-defined]
        if not data and result is END_OF_STREAM:
            return result


async def test_plain_v11_client_gets_plain_replies_and_no_error_frame(virtual_time: MockClock) -> None:
    from skippy.codec.protocol import END_OF_STREAM, check_ready

    async with inprocess_chain(["0:2", "2:4"]) as servers:
        address = servers[0].address
        assert address is not None
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            check_ready(await stream.receive_some(4))
            decoder = codec.ReplyDecoder()  # the v11 decoder: an extension frame would be a WireError
            final = StageMessage.create(MessageKind.PREFILL_FINAL_EMBD, token_count=2, session_id=1,
                                        tokens=np.asarray([3, 4], dtype=np.int32))
            await stream.send_all(codec.encode_message(final, WireDType.F32, 0))
            reply = await _read_plain(stream, decoder)
            assert isinstance(reply, StageReply) and reply.kind == ReplyKind.PREDICTED_TOKEN and reply.predicted == 5
            await stream.send_all(b"\xff" * 80)  # malformed: the lane closes without an Error frame
            with trio.fail_after(2):
                assert await _read_plain(stream, decoder) is END_OF_STREAM


_NEGOTIATED_BAD_FRAMES = [
    ("garbage", b"\xff" * 80, "MALFORMED_FRAME"),
    ("truncated", _frame(1)[:50], "MALFORMED_FRAME"),
    ("state import", StageMessage.create(MessageKind.STATE_IMPORT, token_count=2, raw_bytes=b"ab"), "UNSUPPORTED_KIND"),
    ("kind mismatch", _frame(2), "STATE_MISMATCH"),
]


@pytest.mark.parametrize("case, frame, code", _NEGOTIATED_BAD_FRAMES)
async def test_bad_frame_on_a_negotiated_lane_is_named_before_the_close(virtual_time: MockClock, case: str,
                                                                       frame: object, code: str) -> None:
    from skippy.driver import StageRemoteError
    from skippy.codec.protocol_ext import ErrorCode

    async with inprocess_chain(["0:2", "2:4"]) as servers:
        client = await StageClient.connect(servers[0].address)  # type: ignore[arg-type]
        try:
            await client.configure(1)  # a flagged message: the lane is negotiated
            if isinstance(frame, StageMessage):
                await client.send(frame)
            else:
                await client.send_raw(frame)
                if case == "truncated":
                    await client.stream.send_eof()
            with trio.fail_after(2), pytest.raises(StageRemoteError) as raised:
                await client.receive()
        finally:
            await client.aclose()
        error = raised.value.frame
        assert error is not None and error.code == ErrorCode[code] and raised.value.code is ErrorCode[code]
        assert error.origin_stage_index == error.reporter_stage_index == 0
        assert error.origin_address == str(servers[0].address)
        assert code.lower() in str(raised.value) and "stage 0" in str(raised.value)


async def test_lost_downstream_is_named_and_a_drain_says_shutting_down(virtual_time: MockClock) -> None:
    from skippy.codec.protocol_ext import ErrorCode

    async with trio.open_nursery() as outer:
        async with inprocess_chain(["0:1", "1:2", "2:4"]) as servers:
            async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
                await client.prefill(1, [1, 2, 3])
                lost_address = str(servers[2].address)
                servers[2].shutdown()  # the final stage drains: its lane says so, stage 1 relays it
                with trio.fail_after(2), pytest.raises(StageLost) as raised:
                    await client.decode(1, 3, 3)
                error = raised.value.frame
                assert error is not None
                # stage 2's idle lane is cancelled by the drain (SHUTTING_DOWN, relayed unchanged
                # by stage 1); if its close wins the race, stage 1 reports DOWNSTREAM_LOST instead
                assert error.code in (ErrorCode.SHUTTING_DOWN, ErrorCode.DOWNSTREAM_LOST), error
                print(error.describe())
                assert error.origin_stage_index == 2 and error.origin_address == lost_address
                assert f"stage 2 ({lost_address})" in str(raised.value)
        outer.cancel_scope.cancel()


# -- the shortcuts change no byte ----------------------------------------------------------------

class Tap:
    """A TCP relay in front of a stage that records every byte sent to it."""

    def __init__(self, target: object) -> None:
        self.target = target
        self.sent = bytearray()

    async def serve(self, stream: trio.SocketStream) -> None:
        target = self.target
        downstream = await trio.open_tcp_stream(target.host, target.port)  # type: ignore[attr-defined]

        async def pump(source: trio.SocketStream, sink: trio.SocketStream, record: bool) -> None:
            while data := await source.receive_some(1 << 16):
                if record:
                    self.sent += data
                await sink.send_all(data)
            await sink.send_eof()

        async with downstream, trio.open_nursery() as nursery:
            nursery.start_soon(pump, stream, downstream, True)
            nursery.start_soon(pump, downstream, stream, False)


def _script() -> list[list[StageMessage]]:
    """Batches of messages (each batch sent at once, then its replies read): two sessions,
    pipelined prefill chunks under credits, decodes, a verify window with its retirement and a
    rollback, a probe, a trim, every other decode-like kind, the restores (misses: no
    prefix-cache flag) and the stops: every kind a stage serves."""
    def chunk(session: int, begin: int, count: int, final: bool) -> StageMessage:
        kind = MessageKind.PREFILL_FINAL_EMBD if final else MessageKind.PREFILL_EMBD
        tokens = np.arange(begin + 1, begin + count + 1, dtype=np.int32)
        return StageMessage.create(kind, pos_start=begin, token_count=count, session_id=session, tokens=tokens,
                                   state_changes={"seq_id": begin // 4, "current_token": int(tokens[-1])})

    def decode(session: int, token: int, position: int, kind: MessageKind = MessageKind.DECODE_EMBD) -> StageMessage:
        return StageMessage.create(kind, pos_start=position, token_count=1, session_id=session,
                                   tokens=np.asarray([token], dtype=np.int32), state_changes={"current_token": token})

    def prefix(kind: MessageKind, tokens: list[int]) -> StageMessage:
        return StageMessage.create(kind, token_count=1 if kind is MessageKind.TRY_RESTORE_PREFILL_DECODE else len(tokens),
                                   session_id=2, tokens=np.asarray(tokens, dtype=np.int32))

    verify = StageMessage.create(MessageKind.VERIFY_WINDOW, pos_start=18, token_count=3, session_id=1,
                                 tokens=np.asarray([5, 6, 7], dtype=np.int32), state_changes={"seq_id": 42})
    retire = StageMessage.create(MessageKind.RETIRE_VERIFY_WINDOW, pos_start=18, token_count=3, session_id=1)
    probe = StageMessage.create(MessageKind.PROBE_PREFILL, token_count=2, session_id=2,
                                tokens=np.asarray([1, 2], dtype=np.int32))
    configure = [StageMessage.create(MessageKind.CONFIGURE_GENERATION, session_id=session) for session in (1, 2)]
    return [
        configure,
        [chunk(1, begin, 4, begin == 12) for begin in range(0, 16, 4)]
        + [chunk(2, begin, 4, begin == 4) for begin in range(0, 8, 4)],
        [decode(1, 17, 16)],
        [decode(1, 18, 17), decode(2, 9, 8)],
        [verify, retire, decode(1, 30, 19)],  # the window is rejected past its first token
        [probe, StageMessage.create(MessageKind.TRIM_SESSION, token_count=4, session_id=2), decode(2, 5, 4)],
        [decode(2, 6, 5, MessageKind.DECODE_READOUT), decode(2, 7, 6, MessageKind.DECODE_LIGHT_CTX),
         decode(2, 8, 7, MessageKind.DECODE_REPLAY_EMBD), decode(2, 9, 8, MessageKind.DECODE_REPLAY_FINAL_EMBD)],
        [prefix(MessageKind.RESTORE_PREFILL, [1, 2]), prefix(MessageKind.TRY_RESTORE_PREFILL, [1, 2]),
         prefix(MessageKind.TRY_RESTORE_PREFILL_DECODE, [1, 2, 3])],
        [StageMessage.stop(session_id=1), StageMessage.stop(session_id=2)],
    ]


#: Reply-stats fields that hold measured durations (or depend on which one was largest).
_MEASURED = ("verify_window_compute_us", "verify_window_forward_write_us", "verify_window_downstream_wait_us",
             "verify_window_total_us", "prefill_edge_write_us_max", "prefill_edge_wait_us_max",
             "prefill_edge_total_us_max", "prefill_edge_stage_index", "prefill_edge_activation_bytes_max")


async def _run_script(write_through: bool, inline_hand_offs: bool) -> tuple[bytes, bytes, int]:
    """Run :func:`_script` against null stages 0:1 -> tap -> 1:3 -> 3:4 with a plain v11 client;
    returns the client's replies (measured durations zeroed), the bytes stage 0 sent down and the
    chain's write-through count."""
    from skippy.codec.protocol import check_ready

    from stage_helpers import StageServer as Server, config_from_mapping, load_runtime

    switches = {"write_through": write_through, "inline_hand_offs": inline_hand_offs, "batch_size": 64,
                "connect_timeout": 2}
    async with trio.open_nursery() as nursery:
        async with inprocess_chain(["1:3", "3:4"], **switches) as tail:
            tap = Tap(tail[0].address)
            listeners = await nursery.start(functools.partial(trio.serve_tcp, tap.serve, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            config = config_from_mapping({"model": "null:n_embd=8,n_layer=4,n_vocab=1000", "layers": "0:1",
                                          "downstream": f"127.0.0.1:{port}", "reply_credit_limit": 2, **switches})
            first = Server(config, load_runtime(config))
            address = await nursery.start(first.serve)
            replies = bytearray()
            stream = await trio.open_tcp_stream(address.host, address.port)
            async with stream:
                check_ready(await stream.receive_some(4))
                decoder = codec.ReplyDecoder()
                for batch in _script():
                    await stream.send_all(b"".join(codec.encode_message(m, WireDType.F32, 0) for m in batch))
                    wanted = sum(m.kind is not MessageKind.RETIRE_VERIFY_WINDOW for m in batch)
                    while wanted:
                        reply = decoder.next_reply()
                        if isinstance(reply, StageReply):
                            stats = dataclasses.replace(reply.stats, **{field: 0 for field in _MEASURED})
                            replies += codec.encode_reply(dataclasses.replace(reply, stats=stats))
                            wanted -= 1
                            continue
                        data = await stream.receive_some(1 << 16)
                        assert data, "the stage closed the lane"
                        decoder.receive_data(data)
            first.shutdown()
            await trio.sleep(0.1)
            assert first.stats.connection_errors == 0 and all(s.stats.connection_errors == 0 for s in tail)
            write_throughs = first.stats.write_throughs + sum(s.stats.write_throughs for s in tail)
        nursery.cancel_scope.cancel()
    return bytes(replies), bytes(tap.sent), write_throughs


async def test_shortcuts_change_no_byte(virtual_time: MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    # (every kind, null stages; tests/test_placements.py::test_shortcuts_change_no_byte_on_any_path
    # runs every placement on the real runtime through the driver, decode relay included)
    from skippy.lane.protocol import RULES, Handling

    monkeypatch.undo()  # this test sets the switches itself, every combination
    # (a PredictionReturnOpen opens a lane of its own: tests/test_direct_return.py runs it)
    served = {kind for kind, rule in RULES.items() if rule.handling not in (Handling.REFUSE, Handling.RETURN_OPEN)}
    assert {m.kind for batch in _script() for m in batch} == served
    replies, sent, write_throughs = await _run_script(True, True)
    assert len(replies) > 0 and len(sent) > 0 and write_throughs > 0
    for switches in ((True, False), (False, True), (False, False)):
        other = await _run_script(*switches)
        assert other[:2] == (replies, sent), switches
        assert (other[2] > 0) == switches[0]


# -- typed errors: every refusal names its code; a bug is INTERNAL, logged with its traceback ------

async def _refusal(servers: list[StageServer], action: object) -> object:
    from skippy.driver import StageRemoteError

    client = await StageClient.connect(servers[0].address)  # type: ignore[arg-type]
    try:
        with trio.fail_after(2), pytest.raises(StageRemoteError) as raised:
            await action(client)  # type: ignore[operator]
    finally:
        await client.aclose()
    return raised.value.frame


@pytest.mark.parametrize(
    "case, code, text",
    [
        ("position gap", "STATE_MISMATCH", "holds 3 positions but the message starts at the authoritative position 9"),
        # checked per message before batching (a bad id must not fail other sessions' batch)
        ("token out of the vocabulary", "STATE_MISMATCH", "token ids must be in 0..999 (got 1..5000)"),
        ("no free session", "OVERLOADED", "cannot open session"),
    ],
)
async def test_each_refusal_carries_its_own_code(virtual_time: MockClock, case: str, code: str, text: str) -> None:
    from skippy.codec.protocol_ext import ErrorCode

    async def act(client: StageClient) -> None:
        if case == "position gap":
            await client.prefill(1, [1, 2, 3])
            await client.decode(1, 7, 9)
        elif case == "token out of the vocabulary":
            await client.prefill(1, [1, 5000])
        else:
            await client.prefill(1, [1, 2])
            await client.prefill(2, [1, 2])

    # no per-lane quota: this is about the stage's own sessions running out (the quota's refusal
    # is tested in test_stage_limits.py)
    async with inprocess_chain(["0:2", "2:4"], max_sessions=1, session_quota=0) as servers:
        frame = await _refusal(servers, act)
        assert frame is not None and frame.code is ErrorCode[code], frame
        assert text in frame.message and frame.origin_stage_index == 0
        await trio.sleep(0.05)
        assert all(server.executor.session_count == 0 for server in servers)


async def test_a_bug_is_logged_with_its_traceback_and_reported_as_internal(virtual_time: MockClock, 
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from skippy.codec.protocol_ext import ErrorCode

    caplog.set_level(logging.ERROR, logger="skippy.stage")
    async with inprocess_chain(["0:2", "2:4"]) as servers:
        final = servers[1].executor
        original = final.run_item

        def broken(item: object) -> object:
            if item.session & 0xFFFF == 2:  # type: ignore[attr-defined]
                return {}["a bug"]  # a KeyError nobody meant to raise
            return original(item)  # type: ignore[arg-type]

        monkeypatch.setattr(final, "run_item", broken)
        async with await StageClient.connect(servers[0].address) as good:  # type: ignore[arg-type]
            await good.prefill(1, [1, 2, 3])
            frame = await _refusal(servers, lambda client: client.prefill(2, [1, 2, 3]))
            assert frame is not None and frame.code is ErrorCode.INTERNAL  # relayed unchanged by stage 0
            assert frame.origin_stage_index == 1 and "KeyError: 'a bug'" in frame.message
            assert (await good.decode(1, 3, 3)).predicted == 4  # the stage and its other lanes carry on
            await good.stop(1)
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1 and tracebacks[0].exc_info[0] is KeyError  # type: ignore[index]
    # refusals are one line each, without a traceback
    assert any("closing lane" in r.getMessage() and r.exc_info is None for r in caplog.records)


# -- a lane over memory streams (no socket: the trio-side write path) ------------------------------

async def test_a_final_stage_lane_over_memory_streams(virtual_time: MockClock) -> None:
    import trio.testing

    from skippy.codec.protocol_ext import ErrorCode, ErrorFrame, TimingsFrame, with_extensions_flag
    from skippy.stage.connection import Connection
    from stage_helpers import config_from_mapping, load_runtime

    config = config_from_mapping({"model": "null:n_embd=8,n_layer=4,n_vocab=1000", "layers": "0:4"})
    server = StageServer(config, load_runtime(config))
    client_side, stage_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.scheduler.run)
        lane = Connection(stage_side, "memory", server.settings, server.scheduler, server.stats)  # type: ignore[arg-type]
        nursery.start_soon(lane.run)
        messages = [
            StageMessage.create(MessageKind.CONFIGURE_GENERATION, session_id=1),
            StageMessage.create(MessageKind.PREFILL_EMBD, token_count=2, session_id=1,
                                tokens=np.asarray([1, 2], dtype=np.int32)),
            StageMessage.create(MessageKind.PREFILL_FINAL_EMBD, pos_start=2, token_count=1, session_id=1,
                                tokens=np.asarray([3], dtype=np.int32)),
            StageMessage.create(MessageKind.DECODE_EMBD, pos_start=3, token_count=1, session_id=1,
                                tokens=np.asarray([4], dtype=np.int32)),
        ]
        decoder = codec.ReplyDecoder(extensions=True)
        received: list[object] = []

        async def read(count: int) -> None:
            with trio.fail_after(5):
                while len(received) < count:
                    result = decoder.next_reply()
                    if isinstance(result, (StageReply, TimingsFrame, ErrorFrame)):
                        received.append(result)
                        continue
                    decoder.receive_data(await client_side.receive_some(1 << 16))

        async def send(batch: list[StageMessage]) -> None:
            await client_side.send_all(b"".join(codec.encode_message(with_extensions_flag(m), WireDType.F32, 0)
                                                for m in batch))

        await send(messages)
        await read(6)
        await send([StageMessage.create(MessageKind.STATE_EXPORT, session_id=1)])
        await read(7)
        kinds = [(type(r).__name__, getattr(r, "kind", None)) for r in received]
        assert kinds == [("StageReply", ReplyKind.ACK), ("StageReply", ReplyKind.ACK), ("TimingsFrame", None),
                         ("StageReply", ReplyKind.PREDICTED_TOKEN), ("TimingsFrame", None),
                         ("StageReply", ReplyKind.PREDICTED_TOKEN), ("ErrorFrame", None)]
        assert [r.predicted for r in received if isinstance(r, StageReply) and r.kind == ReplyKind.PREDICTED_TOKEN] == [4, 5]
        error = received[-1]
        assert isinstance(error, ErrorFrame) and error.code is ErrorCode.UNSUPPORTED_KIND
        assert error.origin_address == ""  # not a socket: no address to name
        with trio.fail_after(5):
            while server.stats.connections_open:
                await trio.sleep(0.01)
        assert server.stats.write_throughs == 0 and server.executor.session_count == 0
        nursery.cancel_scope.cancel()


async def test_a_refused_decode_on_a_lone_final_stage_still_says_why(virtual_time: MockClock) -> None:
    # the final stage's decode is answered by write-through: a refusal before its compute has
    # written nothing, so the Error frame still follows
    from skippy.codec.protocol_ext import ErrorCode

    async def act(client: StageClient) -> None:
        await client.prefill(1, [1, 2, 3])
        await client.decode(1, 7, 9)

    async with inprocess_chain(["0:4"]) as servers:
        frame = await _refusal(servers, act)
        assert frame is not None and frame.code is ErrorCode.STATE_MISMATCH, frame
