"""The decode relay (skippy/stage/_relay.pyx, its twin skippy/stage/_relay_py.py, skippy/stage/decode_relay.py).

The loop's tests run both implementations on real contexts of the tiny llama over socket pairs:
every frame it forwards equals, byte for byte, the frame the lane's own path builds for the same
message (``lane_messages.outgoing`` + the codec, on a second context fed the same rows), and
every frame it does not carry comes back unread with the run's outcome.  The lane tests run
in-process chains with the relay on and off and compare the bytes that cross a boundary, the
tokens, and what happens when other work, a rollback or a shutdown interrupts a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import trio

from skippy.codec.protocol import (
    EMPTY_REPLY_STATS, MessageKind, SamplingConfig, StageMessage, StageReply, StateHeader, WireDType, expected_phase,
)
from skippy.codec.protocol_ext import DIRECT_RETURN_FLAG, SKIPPY_EXTENSIONS_FLAG, TimingsFrame
from skippy.lane import messages as lane_messages
from skippy.runtime import GREEDY, Model, Sampler, SamplingParams, StageContext
from skippy.stage import _relay_py
from skippy.stage import extensions
from skippy.stage.executor import ACTIVATION_LIMIT
from skippy.stage.extensions import StageIdentity
from skippy.stage.scheduler import RECENT_WORK_S
from skippy.stage.transport import codec

sys.path.insert(0, str(Path(__file__).parent))

try:
    from skippy.stage import _relay as _relay_cython
except ImportError:  # pragma: no cover - the extension is built by `make install`
    _relay_cython = None

IMPLEMENTATIONS = [pytest.param(_relay_py, id="python"),
                   pytest.param(_relay_cython, id="cython",
                                marks=pytest.mark.skipif(_relay_cython is None, reason="skippy.stage._relay not built"))]
PROMPT = [1, 15043, 3186, 29892, 920, 526, 366]
SESSION = 7


def decode_message(position: int, *, token: int = 0, activation: np.ndarray | None = None, step: int = 0,
                   source: int = -1, dtype: WireDType = WireDType.F32, session: int = SESSION,
                   kind: MessageKind = MessageKind.DECODE_EMBD, flags: int = DIRECT_RETURN_FLAG | SKIPPY_EXTENSIONS_FLAG,
                   sampling: SamplingConfig | None = None) -> StageMessage:
    """A DecodeEmbd as the driver (source -1) or a stage (source >= 0) sends it."""
    state = StateHeader(flags=flags, decode_step=step, current_token=token, source_stage_index=source,
                        reserved=int(dtype))
    return StageMessage(kind, pos_start=position, token_count=1, state=state, request_id=3, session_id=session,
                        sampling=sampling, tokens=np.array([token], dtype=np.int32) if source < 0 else
                        np.zeros(0, dtype=np.int32), activation=activation)


def window_message(position: int, tokens: np.ndarray, *, window_id: int, activation: np.ndarray | None = None,
                   source: int = -1, dtype: WireDType = WireDType.F32, session: int = SESSION,
                   flags: int = DIRECT_RETURN_FLAG | SKIPPY_EXTENSIONS_FLAG) -> StageMessage:
    """A VerifyWindow of ``len(tokens)`` rows as the driver (source -1) or a stage sends it (the
    token sideband travels along the chain)."""
    state = StateHeader(seq_id=window_id, phase=int(expected_phase(MessageKind.VERIFY_WINDOW)), flags=flags,
                        current_token=int(tokens[0]), source_stage_index=source, reserved=int(dtype))
    return StageMessage(MessageKind.VERIFY_WINDOW, pos_start=position, token_count=len(tokens), state=state,
                        request_id=3, session_id=session, tokens=np.asarray(tokens, dtype=np.int32),
                        activation=activation)


class Side:
    """A context on one stage range of the tiny llama (``model``, shared: only the context is the
    side's own) with a session that holds the prompt's prefill (a final stage's session samples with
    ``params``; ``timings``: its replies carry a Timings frame)."""

    def __init__(self, model: Model, params: SamplingParams = GREEDY, timings: bool = True) -> None:
        self.model = model
        self.context = StageContext(self.model, n_ctx=256, max_sessions=2, n_batch=64, threads=1)
        self.seq = self.context.open_session()
        self.first = self.model.is_first
        self.final = self.model.is_last
        self.width = self.context.n_embd
        self.sampler = Sampler(params, self.model.n_vocab, self.model.vocab_pointer) if self.final else None
        self.timings = timings

    def prefill(self, rows: np.ndarray) -> None:
        count = len(rows)
        if self.first:
            self.context.decode(tokens=rows, positions=list(range(count)), seq_ids=[self.seq] * count)
        else:
            self.context.decode(activations=rows, positions=list(range(count)), seq_ids=[self.seq] * count)

    def lane_frame(self, message: StageMessage, out_dtype: WireDType) -> bytes:
        """What the lane's own path forwards for ``message`` (and decodes it on this context: a
        rollback trimmed first, as the executor's auto-align does; a window's every row)."""
        position, rows = message.pos_start, message.token_count
        if self.context.length(self.seq) > position:
            self.context.trim(self.seq, position)
        positions, seqs = list(range(position, position + rows)), [self.seq] * rows
        outputs = [True] * rows if self.final else None
        if self.first:
            self.context.decode(tokens=message.tokens[:rows] if rows > 1 else [int(message.tokens[0])],
                                positions=positions, seq_ids=seqs, outputs=outputs)
        else:
            self.context.decode(activations=np.ascontiguousarray(message.activation, dtype=np.float32),
                                positions=positions, seq_ids=seqs, outputs=outputs)
        if self.final:
            assert self.sampler is not None
            tokens = [int(token) for token in self.context.sample([self.sampler] * rows, list(range(rows)))]
            if message.kind is MessageKind.VERIFY_WINDOW:
                return window_reply_frame(tokens, message.state.seq_id, self.timings)
            return reply_frame(tokens[0], self.timings)
        hidden = np.array(self.context.activations(), dtype=np.float32, copy=True)
        return codec.encode_message(lane_messages.outgoing(message, hidden, out_dtype), out_dtype, self.width)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
        self.context.close()


IDENTITY = StageIdentity(False, 1, 4)
IDENTITY.index = 2


def reply_frame(token: int, timings: bool) -> bytes:
    """A final stage's reply into a return lane, as the lane writes it (compute time 0)."""
    return extensions.reply_bytes(
        StageReply.predicted_token(token, stats=EMPTY_REPLY_STATS),
        TimingsFrame((extensions.own_record(IDENTITY, batch_size=1, compute_us=0),)) if timings else None)


def window_reply_frame(tokens: list[int], window_id: int, timings: bool) -> bytes:
    """A final stage's reply to a verify window, as the lane writes it (durations 0)."""
    from skippy.lane.messages import window_prediction
    from skippy.lane.work import WorkResult

    return extensions.reply_bytes(
        window_prediction(WorkResult(tokens=list(tokens), compute_us=0), EMPTY_REPLY_STATS, window_id=window_id,
                          total_us=0),
        TimingsFrame((extensions.own_record(IDENTITY, batch_size=1, compute_us=0),)) if timings else None)


def without_compute_time(frame: bytes) -> bytes:
    """A reply with its Timings record's compute_us zeroed (it is measured, so it differs), and a
    window's verify-window compute and total times."""
    head = _relay_py.TIMINGS_BYTES if int.from_bytes(frame[:4], "little") == 0x5E01 else 0
    if int.from_bytes(frame[head:head + 4], "little") != 3:  # a PredictedToken
        return frame[:24] + bytes(8) + frame[32:] if head else frame
    window = bytearray(frame[:24] + bytes(8) + frame[32:] if head else frame)  # PredictedTokens
    rows = int.from_bytes(window[head + 8:head + 12], "little")
    sums = head + 12 + 4 * rows + 8 + 72
    window[sums:sums + 8] = bytes(8)
    window[sums + 24:sums + 32] = bytes(8)
    return bytes(window)


@pytest.fixture(scope="module")
def models(tiny_llama: Path) -> Iterator[Callable[[str], Model]]:
    """The tiny llama's stage ranges, each loaded once for the module (a load is most of a bench's
    cost; the weights are read-only, every bench gets contexts of its own)."""
    loaded: dict[str, Model] = {}

    def load(layers: str) -> Model:
        if layers not in loaded:
            loaded[layers] = Model(tiny_llama, layers)
        return loaded[layers]

    yield load
    for model in loaded.values():
        model.close()


@pytest.fixture(scope="module")
def prompt_hidden(models: Callable[[str], Model]) -> np.ndarray:
    """The prompt's activations after layer 0 (what the middle stage 1:2 is prefilled with)."""
    side = Side(models("0:1"))
    try:
        side.prefill(np.array(PROMPT, dtype=np.int32))
        return np.array(side.context.activations(), dtype=np.float32, copy=True)
    finally:
        side.close()


class Bench:
    """A relay under test (``relay_side``) and a twin context (``lane_side``) fed the same rows,
    wired to socket pairs: ``upstream`` writes into the relay, ``downstream`` reads from it."""

    def __init__(self, implementation: Any, model: Model, prompt_hidden: np.ndarray,
                 in_dtype: WireDType = WireDType.F32, out_dtype: WireDType = WireDType.F32,
                 max_steps: int = 1024, params: SamplingParams = GREEDY, timings: bool = True,
                 hop: tuple[bytes, bytes] | None = None, rows: int = 1, window_primer: int = 0,
                 window_hop: tuple[bytes, bytes] | None = None, capacity: int | None = None,
                 in_flight: tuple[int, ...] = ()) -> None:
        #: Hop by hop (a non-final stage): the downstream's reply template and this stage's.
        self.hop = hop
        #: Verify windows of ``rows`` rows (1: decodes).
        self.rows = rows
        self.window_id = 100
        self.relay_side, self.lane_side = Side(model, params, timings), Side(model, params, timings)
        self.first, self.final = self.relay_side.first, self.relay_side.final
        prompt = np.array(PROMPT, dtype=np.int32) if self.first else prompt_hidden
        for side in (self.relay_side, self.lane_side):
            side.prefill(prompt)
        self.in_dtype, self.out_dtype = in_dtype, out_dtype
        self.position = len(PROMPT)
        self.rng = np.random.default_rng(5)
        # the run's first message: the lane handles it (here: both contexts), its frame is the template
        primer = self.message(self.position, **({"flags": SKIPPY_EXTENSIONS_FLAG} if hop else {}))
        self.in_template = codec.encode_message(primer, in_dtype, self.relay_side.width)
        self.out_template = self.lane_side.lane_frame(primer, out_dtype)
        self.relay_side.lane_frame(primer, out_dtype)
        if self.final:  # the lane's template: its reply with the token and compute time to patch
            self.out_template = reply_frame(0, timings) if rows == 1 else window_reply_frame([0] * rows, 0, timings)
        self.position += rows
        other = None
        if window_primer:  # a window after the decode: the run carries both kinds (its templates too)
            window = self.window(self.position, rows=window_primer)
            other_out = self.lane_side.lane_frame(window, out_dtype)
            self.relay_side.lane_frame(window, out_dtype)
            if self.final:
                other_out = window_reply_frame([0] * window_primer, 0, timings)
            other = (self.frame(window), other_out, *(window_hop or (b"", b"")))
            self.position += window_primer
        #: The lane's messages in flight when the run starts (a decode's rows 1, else a window's;
        #: computed on both sides, forwarded by the lane): a run takes them over (:meth:`adopted`).
        self.in_flight: list[StageMessage] = []
        for count in in_flight:
            message = self.message(self.position) if count == 1 else self.window(self.position, rows=count)
            self.lane_side.lane_frame(message, out_dtype)
            self.relay_side.lane_frame(message, out_dtype)
            self.in_flight.append(message)
            self.position += count
        self.upstream, upstream_end = socket.socketpair()
        downstream_end, self.downstream = socket.socketpair()
        for sock in (upstream_end, downstream_end):
            sock.setblocking(False)
        self._ends = (upstream_end, downstream_end)
        self.stop_fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.abort_fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.batch = self.relay_side.context.row_batch(self.relay_side.seq, self.relay_side.sampler, capacity or rows)
        self.relay = implementation.DecodeRelay(
            upstream_fd=upstream_end.fileno(), downstream_fd=downstream_end.fileno(), stop_fd=self.stop_fd,
            abort_fd=self.abort_fd, in_template=self.in_template, out_template=self.out_template,
            width=self.relay_side.width, first=self.first, n_vocab=self.relay_side.model.n_vocab,
            next_position=self.position, position_end=256, activation_limit=ACTIVATION_LIMIT, runtime=self.batch,
            final=self.final, max_steps=max_steps, other=other,
            **({"reply_in": hop[0], "reply_out": hop[1]} if hop else {}))

    def message(self, position: int, **changes: Any) -> StageMessage:
        if self.hop is not None:
            changes.setdefault("flags", SKIPPY_EXTENSIONS_FLAG)
        if self.rows > 1:
            return self.window(position, **changes)
        if self.first:
            return decode_message(position, token=int(self.rng.integers(3, 30000)), step=position, **changes)
        activation = self.rng.standard_normal((1, self.relay_side.width)).astype(np.float32)
        if self.in_dtype is WireDType.F16:  # what the wire carries is what both sides decode
            activation = activation.astype(np.float16).astype(np.float32)
        return decode_message(position, activation=activation, step=position, source=0, dtype=self.in_dtype,
                              **changes)

    def window(self, position: int, rows: int | None = None, **changes: Any) -> StageMessage:
        """A verify window of ``rows`` (the bench's) rows at ``position``, with the next window id."""
        rows = self.rows if rows is None else rows
        if self.hop is not None:
            changes.setdefault("flags", SKIPPY_EXTENSIONS_FLAG)
        self.window_id += 1
        tokens = self.rng.integers(3, 30000, rows).astype(np.int32)
        if self.first:
            return window_message(position, tokens, window_id=self.window_id, **changes)
        activation = self.rng.standard_normal((rows, self.relay_side.width)).astype(np.float32)
        if self.in_dtype is WireDType.F16:
            activation = activation.astype(np.float16).astype(np.float32)
        return window_message(position, tokens, window_id=self.window_id, activation=activation, source=0,
                              dtype=self.in_dtype, **changes)

    def frame(self, message: StageMessage) -> bytes:
        return codec.encode_message(message, self.in_dtype, self.relay_side.width)

    def run(self, data: bytes, *, pending: bytes = b"", close: bool = False, adopted: tuple[Any, ...] = ()) -> Any:
        """Write ``data`` upstream (then close it if asked), run the relay until it returns."""
        self.upstream.sendall(data)
        if close:
            self.upstream.shutdown(socket.SHUT_WR)
        return self.relay.run(pending, adopted) if adopted else self.relay.run(pending)

    def adopted(self) -> tuple[tuple[int, ...], ...]:
        """:attr:`in_flight` as a run takes them over (kind, rows, compute and write times, when the
        write began, ended, and the message was received)."""
        now = time.perf_counter_ns()
        return tuple((int(message.kind), message.token_count, 30 + index, 2, now // 1000 - 5, now - 3000,
                      now - 9000) for index, message in enumerate(self.in_flight))

    def forwarded(self, count: int) -> list[bytes]:
        length = len(self.out_template)
        frames = []
        self.downstream.settimeout(5)
        for _ in range(count):
            data = b""
            while len(data) < length:
                data += self.downstream.recv(length - len(data))
            frames.append(without_compute_time(data) if self.final else data)
        self.downstream.setblocking(False)
        try:
            extra = self.downstream.recv(1 << 16)
        except BlockingIOError:
            extra = b""
        assert extra == b"", "the relay wrote more than the frames expected"
        return frames

    def read_exactly(self, sock: socket.socket, lengths: list[int]) -> list[bytes]:
        """Frames of ``lengths`` from ``sock`` (the relay's downstream or upstream end), then none."""
        sock.settimeout(5)
        frames = []
        for length in lengths:
            data = b""
            while len(data) < length:
                data += sock.recv(length - len(data))
            frames.append(data)
        sock.setblocking(False)
        try:
            extra = sock.recv(1 << 16)
        except BlockingIOError:
            extra = b""
        assert extra == b"", "the relay wrote more than the frames expected"
        return frames

    def close(self) -> None:
        for sock in (self.upstream, self.downstream, *self._ends):
            sock.close()
        os.close(self.stop_fd)
        os.close(self.abort_fd)
        self.relay_side.close()
        self.lane_side.close()


@pytest.fixture
def make_bench(models: Callable[[str], Model], prompt_hidden: np.ndarray) -> Iterator[Any]:
    benches: list[Bench] = []

    def make(implementation: Any, layers: str, **options: Any) -> Bench:
        bench = Bench(implementation, models(layers), prompt_hidden, **options)
        benches.append(bench)
        return bench

    yield make
    for bench in benches:
        bench.close()


# -- the loop: the lane's bytes, and everything it hands back ----------------------------------------
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("layers", "in_dtype", "out_dtype"), [
    ("0:1", WireDType.F32, WireDType.F32), ("0:1", WireDType.F32, WireDType.F16),
    ("1:2", WireDType.F32, WireDType.F32), ("1:2", WireDType.F16, WireDType.F16), ("1:2", WireDType.F16, WireDType.F32),
], ids=["first-f32", "first-f16", "middle-f32", "middle-f16", "middle-f16-in"])
def test_the_relay_forwards_exactly_the_lanes_frames(implementation: Any, make_bench: Any, layers: str,
                                                     in_dtype: WireDType, out_dtype: WireDType) -> None:
    bench = make_bench(implementation, layers, in_dtype=in_dtype, out_dtype=out_dtype)
    messages = [bench.message(bench.position + index) for index in range(6)]
    stop = codec.encode_message(StageMessage.create(MessageKind.STOP, session_id=SESSION), WireDType.F32, 0)
    outcome = bench.run(b"".join(bench.frame(message) for message in messages) + stop)
    assert outcome.status == implementation.HANDED_BACK and outcome.steps == 6
    assert outcome.leftover == stop  # the Stop is the lane's, unread
    expected = [bench.lane_side.lane_frame(message, out_dtype) for message in messages]
    assert bench.forwarded(6) == expected
    assert bench.relay.next_position == bench.position + 6
    assert bench.relay_side.context.length(bench.relay_side.seq) == bench.position + 6
    assert outcome.bytes_out == 6 * len(bench.out_template) and outcome.bytes_in == len(outcome.leftover) + sum(
        len(bench.frame(message)) for message in messages)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_k=40, seed=11),
                                    SamplingParams(temperature=0.7, repeat_penalty=1.3, seed=3)],
                         ids=["greedy", "temperature", "penalties"])
@pytest.mark.parametrize("timings", [True, False], ids=["timings", "plain"])
@pytest.mark.parametrize("layers", ["1:4", "0:4"], ids=["final", "first-and-final"])
def test_a_final_stage_answers_exactly_the_lanes_replies(implementation: Any, make_bench: Any, layers: str,
                                                         params: SamplingParams, timings: bool) -> None:
    """A final stage (after another, or a one-stage chain's: token ids in) answers the lane's bytes."""
    bench = make_bench(implementation, layers, params=params, timings=timings)
    messages = [bench.message(bench.position + index) for index in range(8)]
    outcome = bench.run(b"".join(bench.frame(message) for message in messages), close=True)
    assert outcome.status == implementation.HANDED_BACK and outcome.steps == 8 and outcome.leftover == b""
    expected = [without_compute_time(bench.lane_side.lane_frame(message, WireDType.F32)) for message in messages]
    replies = bench.forwarded(8)
    assert replies == expected  # the same tokens (the samplers' states moved alike), the same bytes
    assert len({reply for reply in replies}) > 1  # tokens that change: a real test of the pick


def test_the_greedy_pick_is_numpys_argmax() -> None:
    """The Cython loop's vectorised pick (skippy/stage/_relay_pick.h) against numpy's argmax, which the
    lane's greedy path uses: first maximum, first NaN, signed zeros, infinities, odd lengths."""
    if _relay_cython is None:
        pytest.skip("skippy.stage._relay not built")
    rng = np.random.default_rng(9)
    cases = [np.array(values, dtype=np.float32) for values in (
        [1.0, 3.0, 3.0, 2.0], [np.nan, 1.0], [1.0, np.nan, 5.0, np.nan], [-np.inf, -np.inf], [-0.0, 0.0, -1.0],
        [0.0, -0.0], [2.0], [-np.inf, -1e38, -np.inf, -1e38, -2e38], [np.inf, 1.0, np.inf])]
    for length in (1, 3, 4, 5, 7, 8, 33, 262144 + 3):
        row = rng.standard_normal(length).astype(np.float32)
        cases.append(row)
        tied = row.copy()
        tied[rng.integers(0, length, 3)] = row.max() + 1  # the same maximum in up to three places
        cases.append(tied)
        with_nan = row.copy()
        with_nan[rng.integers(0, length)] = np.nan
        cases.append(with_nan)
    for values in cases:
        assert _relay_cython.first_maximum(values) == int(values.argmax()), values[:8]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_pending_bytes_are_relayed_first(implementation: Any, make_bench: Any) -> None:
    bench = make_bench(implementation, "1:2")
    first, second = (bench.message(bench.position + index) for index in range(2))
    frame = bench.frame(first)
    # half a frame the lane had read, the rest (and the next frame) still in the socket
    outcome = bench.run(frame[40:] + bench.frame(second), pending=frame[:40], close=True)
    assert outcome.status == implementation.HANDED_BACK and outcome.steps == 2 and outcome.leftover == b""
    assert bench.forwarded(2) == [bench.lane_side.lane_frame(message, WireDType.F32) for message in (first, second)]


def _variants(bench: Bench) -> dict[str, bytes]:
    """Frames the relay must not carry, each after one it carries."""
    position = bench.position + 1
    nan = bench.message(position)
    if not bench.first:
        assert nan.activation is not None
        nan.activation[0, 3] = np.nan
    huge = bench.message(position)
    if not bench.first:
        assert huge.activation is not None
        huge.activation[0, 0] = 2 * ACTIVATION_LIMIT
    variants = {
        "position-before-zero": bench.frame(bench.message(-1)),
        "gap": bench.frame(bench.message(position + 1)),
        "other-session": bench.frame(bench.message(position, session=SESSION + 1)),
        "not-direct": bench.frame(bench.message(position, flags=SKIPPY_EXTENSIONS_FLAG)),
        "other-kind": bench.frame(bench.message(position, kind=MessageKind.DECODE_READOUT)),
        "sampling": bench.frame(bench.message(position, sampling=SamplingConfig(flags=1, seed=4))),
    }
    if bench.first:
        variants["token-out-of-vocabulary"] = codec.encode_message(
            decode_message(position, token=bench.relay_side.model.n_vocab, step=position), WireDType.F32, 0)
    else:
        variants["nan"] = bench.frame(nan)
        variants["beyond-the-limit"] = bench.frame(huge)
    return variants


def _window_variants(bench: Bench) -> dict[str, bytes]:
    """Windows (and a decode) the loop must hand back after a window of the template's shape."""
    position = bench.position + 4
    variants = {
        "gap": bench.frame(bench.window(position + 1)),
        "position-before-zero": bench.frame(bench.window(-1)),
        "more-rows-than-the-batch": bench.frame(bench.window(position, rows=5)),
        "a-decode": bench.frame(decode_message(position, token=5) if bench.first else decode_message(
            position, activation=np.zeros((1, bench.relay_side.width), dtype=np.float32), source=0)),
        "other-session": bench.frame(bench.window(position, session=SESSION + 1)),
    }
    short = bench.window(position)  # a window of 4 rows with 3 tokens in its sideband
    variants["short-token-sideband"] = bench.frame(dataclasses.replace(short, tokens=short.tokens[:3]))
    if bench.first:
        bad = bench.window(position)
        bad.tokens[2] = bench.relay_side.model.n_vocab
        variants["token-out-of-vocabulary"] = bench.frame(bad)
    else:
        bad = bench.window(position)
        assert bad.activation is not None
        bad.activation[3, 1] = np.nan
        variants["nan-in-the-last-row"] = bench.frame(bad)
    return variants


_COMMON = ["position-before-zero", "gap", "other-session", "not-direct", "other-kind", "sampling"]
REFUSED = ([(layers, name) for layers in ("0:1", "0:4") for name in [*_COMMON, "token-out-of-vocabulary"]]
           + [("1:2", name) for name in [*_COMMON, "nan", "beyond-the-limit"]])


#: Verify windows (of 4 rows) the loop must not carry after one it carries (_window_variants).
WINDOW_REFUSED = ([(layers, name) for layers in ("0:1", "0:4")
                   for name in ["gap", "position-before-zero", "more-rows-than-the-batch", "a-decode",
                                "other-session", "short-token-sideband", "token-out-of-vocabulary"]]
                  + [("1:2", name) for name in ["gap", "more-rows-than-the-batch", "a-decode", "nan-in-the-last-row"]])
LAYER_NAMES = {"0:1": "first", "1:2": "middle", "1:4": "final", "0:4": "first-and-final"}
HANDED_BACK_CASES = [(1, *case) for case in REFUSED] + [(4, *case) for case in WINDOW_REFUSED]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("rows", "layers", "name"), HANDED_BACK_CASES, ids=[
    f"{'window-' if rows > 1 else ''}{LAYER_NAMES[layers]}-{name}"
    for rows, layers, name in HANDED_BACK_CASES])
def test_what_the_relay_does_not_carry_is_handed_back_unread(implementation: Any, make_bench: Any, rows: int,
                                                             layers: str, name: str) -> None:
    bench = make_bench(implementation, layers, rows=rows)
    carried = bench.message(bench.position)
    refused = (_variants if rows == 1 else _window_variants)(bench)[name]
    outcome = bench.run(bench.frame(carried) + refused)
    assert (outcome.status, outcome.steps, outcome.leftover) == (implementation.HANDED_BACK, 1, refused)
    expected = bench.lane_side.lane_frame(carried, WireDType.F32)
    forwarded = bench.read_exactly(bench.downstream, [len(expected)])
    if bench.final:
        expected, forwarded = without_compute_time(expected), [without_compute_time(frame) for frame in forwarded]
    assert forwarded == [expected]
    assert bench.relay_side.context.length(bench.relay_side.seq) == bench.position + rows  # nothing else ran


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layers", ["0:1", "1:2", "1:4", "0:4"], ids=["first", "middle", "final", "first-and-final"])
def test_a_rollback_is_trimmed_as_the_lanes_auto_align_trims_it(implementation: Any, make_bench: Any,
                                                               layers: str) -> None:
    bench = make_bench(implementation, layers)
    base = bench.position
    messages = [bench.message(base + start) for start in (0, 1, 2, 0, 1, 1)]  # rolled back 3, then 1
    outcome = bench.run(b"".join(bench.frame(message) for message in messages), close=True)
    assert outcome.status == implementation.HANDED_BACK and outcome.steps == 6 and outcome.leftover == b""
    expected = [bench.lane_side.lane_frame(message, WireDType.F32) for message in messages]
    assert bench.forwarded(6) == ([without_compute_time(frame) for frame in expected] if bench.final else expected)
    assert (outcome.trims, outcome.trimmed) == (2, 3 + 1)
    assert bench.relay_side.context.length(bench.relay_side.seq) == base + 2 == bench.relay.next_position
    assert bench.relay_side.context.kv_cells_used() == bench.lane_side.context.kv_cells_used()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layers", ["1:2", "0:4"], ids=["middle", "first-and-final"])
def test_a_stop_end_of_stream_a_full_run_and_a_lost_downstream_end_a_run(implementation: Any,
                                                                         make_bench: Any, layers: str) -> None:
    bench = make_bench(implementation, layers, max_steps=2)
    # stopped while waiting for a frame (from another thread, as the lane's trio side does)
    threading.Timer(0.05, os.eventfd_write, (bench.stop_fd, 1)).start()
    assert bench.run(b"").status == implementation.STOPPED
    os.eventfd_read(bench.stop_fd)
    # max_steps: a third frame waits for the next run
    frames = [bench.frame(bench.message(bench.position + index)) for index in range(3)]
    outcome = bench.run(b"".join(frames))
    assert (outcome.status, outcome.steps, outcome.leftover) == (implementation.STEP_LIMIT, 2, frames[2])
    # end of stream in the middle of a frame: the partial frame comes back for the lane's reader
    outcome = bench.run(frames[2][:50], pending=b"", close=True)
    assert (outcome.status, outcome.steps, outcome.leftover) == (implementation.HANDED_BACK, 0, frames[2][:50])
    bench.forwarded(2)
    # the downstream goes away: the write fails
    other = make_bench(implementation, layers)
    other.downstream.close()
    outcome = other.run(other.frame(other.message(other.position)))
    assert outcome.status == implementation.DOWNSTREAM_FAILED


def _drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    while True:
        try:
            if not sock.recv(1 << 16):
                return
        except BlockingIOError:
            return


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layers", ["1:2", "1:4", "0:4"], ids=["middle", "final", "first-and-final"])
def test_a_reader_that_falls_behind_is_waited_for_until_the_runtime_is_wanted(implementation: Any, make_bench: Any,
                                                                              layers: str) -> None:
    """Nobody reads what the loop writes (the next stage, or the driver its replies): the loop
    computes nothing while the socket has no room, and the scheduler's stop (another lane wants
    the runtime) hands the next message back unread, so the lane's path waits for the reader in
    trio (before, the loop waited in its write, on the runtime thread, until an abort).  A
    reader that is only slow gets every message."""
    bench = make_bench(implementation, layers)
    bench._ends[1].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    bench.downstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    frames = [bench.frame(bench.message(bench.position + index)) for index in range(200)]
    watchdog = threading.Timer(10, os.eventfd_write, (bench.abort_fd, 1))
    watchdog.start()
    threading.Timer(0.3, os.eventfd_write, (bench.stop_fd, 1)).start()
    try:
        outcome = bench.run(b"".join(frames))
    finally:
        watchdog.cancel()
    assert outcome.status == implementation.STOPPED and 0 < outcome.steps < 200, outcome.status
    rest = b"".join(frames[outcome.steps:])  # from the first message not computed, unread
    assert len(outcome.leftover) >= len(frames[outcome.steps]) and rest.startswith(outcome.leftover)
    assert bench.relay.next_position == bench.position + outcome.steps
    _drain(bench.downstream)
    os.eventfd_read(bench.stop_fd)
    # a slow reader: the loop waits for it and carries every message
    done = threading.Event()

    def slow_reader() -> None:
        bench.downstream.setblocking(True)
        bench.downstream.settimeout(0.05)
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                bench.downstream.recv(512)
            time.sleep(0.001)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    try:
        bench.upstream.shutdown(socket.SHUT_WR)  # (the rest of the frames are in the socket still)
        outcome = bench.relay.run(outcome.leftover)
    finally:
        done.set()
        reader.join(5)
    assert outcome.status == implementation.HANDED_BACK and outcome.leftover == b"", outcome.status
    assert bench.relay.next_position == bench.position + 200


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_an_abort_cuts_a_write_the_downstream_does_not_take(implementation: Any, make_bench: Any) -> None:
    """A frame larger than the room the downstream had (a window's activations): its write waits
    for the reader, and an abort ends the wait."""
    bench = make_bench(implementation, "1:2", rows=48, capacity=48)
    bench._ends[1].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    bench.downstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    frames = b"".join(bench.frame(bench.message(bench.position + 48 * index)) for index in range(4))
    assert len(frames) > 4 * 8192
    writer = threading.Thread(target=bench.upstream.sendall, args=(frames,))
    writer.start()
    threading.Timer(0.3, os.eventfd_write, (bench.abort_fd, 1)).start()
    outcome = bench.relay.run(b"")  # nobody reads downstream: the first window's write waits until the abort
    assert outcome.status == implementation.ABORTED and outcome.steps == 0
    _drain(bench.downstream)
    bench.upstream.shutdown(socket.SHUT_WR)
    bench._ends[0].close()
    writer.join(5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_templates_the_relay_cannot_carry_are_refused(implementation: Any, make_bench: Any) -> None:
    bench = make_bench(implementation, "1:2")
    q8 = codec.encode_message(bench.message(bench.position), WireDType.Q8, bench.relay_side.width)
    with pytest.raises(ValueError, match="f32 and f16"):
        implementation.template_layout(q8, bench.out_template, width=bench.relay_side.width, first=False)
    sampled = bench.frame(bench.message(bench.position, sampling=SamplingConfig(flags=1)))
    with pytest.raises(ValueError, match="section"):
        implementation.template_layout(sampled, bench.out_template, width=bench.relay_side.width, first=False)
    with pytest.raises(ValueError, match="length"):
        implementation.template_layout(bench.in_template + b"\0", bench.out_template, width=bench.relay_side.width,
                                       first=False)


# -- verify windows: the window-sized template, rollbacks trimmed --------------------------------------
#: Window positions after the template's (relative): each window has 4 rows; a window starting
#: before the last one ended follows a rejection (2, then 3 drafts rejected): the loop trims.
WINDOW_STARTS = [0, 4, 6, 10, 11, 15]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("layers", "in_dtype", "params"), [
    ("0:1", WireDType.F32, GREEDY), ("1:2", WireDType.F32, GREEDY), ("1:2", WireDType.F16, GREEDY),
    ("1:4", WireDType.F32, GREEDY), ("1:4", WireDType.F32, SamplingParams(temperature=0.9, top_k=40, seed=11)),
    ("0:4", WireDType.F32, GREEDY), ("0:4", WireDType.F32, SamplingParams(temperature=0.9, top_k=40, seed=11)),
], ids=["first", "middle", "middle-f16", "final-greedy", "final-sampled", "first-and-final-greedy",
        "first-and-final-sampled"])
def test_windows_are_relayed_exactly_as_the_lane_with_rollbacks_trimmed(implementation: Any, make_bench: Any,
                                                                        layers: str, in_dtype: WireDType,
                                                                        params: SamplingParams) -> None:
    bench = make_bench(implementation, layers, rows=4, in_dtype=in_dtype, out_dtype=in_dtype, params=params)
    base = bench.position
    messages = [bench.message(base + start) for start in WINDOW_STARTS]
    stop = codec.encode_message(StageMessage.create(MessageKind.STOP, session_id=SESSION), WireDType.F32, 0)
    cells = bench.relay_side.context.kv_cells_used()
    outcome = bench.run(b"".join(bench.frame(message) for message in messages) + stop)
    assert outcome.status == implementation.HANDED_BACK and outcome.steps == len(messages)
    assert outcome.leftover == stop
    expected = [bench.lane_side.lane_frame(message, in_dtype) for message in messages]
    if bench.final:
        expected = [without_compute_time(frame) for frame in expected]
    assert bench.forwarded(len(messages)) == expected  # the same rows, ids, tokens: byte for byte
    assert (outcome.trims, outcome.trimmed) == (2, 2 + 3)
    end = base + WINDOW_STARTS[-1] + 4
    assert bench.relay.next_position == end == bench.relay_side.context.length(bench.relay_side.seq)
    # the rejected rows' cells are gone: no cell leaked, the same count as the lane's context
    assert bench.relay_side.context.kv_cells_used() == cells + end - base == bench.lane_side.context.kv_cells_used()



@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_window_templates_the_relay_cannot_carry_are_refused(implementation: Any, make_bench: Any) -> None:
    bench = make_bench(implementation, "1:2", rows=4)
    width = bench.relay_side.width
    with pytest.raises(ValueError, match="rows"):  # the forwarded frame of another window size
        implementation.template_layout(bench.in_template, bench.frame(bench.window(bench.position, rows=3)),
                                       width=width, first=False)
    with pytest.raises(ValueError, match="PredictedTokens of 4"):  # a decode's reply to a window
        implementation.template_layout(bench.in_template, reply_frame(0, True), width=width, first=False, final=True)
    other = bench.relay_side.context.row_batch(bench.relay_side.seq, None, 3)
    with pytest.raises(ValueError, match="rows"):  # a batch of another size
        implementation.DecodeRelay(
            upstream_fd=bench.stop_fd, downstream_fd=bench.stop_fd, stop_fd=bench.stop_fd, abort_fd=bench.abort_fd,
            in_template=bench.in_template, out_template=bench.out_template, width=width, first=False,
            n_vocab=bench.relay_side.model.n_vocab, next_position=bench.position, position_end=256,
            activation_limit=ACTIVATION_LIMIT, runtime=other)


#: The driver's speculation in little: (rows, accepted drafts) per message, a decode as (1, None):
#: windows of every size up to the batch's and decodes interleaved, rejections mid-window (the
#: next message starts before the last one ended: its rows are trimmed first).
SPECULATION = [(2, 0), (1, None), (4, 2), (6, 5), (1, None), (1, None), (3, 0), (1, 0), (8, 3), (1, None), (5, 1)]


def speculation(bench: Bench) -> tuple[list[StageMessage], int, int]:
    """:data:`SPECULATION`'s messages from the bench's next position, and the rollbacks (count,
    positions) they cause."""
    messages, position, end, trims, trimmed = [], bench.position, bench.position, 0, 0
    for rows, accepted in SPECULATION:
        if position < end:
            trims, trimmed = trims + 1, trimmed + end - position
        message = bench.message(position) if accepted is None else bench.window(position, rows=rows)
        messages.append(message)
        end = position + rows
        position += 1 if accepted is None else accepted + 1
    return messages, trims, trimmed


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("layers", "params"), [
    ("0:1", GREEDY), ("1:2", GREEDY), ("1:4", GREEDY), ("1:4", SamplingParams(temperature=0.9, top_k=40, seed=11)),
    ("0:4", SamplingParams(temperature=0.9, top_k=40, seed=11)),
], ids=["first", "middle", "final-greedy", "final-sampled", "first-and-final-sampled"])
def test_one_run_carries_windows_of_every_size_and_decodes_interleaved(implementation: Any, make_bench: Any,
                                                                       layers: str, params: SamplingParams) -> None:
    """A run from a decode's and a window's templates carries the driver's speculation: windows of
    1 to 8 rows (the batch) and decodes in any order, each frame (a final stage's reply) the
    lane's byte for byte, every rejected row's KV cells trimmed as the lane's auto-align trims them."""
    bench = make_bench(implementation, layers, window_primer=3, capacity=8, params=params)
    messages, trims, trimmed = speculation(bench)
    stop = codec.encode_message(StageMessage.create(MessageKind.STOP, session_id=SESSION), WireDType.F32, 0)
    cells = bench.relay_side.context.kv_cells_used()
    outcome = bench.run(b"".join(bench.frame(message) for message in messages) + stop)
    assert (outcome.status, outcome.steps, outcome.leftover) == (implementation.HANDED_BACK, len(messages), stop)
    windows = [message for message in messages if message.kind is MessageKind.VERIFY_WINDOW]
    assert (outcome.windows, outcome.rows) == (len(windows), sum(message.token_count for message in messages))
    expected = [bench.lane_side.lane_frame(message, WireDType.F32) for message in messages]
    forwarded = bench.read_exactly(bench.downstream, [len(frame) for frame in expected])
    if bench.final:
        expected, forwarded = ([without_compute_time(frame) for frame in frames] for frames in (expected, forwarded))
    assert forwarded == expected
    assert (outcome.trims, outcome.trimmed) == (trims, trimmed) and trims >= 4
    end = messages[-1].pos_start + messages[-1].token_count
    assert bench.relay.next_position == end == bench.relay_side.context.length(bench.relay_side.seq)
    assert bench.relay_side.context.kv_cells_used() == cells + end - bench.position
    assert bench.relay_side.context.kv_cells_used() == bench.lane_side.context.kv_cells_used()


def _hostile(bench: Bench) -> dict[str, bytes]:
    """Windows and decodes whose rows, sidebands or positions no run may take (every peer number
    is hostile: checked before anything is computed from them)."""
    position = bench.position
    window = bench.frame(bench.window(position, rows=2))

    def patched(frame: bytes, offset: int, value: int) -> bytes:
        return frame[:offset] + struct.pack("<i", value) + frame[offset + 4:]

    decode = bench.frame(bench.message(position))
    return {
        "no-rows": patched(window, 8, 0),
        "negative-rows": patched(window, 8, -3),
        "rows-past-the-batch": bench.frame(bench.window(position, rows=9)),
        "rows-at-the-i32-limit": patched(window, 8, 0x7FFFFFFF),
        "a-decode-of-two-rows": patched(decode, 8, 2),
        "token-sideband-not-the-rows": patched(window, 12, 1),
        "a-position-sideband": patched(window, 16, 2),
        "position-past-the-cells": bench.frame(bench.window(250, rows=8)),
        "position-at-the-i32-limit": patched(window, 4, 0x7FFFFFFF),
        "position-before-zero": patched(window, 4, -1),
    }


HOSTILE = ["no-rows", "negative-rows", "rows-past-the-batch", "rows-at-the-i32-limit", "a-decode-of-two-rows",
           "token-sideband-not-the-rows", "a-position-sideband", "position-past-the-cells",
           "position-at-the-i32-limit", "position-before-zero"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layers", ["0:1", "1:2", "0:4"], ids=["first", "middle", "first-and-final"])
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_row_counts_and_positions_are_handed_back_unread(implementation: Any, make_bench: Any, layers: str,
                                                                 name: str) -> None:
    bench = make_bench(implementation, layers, window_primer=3, capacity=8, max_steps=64)
    carried = bench.window(bench.position, rows=2)
    hostile = _hostile(bench)[name]
    cells = bench.relay_side.context.kv_cells_used()
    outcome = bench.run(bench.frame(carried) + hostile)
    assert (outcome.status, outcome.steps, outcome.leftover) == (implementation.HANDED_BACK, 1, hostile)
    assert bench.read_exactly(bench.downstream, [len(bench.lane_side.lane_frame(carried, WireDType.F32))])
    assert bench.relay_side.context.kv_cells_used() == cells + 2  # nothing else ran


# -- hop by hop: the downstream's replies answered upstream ------------------------------------------
MIDDLE = StageIdentity(False, 1, 2)
MIDDLE.index = 1


def downstream_reply(token: int, records: int, *, compute_us: int = 5, top: int | None = None) -> bytes:
    """A reply as the stages after the middle one send it: a Logprobs frame of ``top``
    alternatives (None: none), ``records`` Timings records (none: a plain v11 reply) and a
    PredictedToken."""
    from skippy.codec.protocol_ext import LogprobsFrame, TokenLogprobs

    timings = TimingsFrame(tuple(extensions.own_record(StageIdentity(False, 2 + index, 3 + index), batch_size=1,
                                                       compute_us=compute_us + index, write_us=index, wait_us=7,
                                                       queue_us=3) for index in range(records)))
    logprobs = () if top is None else (LogprobsFrame(top, (TokenLogprobs(
        token, -0.125 * (token % 7), tuple((token + slot, -0.5 * slot - 0.01 * token) for slot in range(top))),)),)
    return extensions.reply_bytes(StageReply.predicted_token(token, stats=EMPTY_REPLY_STATS),
                                  timings if records else None, logprobs)


def lane_answer(reply: bytes, negotiated: bool) -> bytes:
    """What the lane answers upstream for the downstream's ``reply`` (skippy.lane.replies.relayed),
    this stage's durations zeroed."""
    from skippy.lane import replies
    from skippy.lane.protocol import Expect, Forward, Relay, StageLane, Ticket

    decoder = codec.ReplyDecoder(extensions=True)
    decoder.receive_data(reply)
    frames = []
    while not isinstance(frame := decoder.next_reply(), StageReply):
        frames.append(frame)
    decoded = frame
    timings = next((frame for frame in frames if isinstance(frame, TimingsFrame)), None)
    annotations = tuple(frame for frame in frames if not isinstance(frame, TimingsFrame))
    lane = StageLane(0, 1)
    if negotiated:
        lane.extensions.observe(decode_message(0, flags=SKIPPY_EXTENSIONS_FLAG))
    forward = Forward(decode_message(0), Expect.RELAY_PREDICTION, Ticket(MessageKind.DECODE_EMBD), SESSION, 0, 0.0,
                      batch_size=1)
    answer, timings, annotations = replies.relayed(lane, Relay(forward, prediction=True), decoded, decoded.stats,
                                                   timings, annotations, identity=MIDDLE, wait_us=0, now_us=0)
    return extensions.reply_bytes(answer, timings, annotations)


def without_own_durations(answer: bytes) -> bytes:
    """A middle stage's answer with its own record's durations zeroed (the last record's)."""
    head = 0
    if int.from_bytes(answer[:4], "little") == 0x5E04:  # a Logprobs frame first
        head = 12 + 8 * (1 + int.from_bytes(answer[8:12], "little"))
    if int.from_bytes(answer[head:head + 4], "little") != 0x5E01:
        return answer
    count = int.from_bytes(answer[head + 4:head + 8], "little")
    start = head + 8 + 48 * (count - 1) + 16
    return answer[:start] + bytes(32) + answer[start + 32:]


def make_hop_bench(make_bench: Any, implementation: Any, records: int, negotiated: bool, top: int | None = None,
                   **options: Any) -> Any:
    template = downstream_reply(11, records, top=top)
    return make_bench(implementation, "1:2", hop=(template, lane_answer(template, negotiated)), **options)


def read_answers(bench: Bench, count: int) -> list[bytes]:
    """``count`` answers the relay wrote upstream (this stage's durations zeroed)."""
    assert bench.hop is not None
    length = len(bench.hop[1])
    bench.upstream.settimeout(5)
    answers = []
    for _ in range(count):
        data = b""
        while len(data) < length:
            data += bench.upstream.recv(length - len(data))
        answers.append(without_own_durations(data))
    return answers


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("records", [0, 1, 3], ids=["v11-downstream", "one-record", "three-records"])
@pytest.mark.parametrize("negotiated", [True, False], ids=["negotiated", "v11-upstream"])
@pytest.mark.parametrize("top", [None, 0, 3], ids=["plain", "logprobs", "top-logprobs"])
def test_a_middle_stage_answers_hop_by_hop_exactly_as_the_lane(implementation: Any, make_bench: Any, records: int,
                                                                negotiated: bool, top: int | None) -> None:
    bench = make_hop_bench(make_bench, implementation, records, negotiated, top)
    messages = [bench.message(bench.position + index) for index in range(5)]
    downstream = [downstream_reply(100 + index, records, compute_us=40 + index, top=top) for index in range(5)]
    bench.downstream.sendall(b"".join(downstream))  # each is read after its frame is written
    outcome = bench.run(b"".join(bench.frame(message) for message in messages), close=True)
    assert outcome.status == implementation.HANDED_BACK and outcome.steps == 5 and outcome.leftover == b""
    assert bench.forwarded(5) == [bench.lane_side.lane_frame(message, WireDType.F32) for message in messages]
    assert read_answers(bench, 5) == [lane_answer(reply, negotiated) for reply in downstream]
    assert outcome.replies_in == sum(map(len, downstream)) and outcome.replies_out == 5 * len(bench.hop[1])
    assert outcome.reply_leftover == b""


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("behind", ["upstream", "downstream"])
def test_hop_by_hop_a_reader_that_falls_behind_is_waited_for_until_the_runtime_is_wanted(
        implementation: Any, make_bench: Any, behind: str) -> None:
    """A middle stage hop by hop whose upstream stops reading its answers, or whose next stage
    stops reading its frames: the loop neither computes nor answers into a socket with no room
    (a write would hold the runtime thread): it waits in its poll, and the scheduler's stop
    hands the run back: answers to the lane (REPLY_PENDING, with the messages in flight), frames
    unread (the replies of those it forwarded are still read and answered meanwhile)."""
    bench = make_hop_bench(make_bench, implementation, 1, True)
    relay_end = bench._ends[0] if behind == "upstream" else bench._ends[1]
    relay_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    messages = [bench.message(bench.position + index) for index in range(200)]
    frames = [bench.frame(message) for message in messages]
    bench.downstream.sendall(b"".join(downstream_reply(100 + index, 1) for index in range(200)))
    watchdog = threading.Timer(10, os.eventfd_write, (bench.abort_fd, 1))
    watchdog.start()
    threading.Timer(0.3, os.eventfd_write, (bench.stop_fd, 1)).start()  # another lane wants the runtime
    try:
        outcome = bench.run(b"".join(frames))
    finally:
        watchdog.cancel()
    if behind == "upstream":
        assert outcome.status == implementation.REPLY_PENDING and 0 < outcome.steps < 200, outcome.status
        assert outcome.in_flight  # (the lane reads their replies and answers them in trio)
    else:  # (the replies of the messages it forwarded were read and answered meanwhile)
        assert outcome.status == implementation.STOPPED and 0 < outcome.steps < 200, outcome.status
        assert b"".join(frames[outcome.steps:]).startswith(outcome.leftover)
        assert len(outcome.leftover) >= len(frames[outcome.steps])
    _drain(bench.upstream)
    _drain(bench.downstream)


def _replies_not_carried() -> dict[str, bytes]:
    from skippy.codec.protocol_ext import ErrorCode, ErrorFrame, LogprobsFrame, TokenLogprobs

    negative = bytearray(downstream_reply(12, 1))
    negative[8 + 16 + 7] = 0x80  # the record's compute_us < 0: the lane's decoder refuses it
    logprobs = downstream_reply(12, 1, top=1)  # (the template's shape: make_hop_bench's top=1)
    nan, positive, token = bytearray(logprobs), bytearray(logprobs), bytearray(logprobs)
    nan[12 + 8 + 4:12 + 8 + 8] = struct.pack("<f", float("nan"))  # the alternative's log-probability
    positive[12 + 4:12 + 8] = struct.pack("<f", 0.5)
    token[12 + 8:12 + 12] = struct.pack("<i", -3)
    return {
        "error": codec.encode_error(ErrorFrame(ErrorCode.INTERNAL, 2, 2, "", "boom")),
        "logprobs": codec.encode_logprobs(LogprobsFrame(0, (TokenLogprobs(12, -0.5),))) + downstream_reply(12, 1),
        "two-records": downstream_reply(12, 2),
        "no-records": downstream_reply(12, 0),
        "negative-duration": bytes(negative),
        "ack": codec.encode_reply(StageReply.ack()),
        "nan-logprob": bytes(nan),
        "positive-logprob": bytes(positive),
        "negative-logprob-token": bytes(token),
    }


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", [*_replies_not_carried(), "end-of-stream", "stop"])
def test_a_reply_it_does_not_carry_comes_back_with_the_message_in_flight(implementation: Any, make_bench: Any,
                                                                         name: str) -> None:
    top = 1 if "logprob" in name else None
    bench = make_hop_bench(make_bench, implementation, 1, True, top)
    messages = [bench.message(bench.position + index) for index in range(3)]
    frames = [bench.frame(message) for message in messages]
    reply = _replies_not_carried().get(name, b"")
    bench.downstream.sendall(downstream_reply(100, 1, top=top) + reply)
    if name == "end-of-stream":
        bench.downstream.shutdown(socket.SHUT_WR)
    if name == "stop":
        threading.Timer(0.05, os.eventfd_write, (bench.stop_fd, 1)).start()
    outcome = bench.run(b"".join(frames))
    assert outcome.status == implementation.REPLY_PENDING and outcome.steps == 1
    # the loop pipelines: both messages after the first were forwarded while its reply was awaited,
    # and come back in flight, the oldest (whose reply was not carried) first
    assert outcome.leftover == frames[1] + frames[2]
    assert [entry[0] for entry in outcome.in_flight] == [len(frames[1]), len(frames[2])]
    assert all(compute > 0 and sent > 0 for _, compute, _, sent in outcome.in_flight)
    assert reply.startswith(outcome.reply_leftover) and (outcome.reply_leftover or not reply)
    assert outcome.pending_compute_us > 0 and outcome.pending_sent_us > 0
    assert bench.forwarded(3) == [bench.lane_side.lane_frame(message, WireDType.F32) for message in messages]
    assert read_answers(bench, 1) == [lane_answer(downstream_reply(100, 1, top=top), True)]
    assert bench.relay_side.context.length(bench.relay_side.seq) == bench.position + 3  # the ones in flight ran


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_lost_upstream_fails_the_answer(implementation: Any, make_bench: Any) -> None:
    bench = make_hop_bench(make_bench, implementation, 1, True)
    bench.downstream.sendall(downstream_reply(100, 1))
    bench.upstream.sendall(bench.frame(bench.message(bench.position)))
    bench.upstream.close()  # the answer's write fails (the upstream reset)
    outcome = bench.relay.run(b"")
    assert outcome.status == implementation.UPSTREAM_FAILED and outcome.steps == 1


def window_downstream_reply(tokens: list[int], window_id: int, records: int, *, compute_us: int = 5) -> bytes:
    """A verify window's reply as the stages after the middle one send it (their verify-window
    sums and ``records`` Timings records)."""
    from skippy.lane.messages import window_prediction
    from skippy.lane.stats import timing_stats
    from skippy.lane.work import WorkResult

    reply = window_prediction(WorkResult(tokens=tokens, compute_us=compute_us), EMPTY_REPLY_STATS,
                              window_id=window_id, total_us=3 * compute_us)
    for index in range(1, records):  # the stages between: their shares summed in
        reply = dataclasses.replace(reply, stats=timing_stats(reply.stats, compute_us=compute_us + index, write_us=2,
                                                              wait_us=9, total_us=40, batch_size=1))
    timings = TimingsFrame(tuple(extensions.own_record(StageIdentity(False, 2 + index, 3 + index), batch_size=1,
                                                       compute_us=compute_us + index, write_us=index, wait_us=7,
                                                       queue_us=3) for index in range(records)))
    return extensions.reply_bytes(reply, timings if records else None)


def window_lane_answer(reply: bytes, negotiated: bool) -> bytes:
    """What the lane answers upstream for a window's ``reply`` (relayed, this stage's durations 0)."""
    from skippy.lane import replies
    from skippy.lane.protocol import Expect, Forward, Relay, StageLane, Ticket

    decoder = codec.ReplyDecoder(extensions=True)
    decoder.receive_data(reply)
    timings = None
    while not isinstance(frame := decoder.next_reply(), StageReply):
        timings = frame
    lane = StageLane(0, 1)
    if negotiated:
        lane.extensions.observe(decode_message(0, flags=SKIPPY_EXTENSIONS_FLAG))
    forward = Forward(window_message(0, np.zeros(4, dtype=np.int32), window_id=1), Expect.RELAY_PREDICTION,
                      Ticket(MessageKind.VERIFY_WINDOW), SESSION, 0, 0.0, batch_size=1)
    answer, timings, _ = replies.relayed(lane, Relay(forward, prediction=True), frame, frame.stats, timings, (),
                                         identity=MIDDLE, wait_us=0, now_us=0)
    return extensions.reply_bytes(answer, timings)


def window_sums(answer: bytes, records: int, rows: int = 4) -> tuple[bytes, tuple[int, ...]]:
    """An answer with its verify-window sums zeroed (and its own record's durations), and the sums."""
    head = 8 + 48 * records if records else 0
    start = head + 12 + 4 * rows + 8 + 72
    sums = struct.unpack_from("<4q", answer, start)
    return without_own_durations(answer[:start] + bytes(32) + answer[start + 32:]), sums


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("records", [0, 1, 2], ids=["v11-downstream", "one-record", "two-records"])
@pytest.mark.parametrize("negotiated", [True, False], ids=["negotiated", "v11-upstream"])
def test_a_middle_stage_answers_windows_hop_by_hop_exactly_as_the_lane(implementation: Any, make_bench: Any,
                                                                       records: int, negotiated: bool) -> None:
    template = window_downstream_reply([11, 12, 13, 14], 100, records)
    bench = make_bench(implementation, "1:2", rows=4, hop=(template, window_lane_answer(template, negotiated)))
    starts = [0, 4, 5, 9]  # the third window follows a rejection of three drafts: trimmed
    messages = [bench.message(bench.position + start) for start in starts]
    downstream = [window_downstream_reply([200 + index + row for row in range(4)], message.state.seq_id, records,
                                          compute_us=40 + index) for index, message in enumerate(messages)]
    bench.downstream.sendall(b"".join(downstream))
    outcome = bench.run(b"".join(bench.frame(message) for message in messages), close=True)
    assert outcome.status == implementation.HANDED_BACK and outcome.steps == 4 and outcome.leftover == b""
    assert (outcome.trims, outcome.trimmed) == (1, 3)
    assert bench.forwarded(4) == [bench.lane_side.lane_frame(message, WireDType.F32) for message in messages]
    assert bench.hop is not None
    length = len(bench.hop[1])
    bench.upstream.settimeout(5)
    for reply in downstream:
        data = b""
        while len(data) < length:
            data += bench.upstream.recv(length - len(data))
        count = records + 1 if negotiated else 0  # (a v11 upstream gets no Timings frame)
        expected, lane_sums = window_sums(window_lane_answer(reply, negotiated), count)
        answer, sums = window_sums(data, count)
        assert answer == expected  # tokens, window id, counts, records: the lane's
        assert all(mine >= theirs for mine, theirs in zip(sums, lane_sums))  # this stage's share added
        assert sums[0] > lane_sums[0]  # (its compute, at least a microsecond)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("records", [0, 2], ids=["v11-downstream", "two-records"])
def test_a_middle_stage_answers_windows_and_decodes_interleaved_hop_by_hop(implementation: Any, make_bench: Any,
                                                                           records: int) -> None:
    """Hop by hop, one run carries :data:`SPECULATION` (windows of every size, decodes, rollbacks)
    and answers each reply upstream as the lane does: a decode's PredictedToken, a window's
    PredictedTokens of its rows with this stage's verify-window share added."""
    decode_template = downstream_reply(11, records)
    window_template = window_downstream_reply([11, 12, 13], 100, records)
    bench = make_bench(implementation, "1:2", hop=(decode_template, lane_answer(decode_template, True)),
                       window_primer=3, window_hop=(window_template, window_lane_answer(window_template, True)),
                       capacity=8)
    messages, trims, _ = speculation(bench)
    downstream = [window_downstream_reply([200 + index + row for row in range(message.token_count)],
                                          message.state.seq_id, records, compute_us=40 + index)
                  if message.kind is MessageKind.VERIFY_WINDOW else downstream_reply(300 + index, records)
                  for index, message in enumerate(messages)]
    bench.downstream.sendall(b"".join(downstream))
    outcome = bench.run(b"".join(bench.frame(message) for message in messages), close=True)
    assert (outcome.status, outcome.steps, outcome.leftover) == (implementation.HANDED_BACK, len(messages), b"")
    assert outcome.trims == trims >= 4
    expected = [bench.lane_side.lane_frame(message, WireDType.F32) for message in messages]
    assert bench.read_exactly(bench.downstream, [len(frame) for frame in expected]) == expected
    lanes = [window_lane_answer(reply, True) if message.kind is MessageKind.VERIFY_WINDOW else lane_answer(reply, True)
             for message, reply in zip(messages, downstream)]
    answers = bench.read_exactly(bench.upstream, [len(answer) for answer in lanes])
    for message, answer, lane in zip(messages, answers, lanes):
        if message.kind is MessageKind.VERIFY_WINDOW:
            (mine, sums), (theirs, lane_sums) = (window_sums(frame, records + 1, message.token_count)
                                                 for frame in (answer, lane))
            assert mine == theirs  # tokens, window id, counts, records: the lane's
            assert all(a >= b for a, b in zip(sums, lane_sums)) and sums[0] > lane_sums[0]  # this stage's share
        else:
            assert without_own_durations(answer) == without_own_durations(lane)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("rows", [1, 4], ids=["decodes", "windows"])
@pytest.mark.parametrize("end", ["end-of-stream", "refused"])
def test_an_upstream_that_pipelines_has_every_message_carried_and_answered_in_order(implementation: Any,
                                                                                   make_bench: Any, rows: int,
                                                                                   end: str) -> None:
    """The loop pipelines as the lane's path does: the upstream's next message arriving while a
    reply is outstanding (a speculating driver's pipelined windows) is computed and forwarded at
    once, and the replies are answered in order as they come; a message it does not carry arriving
    meanwhile (another session's) stops the reading, and the run hands it back unread once the
    messages in flight are answered."""
    if rows == 1:
        template = downstream_reply(11, 1)
        answer = lane_answer(template, True)
    else:
        template = window_downstream_reply([11, 12, 13, 14], 100, 1)
        answer = window_lane_answer(template, True)
    bench = make_bench(implementation, "1:2", rows=rows, hop=(template, answer))
    first, second = bench.message(bench.position), bench.message(bench.position + rows)
    if rows == 1:
        replies = [downstream_reply(100, 1), downstream_reply(101, 1)]
    else:  # (a reply's window id is its message's)
        replies = [window_downstream_reply([20 + index, 21, 22, 23], message.state.seq_id, 1)
                   for index, message in enumerate((first, second))]

    refused = bench.frame(bench.message(bench.position + 2 * rows, session=SESSION + 1)) if end == "refused" else b""

    def pipelined() -> None:  # the second message while the first's reply is outstanding, then the end
        bench.upstream.sendall(bench.frame(second) + refused)
        if not refused:
            bench.upstream.shutdown(socket.SHUT_WR)

    threading.Timer(0.1, pipelined).start()
    threading.Timer(0.3, bench.downstream.sendall, (b"".join(replies),)).start()
    outcome = bench.run(bench.frame(first))
    assert (outcome.status, outcome.steps, outcome.leftover) == (implementation.HANDED_BACK, 2, refused)
    expected = [bench.lane_side.lane_frame(message, WireDType.F32) for message in (first, second)]
    assert bench.read_exactly(bench.downstream, [len(frame) for frame in expected]) == expected
    lanes = [lane_answer(reply, True) if rows == 1 else window_lane_answer(reply, True) for reply in replies]
    answers = bench.read_exactly(bench.upstream, [len(lane) for lane in lanes])
    if rows == 1:
        assert [without_own_durations(frame) for frame in answers] == [without_own_durations(lane) for lane in lanes]
    else:
        assert [window_sums(frame, 2)[0] for frame in answers] == [window_sums(lane, 2)[0] for lane in lanes]
    assert outcome.wait_us > 0


def _interleaved_bench(make_bench: Any, implementation: Any, records: int, in_flight: tuple[int, ...]) -> Bench:
    """A middle stage's bench whose run carries decodes and windows (up to 8 rows), hop by hop."""
    decode_template = downstream_reply(11, records)
    window_template = window_downstream_reply([11, 12, 13], 100, records)
    return make_bench(implementation, "1:2", hop=(decode_template, lane_answer(decode_template, True)),
                      window_primer=3, window_hop=(window_template, window_lane_answer(window_template, True)),
                      capacity=8, in_flight=in_flight)


def _downstream_replies(messages: list[StageMessage], records: int) -> list[bytes]:
    return [window_downstream_reply([200 + index + row for row in range(message.token_count)], message.state.seq_id,
                                    records, compute_us=40 + index)
            if message.kind is MessageKind.VERIFY_WINDOW else downstream_reply(300 + index, records)
            for index, message in enumerate(messages)]


def _check_answers(bench: Bench, messages: list[StageMessage], downstream: list[bytes], records: int) -> None:
    """The relay's answers upstream to ``downstream`` are the lane's (this stage's durations aside)."""
    lanes = [window_lane_answer(reply, True) if message.kind is MessageKind.VERIFY_WINDOW else lane_answer(reply, True)
             for message, reply in zip(messages, downstream)]
    answers = bench.read_exactly(bench.upstream, [len(answer) for answer in lanes])
    for message, answer, lane in zip(messages, answers, lanes):
        if message.kind is MessageKind.VERIFY_WINDOW:
            (mine, sums), (theirs, lane_sums) = (window_sums(frame, records + 1, message.token_count)
                                                 for frame in (answer, lane))
            assert mine == theirs  # tokens, window id, counts, records: the lane's
            assert all(a >= b for a, b in zip(sums, lane_sums)) and sums[0] > lane_sums[0]  # this stage's share
        else:
            assert without_own_durations(answer) == without_own_durations(lane)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("records", [0, 2], ids=["v11-downstream", "two-records"])
def test_a_run_answers_the_lanes_messages_in_flight_first_then_its_own(implementation: Any, make_bench: Any,
                                                                        records: int) -> None:
    """A pipelining upstream never lets the lane go quiet: a run starts with the lane's messages in
    flight (forwarded by the lane, their replies unread: ``adopted``), answers their replies
    first, in order and as the lane would, then its own; it forwards only its own, and its first
    (a window after a rejection) trims the rows the lane computed: no KV cell leaked."""
    bench = _interleaved_bench(make_bench, implementation, records, (4, 1, 2))
    taken = bench.adopted()
    base = bench.position
    cells = bench.relay_side.context.kv_cells_used()
    # the last window in flight kept 1 of its 2 rows: the run's first message rolls its second back
    messages = [bench.window(base - 1, rows=3), bench.message(base + 2), bench.window(base + 3, rows=8)]
    every = [*bench.in_flight, *messages]
    downstream = _downstream_replies(every, records)
    bench.downstream.sendall(b"".join(downstream))
    outcome = bench.run(b"".join(bench.frame(message) for message in messages), close=True, adopted=taken)
    assert (outcome.status, outcome.steps, outcome.adopted, outcome.leftover) == (implementation.HANDED_BACK, 3, 3, b"")
    assert (outcome.trims, outcome.trimmed, outcome.windows, outcome.rows) == (1, 1, 2, 12)
    expected = [bench.lane_side.lane_frame(message, WireDType.F32) for message in messages]
    assert bench.read_exactly(bench.downstream, [len(frame) for frame in expected]) == expected
    _check_answers(bench, every, downstream, records)
    assert bench.relay_side.context.kv_cells_used() == cells - 1 + 3 + 1 + 8 == bench.lane_side.context.kv_cells_used()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("at", [0, 1, 2, 3], ids=["first-taken-over", "second-taken-over", "the-runs-first",
                                                  "the-runs-second"])
@pytest.mark.parametrize("reply", ["error", "ack", "end-of-stream", "stop"])
def test_a_reply_it_does_not_carry_hands_back_the_lanes_messages_and_its_own_in_order(
        implementation: Any, make_bench: Any, at: int, reply: str) -> None:
    """With the lane's messages in flight, a reply the loop does not carry (an Error frame, an
    ACK, end of stream, or a stop while it waits) at any point hands every message still in
    flight back, oldest first: the lane's (length 0: their frames are the lane's) before the
    run's own (at the head of the leftover), and what was read of the reply."""
    from skippy.codec.protocol_ext import ErrorCode, ErrorFrame

    bench = _interleaved_bench(make_bench, implementation, 1, (1, 4))
    taken = bench.adopted()
    messages = [bench.message(bench.position), bench.window(bench.position + 1, rows=2)]
    frames = [bench.frame(message) for message in messages]
    every = [*bench.in_flight, *messages]
    good = _downstream_replies(every, 1)[:at]
    bad = {"error": codec.encode_error(ErrorFrame(ErrorCode.INTERNAL, 2, 2, "", "boom")),
           "ack": codec.encode_reply(StageReply.ack())}.get(reply, b"")
    bench.downstream.sendall(b"".join(good) + bad)
    if reply == "end-of-stream":
        bench.downstream.shutdown(socket.SHUT_WR)
    if reply == "stop":
        threading.Timer(0.1, os.eventfd_write, (bench.stop_fd, 1)).start()
    # (the lane had read the run's messages: both are forwarded before any reply is awaited)
    outcome = bench.relay.run(b"".join(frames), taken)
    assert outcome.status == implementation.REPLY_PENDING
    assert (outcome.adopted, outcome.steps) == (min(at, 2), max(0, at - 2))
    left = [0] * (2 - min(at, 2)) + [len(frame) for frame in frames[max(0, at - 2):]]
    assert [entry[0] for entry in outcome.in_flight] == left
    assert outcome.leftover == b"".join(frames[max(0, at - 2):])
    assert bad.startswith(outcome.reply_leftover) and (outcome.reply_leftover or not bad)
    expected = [bench.lane_side.lane_frame(message, WireDType.F32) for message in messages]
    assert bench.read_exactly(bench.downstream, [len(frame) for frame in expected]) == expected
    _check_answers(bench, every[:at], good, 1)
    assert bench.relay_side.context.length(bench.relay_side.seq) == bench.position + 3  # the run's own ran


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_messages_in_flight_a_run_may_not_take_over_are_refused(implementation: Any, make_bench: Any) -> None:
    bench = _interleaved_bench(make_bench, implementation, 1, ())
    now = time.perf_counter_ns()
    assert bench.relay.adopts(int(MessageKind.DECODE_EMBD), 1) and bench.relay.adopts(int(MessageKind.VERIFY_WINDOW), 8)
    for kind, rows, count in [(MessageKind.DECODE_EMBD, 2, 1), (MessageKind.VERIFY_WINDOW, 9, 1),
                              (MessageKind.VERIFY_WINDOW, 0, 1), (MessageKind.PREFILL_EMBD, 1, 1),
                              (MessageKind.DECODE_EMBD, 1, implementation.MAX_IN_FLIGHT + 1)]:
        with pytest.raises(ValueError, match="may not take over"):
            bench.relay.run(b"", ((int(kind), rows, 1, 1, now // 1000, now, now),) * count)
    final = make_bench(implementation, "1:4")  # (no replies: nothing in flight to take over)
    assert not final.relay.adopts(int(MessageKind.DECODE_EMBD), 1)


def test_hop_templates_the_relay_cannot_carry_are_refused() -> None:
    template = downstream_reply(11, 1)
    answer = lane_answer(template, True)
    with pytest.raises(ValueError, match="plus one record"):
        _relay_py.hop_layout(template, lane_answer(downstream_reply(11, 2), True))
    with pytest.raises(ValueError, match="prediction"):
        _relay_py.hop_layout(template, answer[:-8] + (1).to_bytes(8, "little"))  # stats merged into some
    with pytest.raises(ValueError, match="records"):
        _relay_py.hop_layout(template, answer[:8] + bytes([1]) + answer[9:])
    with pytest.raises(ValueError, match="PredictedToken"):
        _relay_py.hop_layout(template + b"\0", answer)


# -- lanes: in-process chains with the relay on and off ----------------------------------------------
from stage_helpers import reference_greedy  # noqa: E402

from skippy.driver import StageClient  # noqa: E402
from skippy.net.address import Address  # noqa: E402
from skippy.stage.config import config_from_mapping  # noqa: E402
from skippy.stage.server import StageServer, close_runtime, load_runtime  # noqa: E402

SPLITS = ["0:1", "1:2", "2:4"]


class Tap:
    """A TCP proxy in front of a stage, keeping every byte sent towards it (the messages)."""

    def __init__(self, target: Address) -> None:
        self.target = target
        self.sent = bytearray()
        #: The first connection's replies: bytes the stage answered, and (while set) an event
        #: they wait for before passing on.
        self.answered = 0
        self.hold: trio.Event | None = None
        self._connections = 0

    async def serve(self, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        task_status.started(Address("127.0.0.1", port))
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream(self.target.host, self.target.port)
        first = self._connections == 0
        self._connections += 1

        async def pump(source: trio.SocketStream, sink: trio.SocketStream, keep: bytearray | None) -> None:
            try:
                async for chunk in source:
                    if keep is not None:
                        keep += chunk
                    elif first:
                        self.answered += len(chunk)
                        while self.hold is not None:
                            await self.hold.wait()
                    await sink.send_all(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                await trio.aclose_forcefully(sink)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server, self.sent)
            nursery.start_soon(pump, server, client, None)


class TappedChain:
    """Stage servers of the tiny llama in this trio run, a :class:`Tap` in front of every stage
    after the first (so each tap holds what the stage before it forwarded)."""

    def __init__(self, servers: list[StageServer], taps: list[Tap]) -> None:
        self.servers, self.taps = servers, taps

    @property
    def first(self) -> Address:
        address = self.servers[0].address
        assert address is not None
        return address

    @property
    def final(self) -> Address:
        address = self.servers[-1].address
        assert address is not None
        return address


#: The stage servers a test started (:func:`_tapped_chain`): their runtimes are freed after it.
_STARTED: list[StageServer] = []


@pytest.fixture(autouse=True)
def _free_runtimes() -> Iterator[None]:
    yield  # (the test's trio run has ended: its servers returned)
    while _STARTED:
        close_runtime(_STARTED.pop().executor)


async def _tapped_chain(nursery: trio.Nursery, model: Path, relay: bool, splits: list[str] = SPLITS) -> TappedChain:
    servers: list[StageServer] = []
    taps: list[Tap] = []
    downstream: Address | None = None
    for index, layers in reversed(list(enumerate(splits))):
        config = config_from_mapping({"model": str(model), "layers": layers, "downstream": downstream,
                                      "batch_size": 64, "ctx_size": 512, "connect_timeout": 2,
                                      "decode_relay": relay, "threads": 1})
        server = StageServer(config, load_runtime(config))
        _STARTED.append(server)
        address = await nursery.start(server.serve)
        servers.insert(0, server)
        if index > 0:
            tap = Tap(address)
            taps.insert(0, tap)
            address = await nursery.start(tap.serve)
        downstream = address
    return TappedChain(servers, taps)


async def _session(client: StageClient, chain: TappedChain, session: int, prompt: list[int], steps: int,
                   rollback_at: int | None = None) -> list[int]:
    """A direct-return session: prefill, ``steps`` decodes (rolled back two positions once, at
    step ``rollback_at``, as a rejected draft would), stop."""
    await client.configure(session, prompt_token_count=len(prompt))
    assert await client.open_direct_return(chain.final, session)
    tokens = [(await client.prefill(session, prompt, chunk_size=3)).token]
    position = len(prompt)
    for step in range(steps):
        if step == rollback_at:
            position -= 2
            del tokens[-2:]
        tokens.append((await client.decode(session, tokens[-1], position, decode_step=step)).predicted)
        position += 1
    await client.stop(session)
    return tokens


async def test_the_relay_sends_the_bytes_the_lane_sends_and_the_unsplit_tokens(tiny_llama: Path) -> None:
    prompts = [PROMPT, [1, 13, 4013, 338, 263, 1243]]
    reference = [reference_greedy(tiny_llama, prompt, 25, chunk_size=3) for prompt in prompts]
    sent: dict[bool, list[bytes]] = {}
    for relay in (True, False):
        async with trio.open_nursery() as nursery:
            chain = await _tapped_chain(nursery, tiny_llama, relay)
            # an idle lane beside the working one (as an API pool keeps) does not keep the relay off
            async with await StageClient.connect(chain.first) as client, await StageClient.connect(chain.first):
                tokens = [await _session(client, chain, index + 1, prompt, 24) for index, prompt in enumerate(prompts)]
            assert tokens == reference
            stats = [server.stats for server in chain.servers]
            carried = 2 * 23  # every decode but each session's first
            assert [s.decode_relay_steps for s in stats] == ([carried] * 3 if relay else [0, 0, 0])  # the final too
            assert all(s.decode_items == 2 * 24 and s.connection_errors == 0 for s in stats)
            sent[relay] = [bytes(tap.sent) for tap in chain.taps]
            nursery.cancel_scope.cancel()
    assert sent[True] == sent[False]  # every forwarded frame, byte for byte
    assert all(len(frames) > 2 * 24 * 76 for frames in sent[True])


@pytest.mark.parametrize("splits", [SPLITS, ["0:4"]], ids=["three-stages", "one-stage"])
async def test_a_return_lane_closing_under_the_final_stages_relay_ends_the_run(tiny_llama: Path,
                                                                              splits: list[str]) -> None:
    """The driver drops the return lane while the final stage's relay holds it: the lane's close
    aborts the run (no write into a closed socket, no close waiting on the run), and the session
    goes on hop by hop with the same tokens."""
    async with trio.open_nursery() as nursery:
        chain = await _tapped_chain(nursery, tiny_llama, True, splits)
        final = chain.servers[-1]
        async with await StageClient.connect(chain.first) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            assert await client.open_direct_return(chain.final, 1)
            tokens = [(await client.prefill(1, PROMPT, chunk_size=3)).token]
            for step in range(4):  # relayed on every stage after the first decode
                tokens.append((await client.decode(1, tokens[-1], len(PROMPT) + step, decode_step=step)).predicted)
            assert final.stats.decode_relay_runs == 0  # the run is still going (accounted at its end)
            await client.close_direct_return()
            with trio.fail_after(5):  # the return lane's close ended the final stage's run
                while final.stats.decode_relay_runs == 0 or final.stats.return_lanes_open:
                    await trio.sleep(0.01)
            assert final.stats.decode_relay_steps == 3
            for step in range(4, 8):  # hop by hop now: the relays hand the unflagged frames back
                tokens.append((await client.decode(1, tokens[-1], len(PROMPT) + step, decode_step=step)).predicted)
            await client.stop(1)
        assert tokens == reference_greedy(tiny_llama, PROMPT, 9, chunk_size=3)
        assert all(server.stats.connection_errors == 0 for server in chain.servers)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("splits", [SPLITS, ["0:4"]], ids=["three-stages", "one-stage"])
async def test_other_work_a_rollback_and_a_shutdown_interrupt_a_run(tiny_llama: Path, splits: list[str]) -> None:
    other_prompt = [1, 13, 4013, 338, 263, 1243]
    results: dict[bool, tuple[list[int], list[int], list[int]]] = {}
    for relay in (True, False):
        async with trio.open_nursery() as nursery:
            chain = await _tapped_chain(nursery, tiny_llama, relay, splits)
            async with await StageClient.connect(chain.first) as client:
                # a session decoding (relayed after its first decode) while a second lane runs a
                # whole request in the middle of it: its jobs stop the runs, the second lane's
                # requests take the lane's path, and the first session's relay starts again after
                await client.configure(1, prompt_token_count=len(PROMPT))
                assert await client.open_direct_return(chain.final, 1)
                tokens = [(await client.prefill(1, PROMPT, chunk_size=3)).token]
                for step in range(12):
                    if step == 6:
                        async with await StageClient.connect(chain.first) as other:
                            other_tokens = await _session(other, chain, 2, other_prompt, 10)
                        await trio.sleep(RECENT_WORK_S + 0.1)  # until then the two lanes' rows would batch
                    tokens.append((await client.decode(1, tokens[-1], len(PROMPT) + step, decode_step=step)).predicted)
                await client.stop(1)
                rolled = await _session(client, chain, 3, PROMPT, 12, rollback_at=7)
                results[relay] = (tokens, other_tokens, rolled)
                if relay:
                    stats = chain.servers[0].stats
                    assert stats.decode_relay_runs >= 3 and stats.decode_relay_steps >= 12
                # a run waiting for its next frame when the stages shut down: it is stopped, joined,
                # and the lane closes (a thread left waiting would hang this scope)
                await client.configure(4, prompt_token_count=len(PROMPT))
                assert await client.open_direct_return(chain.final, 4)
                token = (await client.prefill(4, PROMPT, chunk_size=3)).token
                for step in range(3):
                    token = (await client.decode(4, token, len(PROMPT) + step, decode_step=step)).predicted
                with trio.fail_after(5):
                    for server in chain.servers:
                        server.shutdown()
                    while any(server.stats.connections_open for server in chain.servers):
                        await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert results[True] == results[False]
    reference = reference_greedy(tiny_llama, PROMPT, 13, chunk_size=3)
    assert results[True][0] == reference and results[True][2] == reference[:11]  # the rollback re-ran two


@pytest.mark.parametrize("splits", [SPLITS, ["0:4"]], ids=["three-stages", "one-stage"])
@pytest.mark.parametrize("hostile", ["gap", "short-token-sideband"])
async def test_a_hostile_window_during_relayed_windows_is_refused_by_the_lane(tiny_llama: Path, hostile: str,
                                                                              splits: list[str]) -> None:
    """Windows relayed hop by hop on every stage (a rejection trimmed; a one-stage chain's stage
    is first and final), then a window the loop does not carry: handed back unread, the lane
    refuses it with its own error (the lane closes)."""
    from skippy.driver.client import StageClientError

    async with trio.open_nursery() as nursery:
        chain = await _tapped_chain(nursery, tiny_llama, True, splits)
        async with await StageClient.connect(chain.first) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            token = (await client.prefill(1, PROMPT, chunk_size=3)).token
            position = len(PROMPT)
            for index, start in enumerate([0, 4, 6, 10]):  # the third follows a rejection of two drafts
                reply = await client.verify(1, [token, 5 + index, 6 + index, 7 + index], position + start,
                                            window_id=index + 1)
                assert len(reply.predicted_tokens) == 4
            tokens = np.array([token, 8, 9, 10], dtype=np.int32)
            if hostile == "gap":  # past the session's KV: the lane refuses a gap
                message = StageMessage.create(MessageKind.VERIFY_WINDOW, pos_start=position + 30, token_count=4,
                                              session_id=1, tokens=tokens, state_changes={"seq_id": 20})
                match = "authoritative position"
            else:  # 4 rows, 3 token ids
                message = StageMessage.create(MessageKind.VERIFY_WINDOW, pos_start=position + 18, token_count=4,
                                              session_id=1, tokens=tokens[:3], state_changes={"seq_id": 20})
                match = "token ids"
            await client.send(message)
            with pytest.raises(StageClientError, match=match):
                await client.receive()
        stats = [server.stats for server in chain.servers]
        with trio.fail_after(5):  # each stage's run is accounted when it ends (the lanes close behind the error)
            while min(s.decode_relay_windows for s in stats) < 2:  # (the second window repeats the first's shape)
                await trio.sleep(0.01)
        assert stats[0].connection_errors == 1 and stats[0].verify_windows >= 4
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "hop-by-hop"])
async def test_a_killed_final_stage_fails_a_relayed_request_within_2_s_naming_it(tiny_llama: Path,
                                                                                 tmp_path: Path, direct: bool) -> None:
    """Stage processes relaying a session's decode (every stage): the final one is killed while
    the others wait in their loops for the next frame; the request fails within 2 s, naming it
    (hop by hop: the middle stage's loop meets the loss writing the frame or waiting for its
    reply, and hands the message in flight back to its lane, which reports it upstream)."""
    from stage_helpers import stage_chain, wait_for_stats

    from skippy.driver import StageLost

    async with stage_chain(str(tiny_llama), SPLITS, tmp_path, ["--ctx-size", "512", "--batch-size", "64"]) as chain:
        final = chain[-1]
        assert chain[0].address is not None and final.address is not None
        async with await StageClient.connect(chain[0].address) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            assert not direct or await client.open_direct_return(final.address, 1)
            token = (await client.prefill(1, PROMPT, chunk_size=3)).token
            for step in range(6):
                token = (await client.decode(1, token, len(PROMPT) + step, decode_step=step)).predicted
            final.kill()
            started = time.monotonic()
            with pytest.raises(StageLost) as raised:
                await client.decode(1, token, len(PROMPT) + 6, decode_step=6)
            elapsed = time.monotonic() - started
        assert elapsed < 2, elapsed
        assert str(final.address.port) in str(raised.value), raised.value
        if not direct:
            return
        # the first stage's run ended with its lane (its relay counters reached the stats file)
        # the first stage's run ended with its lane, and was accounted: 5 tokens relayed, and the
        # one sent after the kill too when it reached the first stage before the loss did
        await wait_for_stats(chain[0], lambda stats: stats["decode_relay_steps"] in (5, 6)
                             and stats["decode_items"] == stats["decode_relay_steps"] + 1
                             and stats["connections_open"] == 0)


async def _hop_session(client: StageClient, session: int, prompt: list[int], steps: int) -> list[int]:
    """A hop-by-hop session: prefill, ``steps`` decodes (each answered back through every stage), stop."""
    await client.configure(session, prompt_token_count=len(prompt))
    tokens = [(await client.prefill(session, prompt, chunk_size=3)).token]
    for step in range(steps):
        tokens.append((await client.decode(session, tokens[-1], len(prompt) + step, decode_step=step)).predicted)
    await client.stop(session)
    return tokens


async def test_hop_by_hop_the_relay_sends_the_lanes_bytes_while_other_lanes_interrupt_it(tiny_llama: Path) -> None:
    """Two lanes decode hop by hop at once (each stage's loop is stopped by the other lane's work,
    often while it waits for a downstream reply: the lane then takes the message in flight over);
    then one alone (relayed on every stage).  The tokens are the unsplit ones, the frames each
    stage forwards the same with the relay on and off."""
    prompts = [PROMPT, [1, 13, 4013, 338, 263, 1243]]
    reference = [reference_greedy(tiny_llama, prompt, 21, chunk_size=3) for prompt in prompts]
    sent: dict[bool, list[bytes]] = {}
    for relay in (True, False):
        async with trio.open_nursery() as nursery:
            chain = await _tapped_chain(nursery, tiny_llama, relay)
            tokens: dict[int, list[int]] = {}

            async def lane(index: int) -> None:
                async with await StageClient.connect(chain.first) as client:
                    tokens[index] = await _hop_session(client, index + 1, prompts[index], 20)

            async with trio.open_nursery() as lanes:
                for index in range(2):
                    lanes.start_soon(lane, index)
            assert [tokens[0], tokens[1]] == reference
            steps = [server.stats.decode_relay_steps for server in chain.servers]
            before = [len(tap.sent) for tap in chain.taps]
            await trio.sleep(RECENT_WORK_S + 0.1)  # until then the other lane's rows would batch
            async with await StageClient.connect(chain.first) as client:
                assert await _hop_session(client, 3, PROMPT, 20) == reference[0]
            stats = [server.stats for server in chain.servers]
            if relay:  # alone, every decode but the first is carried by every stage's loop
                assert [s.decode_relay_steps - before for s, before in zip(stats, steps)] == [19] * 3
            else:
                assert [s.decode_relay_steps for s in stats] == [0, 0, 0]
            assert all(s.decode_items == 3 * 20 and s.connection_errors == 0 for s in stats)
            sent[relay] = [bytes(tap.sent[start:]) for tap, start in zip(chain.taps, before)]  # the lone lane's
            nursery.cancel_scope.cancel()
    assert sent[True] == sent[False] and all(sent[True])


async def test_a_reply_held_downstream_while_other_work_comes_is_taken_over_by_the_lane(tiny_llama: Path) -> None:
    """The final stage's reply to a relayed hop-by-hop decode is held (by the tap in front of it)
    while the middle and first stages' loops wait for it; another lane's request then needs their
    runtime: each loop hands the message in flight back to its lane (nothing else could run the
    other request), and when the reply is let through the lanes relay it: the same tokens."""
    other_prompt = [1, 13, 4013, 338, 263, 1243]
    async with trio.open_nursery() as nursery:
        chain = await _tapped_chain(nursery, tiny_llama, True)
        tap = chain.taps[-1]  # in front of the final stage
        async with await StageClient.connect(chain.first) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            tokens = [(await client.prefill(1, PROMPT, chunk_size=3)).token]
            position = len(PROMPT)

            async def decode() -> None:
                nonlocal position
                tokens.append((await client.decode(1, tokens[-1], position, decode_step=position)).predicted)
                position += 1

            for _ in range(4):  # relayed from the second on
                await decode()
            tap.hold = trio.Event()
            answered = tap.answered
            async with trio.open_nursery() as held:
                held.start_soon(decode)
                with trio.fail_after(5):
                    while tap.answered == answered:  # the final stage answered; the others wait for it
                        await trio.sleep(0.005)
                    async with await StageClient.connect(chain.first) as other:
                        other_tokens = await _hop_session(other, 2, other_prompt, 6)
                hold, tap.hold = tap.hold, None
                hold.set()
            await trio.sleep(RECENT_WORK_S + 0.1)
            for _ in range(4):
                await decode()
            await client.stop(1)
        assert tokens == reference_greedy(tiny_llama, PROMPT, 10, chunk_size=3)
        assert other_tokens == reference_greedy(tiny_llama, other_prompt, 7, chunk_size=3)
        stats = [server.stats for server in chain.servers]
        assert all(s.connection_errors == 0 and s.decode_items == 9 + 6 for s in stats)
        assert [s.decode_relay_steps > 3 for s in stats] == [True] * 3
        nursery.cancel_scope.cancel()


async def test_a_pipelining_upstream_is_carried_and_an_interruption_hands_the_lanes_messages_back_in_order(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upstream that keeps decodes in flight (sent ahead of their replies, as a pipelining
    driver sends its windows) never lets a lane go quiet: each stage's run starts with the lane's
    messages in flight and answers them first.  With the final stage's replies held, another
    lane's request stops the loops (each hands its messages in flight back); one more decode then
    starts runs that take those over, and a second request stops them while the replies are
    still held: the messages taken over go back to the lanes, oldest first.  Once the replies pass,
    every reply comes in order, the unsplit tokens."""
    from skippy.lane.protocol import StageLane

    taken_back: list[int] = []
    take_back = StageLane.take_back

    def counted(self: StageLane, forwards: tuple[Any, ...]) -> None:
        taken_back.append(len(forwards))
        take_back(self, forwards)

    monkeypatch.setattr(StageLane, "take_back", counted)
    reference = reference_greedy(tiny_llama, PROMPT, 44, chunk_size=3)
    other_prompt = [1, 13, 4013, 338, 263, 1243]
    async with trio.open_nursery() as nursery:
        chain = await _tapped_chain(nursery, tiny_llama, True)
        tap = chain.taps[-1]  # in front of the final stage
        async with await StageClient.connect(chain.first) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            assert (await client.prefill(1, PROMPT, chunk_size=3)).token == reference[0]
            predicted: list[int] = []
            sent = 0

            async def send() -> None:
                nonlocal sent
                token = reference[sent]
                await client.send(StageMessage.create(
                    MessageKind.DECODE_EMBD, pos_start=len(PROMPT) + sent, token_count=1, session_id=1,
                    tokens=np.asarray([token], dtype=np.int32),
                    state_changes={"decode_step": sent, "current_token": token}))
                sent += 1

            async def pipelined(count: int, depth: int = 3) -> None:
                target = sent + count
                while len(predicted) < target:
                    while sent < target and sent - len(predicted) < depth:
                        await send()
                    predicted.append((await client.receive()).predicted)

            async def other_request(session: int) -> None:
                async with await StageClient.connect(chain.first) as other:
                    assert await _hop_session(other, session, other_prompt, 3) == reference_greedy(
                        tiny_llama, other_prompt, 4, chunk_size=3)

            with trio.fail_after(20):
                await pipelined(16)
                tap.hold = trio.Event()
                for _ in range(3):
                    await send()
                await trio.sleep(0.1)  # (the final stage answered them; the others wait for the replies)
                await other_request(2)  # the loops hand their messages in flight back
                await trio.sleep(0.1)  # (its lanes close: the stages' only work is this lane's again)
                await send()  # the lanes handle it; runs start that take the three over
                await trio.sleep(0.2)
                await other_request(3)  # ...and hand them back while their replies are still held
                hold, tap.hold = tap.hold, None
                hold.set()
                while len(predicted) < sent:
                    predicted.append((await client.receive()).predicted)
                await pipelined(16)
            await client.stop(1)
        assert predicted == reference[1:sent + 1]
        stats = [server.stats for server in chain.servers]
        assert all(s.connection_errors == 0 and s.decode_items == sent + 3 + 3 for s in stats)
        carried = [s.decode_relay_steps for s in stats]
        assert min(carried) >= 20, carried  # the first stage's too: its lane is never quiet
        assert len([count for count in taken_back if count]) >= 2, taken_back  # (the first and middle stages)
        nursery.cancel_scope.cancel()
