"""The steady-state decode relay of a stage, in pure Python (twin of ``skippy.stage._relay``).

Strategy: the same loop as the Cython module (read its header for what the relay carries and
what it hands back), step for step and byte for byte: ``select.poll`` and ``os.read`` /
``os.write`` on the two sockets, the header compared with the template outside the per-token
fields, the activation checked and dequantized with numpy, the row decoded through the
runtime's one-row batch, the outgoing template patched (a final stage's: the sampled token and
the Timings record's compute time in its reply), and hop by hop the downstream's reply read,
checked against its template and answered upstream with this stage's record.  It holds the GIL throughout, so it
saves the lane's trio hand-offs but not the interpreter; ``SKIPPY_NO_EXTENSIONS=1`` selects it
and the relay tests run against both.
"""

from __future__ import annotations

import errno
import math
import os
import select
import struct
import time
from typing import Any, NamedTuple

import numpy as np

from skippy.codec import _frame_layout as layout
from skippy.codec.protocol import BOUNDARY_ROWS_FLAG, StateFlag
from skippy.codec.protocol_ext import MAX_TOP_LOGPROBS

#: Which implementation this module is.
IMPLEMENTATION = "python"

#: The run ended at a frame the relay does not carry (or at end of stream, a reset, a failed
#: decode): ``leftover`` starts with it; the lane reads on from there.
HANDED_BACK = 0
#: The stop descriptor was written: the run ended between frames.
STOPPED = 1
#: ``max_steps`` tokens were relayed (the glue accounts them and starts the next run).
STEP_LIMIT = 2
#: Writing downstream failed (reset, broken pipe): the lane fails as for any write.
DOWNSTREAM_FAILED = 3
#: The abort descriptor was written while a frame was being written (the lane is closing): the
#: stream may hold part of a frame.
ABORTED = 4
#: Hop by hop: the frame at the head of ``leftover`` was computed and forwarded, but its reply
#: was not carried (not the template's shape, end of stream, a stop or an abort while waiting):
#: ``reply_leftover`` holds what was read of it; the lane takes the message over from there.
REPLY_PENDING = 5
#: Hop by hop: writing the reply upstream failed or was cut off by the abort descriptor.
UPSTREAM_FAILED = 6

#: A final stage's reply: PredictedToken (kind, token, a token vector of that one token, window
#: id, no draft, 23 i64 stats); with a Timings frame of one record in front (head, 4 i32, 4 i64)
#: when the return lane negotiated the extensions (docs/protocol.md §4).
REPLY_BYTES = layout.REPLY_BYTES
TIMINGS_BYTES = layout.TIMINGS_BYTES

#: The fixed part of a message frame (docs/protocol.md §2.2).
FIXED_HEADER = layout.FIXED_HEADER
_POS_START, _TOKEN_N, _POSITION_N = layout.POS_START, layout.TOKEN_N, layout.POSITION_N
_DECODE_STEP, _CURRENT_TOKEN, _FLAGS, _DTYPE = layout.DECODE_STEP, layout.CURRENT_TOKEN, layout.FLAGS, layout.WIRE_DTYPE
_REQUEST_ID, _SESSION_ID = layout.REQUEST_ID, layout.SESSION_ID
#: The state flags that add a section or rows the relay does not carry (sampling, chat metadata,
#: the activation row multipliers).
_UNCARRIED_FLAGS = int(StateFlag.SAMPLING | StateFlag.CHAT_SAMPLING_METADATA | StateFlag.RWKV7_V_FIRST_SIDEBAND
                       | StateFlag.GEMMA3N_ALTUP_SIDEBAND | StateFlag.INKLING_MTP_EMBD_SIDEBAND) | BOUNDARY_ROWS_FLAG
_I32 = struct.Struct("<i")
_DTYPE_BYTES = {0: 4, 1: 2}  # f32, f16 (q8 frames are not relayed)


class RelayOutcome(NamedTuple):
    """How a run ended and what it did (microseconds, bytes; hop by hop also the downstream's
    replies: their wait and bytes, the bytes written upstream, and with REPLY_PENDING the
    message in flight: its compute and write times and when its write began, on
    ``time.perf_counter_ns``'s clock in microseconds)."""

    status: int
    leftover: bytes
    steps: int
    compute_us: int
    write_us: int
    bytes_in: int
    bytes_out: int
    wait_us: int = 0
    replies_in: int = 0
    replies_out: int = 0
    reply_leftover: bytes = b""
    pending_compute_us: int = 0
    pending_write_us: int = 0
    pending_sent_us: int = 0


#: A Timings record's size, and where its four i64 durations start in it (compute_us first).
RECORD_BYTES = layout.TIMINGS_BYTES - layout.TIMINGS_HEAD
RECORD_DURATIONS = layout.TIMINGS_COMPUTE - layout.TIMINGS_HEAD


def _timings_count(frame: bytes) -> int:
    """The records of the Timings frame ``frame`` starts with (-1: it starts with none)."""
    if len(frame) >= layout.TIMINGS_HEAD and _I32.unpack_from(frame, 0)[0] == layout.TIMINGS_MAGIC:
        return _I32.unpack_from(frame, 4)[0]
    return -1


class HopLayout(NamedTuple):
    """Where a hop-by-hop reply's parts lie: the downstream's reply (``reply_in``: a Logprobs frame
    of one row, if the session asked, its Timings records, if any, then a plain PredictedToken)
    and this stage's (``reply_out``: the same Logprobs frame when the upstream negotiated the
    extensions, the same records and this stage's own after them, then the same PredictedToken);
    ``fixed``: the byte ranges of ``reply_in`` that must equal the template's (everything but the
    token, its vector entry, the records' durations and the log-probability pairs)."""

    records: int
    records_in: int
    records_out: int
    own_record: int
    prediction_in: int
    prediction_out: int
    fixed: tuple[tuple[int, int], ...]
    #: The Logprobs frame's length at the start of ``reply_in`` (0: none), and whether
    #: ``reply_out`` starts with it too.
    logprobs: int = 0
    logprobs_out: bool = False


def _logprobs_length(frame: bytes) -> int:
    """The length of the one-row Logprobs frame ``frame`` starts with (0: it starts with none)."""
    if len(frame) < layout.LOGPROBS_HEAD or _I32.unpack_from(frame, 0)[0] != layout.LOGPROBS_MAGIC:
        return 0
    _, rows, top = struct.unpack_from("<iii", frame, 0)
    if rows != 1 or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError("the reply's Logprobs frame is not one row of a carried size")
    return layout.LOGPROBS_HEAD + layout.LOGPROBS_PAIR * (1 + top)


def hop_layout(reply_in: bytes, reply_out: bytes) -> HopLayout:
    """The layout of a non-final stage's hop-by-hop replies (offsets -1: absent).

    ``reply_out`` must be what the lane answered for ``reply_in`` (``skippy.lane.replies.relayed``):
    its prediction identical (stats merged into nothing pending), its records the downstream's.

    Raises:
        ValueError: replies the relay cannot carry.
    """
    logprobs = _logprobs_length(reply_in)
    logprobs_out = _logprobs_length(reply_out)
    if logprobs_out and (not logprobs or reply_out[:logprobs] != reply_in[:logprobs]):
        raise ValueError("the upstream reply's Logprobs frame is not the downstream's")
    count = _timings_count(reply_in[logprobs:])
    records_in = logprobs + layout.TIMINGS_HEAD if count >= 0 else -1
    prediction_in = logprobs + (layout.TIMINGS_HEAD + RECORD_BYTES * count if count >= 0 else 0)
    count = max(count, 0)
    own_count = _timings_count(reply_out[logprobs_out:])
    if own_count >= 0:
        if own_count != count + 1:
            raise ValueError("the upstream reply's Timings frame is not the downstream's plus one record")
        records_out = logprobs_out + layout.TIMINGS_HEAD
        own_record = records_out + RECORD_BYTES * count
        prediction_out = own_record + RECORD_BYTES
    else:
        records_out = own_record = -1
        prediction_out = logprobs_out
    if len(reply_in) != prediction_in + REPLY_BYTES or len(reply_out) != prediction_out + REPLY_BYTES:
        raise ValueError("a hop-by-hop reply template is not (Logprobs, Timings and) one plain PredictedToken")
    reply_layout(reply_in[prediction_in:])
    if reply_in[prediction_in:] != reply_out[prediction_out:]:
        raise ValueError("the upstream reply's prediction is not the downstream's")
    if records_out >= 0 and count and (reply_in[records_in:prediction_in]
                                        != reply_out[records_out:records_out + RECORD_BYTES * count]):
        raise ValueError("the upstream reply's records are not the downstream's")
    varying = [(layout.LOGPROBS_HEAD, logprobs - layout.LOGPROBS_HEAD)] if logprobs else []
    varying += [(records_in + RECORD_BYTES * index + RECORD_DURATIONS, RECORD_BYTES - RECORD_DURATIONS)
                for index in range(count)]
    varying += [(prediction_in + layout.REPLY_TOKEN, 4), (prediction_in + layout.REPLY_VECTOR_ENTRY, 4)]
    fixed, start = [], 0
    for offset, length in varying:
        if offset > start:
            fixed.append((start, offset))
        start = offset + length
    fixed.append((start, len(reply_in)))
    return HopLayout(count, records_in, records_out, own_record, prediction_in, prediction_out, tuple(fixed),
                     logprobs, logprobs_out > 0)


def logprob_pairs_valid(pairs: bytes) -> bool:
    """Every (i32 token, f32 log-probability) pair is one the lane's decoder takes: a token >= 0,
    a log-probability finite and <= 0."""
    for token, logprob in struct.iter_unpack("<if", pairs):
        if token < 0 or not -math.inf < logprob <= 0.0:
            return False
    return True


def reply_layout(reply: bytes) -> tuple[int, int]:
    """``(token_offset, compute_offset)`` of a final stage's reply template: the token goes at
    ``token_offset`` and again 8 bytes on (the token vector's one entry); compute: -1 without a
    Timings frame.

    Raises:
        ValueError: not a PredictedToken reply (with one Timings record in front, or none).
    """
    timings = len(reply) == TIMINGS_BYTES + REPLY_BYTES
    if len(reply) != REPLY_BYTES and not timings:
        raise ValueError("the reply template is not one PredictedToken (with one Timings record)")
    start = TIMINGS_BYTES if timings else 0
    if timings and reply[:layout.TIMINGS_HEAD] != struct.pack("<ii", layout.TIMINGS_MAGIC, 1):
        raise ValueError("the reply template's first frame is not a Timings frame of one record")
    kind, _, count = struct.unpack_from("<iii", reply, start)
    if kind != 2 or count != 1 or reply[start + layout.REPLY_DRAFT:start + layout.REPLY_DRAFT + 4] != bytes(4):
        raise ValueError("the reply template is not a plain PredictedToken")
    return start + layout.REPLY_TOKEN, (layout.TIMINGS_COMPUTE if timings else -1)


def template_layout(in_template: bytes, out_template: bytes, *, width: int,
                    first: bool, final: bool = False) -> tuple[int, int, int, int, int, int]:
    """``(in_length, out_length, in_activation, out_activation, in_dtype, out_dtype)`` of a
    session's template frames (offsets of the activation sections; a final stage's outgoing
    template is its reply, :func:`reply_layout`, and its out fields are 0).

    Raises:
        ValueError: a pair of frames the relay cannot carry (the glue checks first; this keeps
            either implementation from running on one).
    """
    if final:
        if first:
            raise ValueError("a final stage that is also the first takes its decodes hop by hop")
        reply_layout(out_template)
        in_length, _, in_activation, _, in_dtype, _ = template_layout(
            in_template, in_template, width=width, first=False)
        return in_length, len(out_template), in_activation, 0, in_dtype, 0
    if len(in_template) < FIXED_HEADER or len(out_template) < FIXED_HEADER:
        raise ValueError("a template is shorter than the fixed header")
    for name, frame in (("incoming", in_template), ("outgoing", out_template)):
        if _I32.unpack_from(frame, _FLAGS)[0] & _UNCARRIED_FLAGS:
            raise ValueError(f"the {name} template carries a section or rows the relay does not carry")
        if _I32.unpack_from(frame, layout.TOKEN_COUNT)[0] != 1:
            raise ValueError(f"the {name} template is not one row")
    sidebands = 4 * (_I32.unpack_from(in_template, _TOKEN_N)[0] + _I32.unpack_from(in_template, _POSITION_N)[0])
    if out_template[_TOKEN_N:_POSITION_N + 4] != in_template[_TOKEN_N:_POSITION_N + 4] or sidebands < 0:
        raise ValueError("the templates' sidebands differ")
    in_dtype = _I32.unpack_from(in_template, _DTYPE)[0]
    out_dtype = _I32.unpack_from(out_template, _DTYPE)[0]
    if out_dtype not in _DTYPE_BYTES or (not first and in_dtype not in _DTYPE_BYTES):
        raise ValueError("the relay carries f32 and f16 activations only")
    activation = FIXED_HEADER + sidebands
    in_length = activation + (0 if first else width * _DTYPE_BYTES[in_dtype])
    out_length = activation + width * _DTYPE_BYTES[out_dtype]
    if len(in_template) != in_length or len(out_template) != out_length:
        raise ValueError("a template's length does not match its layout")
    return in_length, out_length, activation, activation, in_dtype, out_dtype


class DecodeRelay:
    """One session's steady-state decode relay.

    Args:
        upstream_fd / downstream_fd: the lane's sockets (non-blocking; the lane keeps owning
            them); a final stage's downstream is the session's return lane.
        stop_fd: readable when the run must end between frames (an eventfd the glue writes).
        abort_fd: readable when it must end at once, even in the middle of writing a frame.
        in_template / out_template: the run's first frame as received, and the frame the lane
            forwarded for it (a final stage: the reply it wrote, :func:`reply_layout`).
        final: the stage samples; the runtime's ``sample`` picks the token.
        width: the activation width; first: the stage takes token ids (layer 0).
        n_vocab: token ids must be below it (first stage).
        next_position: the session's next position (its KV length); position_end: the cells
            the stage holds (0: no limit).
        activation_limit: the largest magnitude an activation value may have.
        runtime: the one-row batch (``skippy.runtime.RowBatch``).
        max_steps: the most tokens one :meth:`run` relays.
        log_rows: a non-final stage keeps the f32 output row of every step it computes, for the
            stage's activation log (:meth:`take_log`, after each run).
    """

    def __init__(self, *, upstream_fd: int, downstream_fd: int, stop_fd: int, abort_fd: int, in_template: bytes,
                 out_template: bytes, width: int, first: bool, n_vocab: int, next_position: int,
                 position_end: int, activation_limit: float, runtime: Any, final: bool = False,
                 max_steps: int = 1024, reply_in: bytes = b"", reply_out: bytes = b"", log_rows: bool = False) -> None:
        if reply_in and final:
            raise ValueError("a final stage answers hop by hop with its reply as the outgoing template")
        #: Hop by hop (a non-final stage): the downstream's reply template and this stage's.
        self._hop = hop_layout(reply_in, reply_out) if reply_in else None
        self._reply_in, self._reply_out = reply_in, bytearray(reply_out)
        self._reply = bytearray()
        self._pending = (0, 0, 0)
        (self._in_length, self._out_length, self._in_activation, self._out_activation,
         self._in_dtype, self._out_dtype) = template_layout(in_template, out_template, width=width, first=first,
                                                            final=final)
        self._final = final
        self._token_offset, self._compute_offset = reply_layout(out_template) if final else (-1, -1)
        self._upstream, self._downstream, self._stop, self._abort = upstream_fd, downstream_fd, stop_fd, abort_fd
        self._in_template = in_template
        self._out = bytearray(out_template)
        self._width, self._first, self._n_vocab = width, first, n_vocab
        self.next_position, self._position_end = next_position, position_end
        self._limit = float(np.float32(activation_limit))
        self._runtime = runtime
        self._max_steps = max_steps
        self._capacity = max(self._in_length, FIXED_HEADER) * 2 + (1 << 16)
        self._buffer = bytearray()
        self._poll = select.poll()
        self._poll.register(upstream_fd, select.POLLIN)
        self._poll.register(stop_fd, select.POLLIN)
        self._poll.register(abort_fd, select.POLLIN)
        self._reply_poll = select.poll()
        self._reply_poll.register(downstream_fd, select.POLLIN)
        self._reply_poll.register(stop_fd, select.POLLIN)
        self._reply_poll.register(abort_fd, select.POLLIN)
        self.last_frame_ns = time.monotonic_ns()
        #: The rows of the steps computed this run (None: not logging), from ``_log_start``.
        self._log: list[bytes] | None = [] if log_rows and not final else None
        self._log_start = next_position

    def take_log(self) -> tuple[int, int, bytes]:
        """``(start, count, rows)``: the f32 output rows of the positions ``[start, start + count)``
        computed by the last :meth:`run` (the one in flight when it ended ``REPLY_PENDING``
        included), ``count * width`` little-endian floats; then forgets them."""
        rows = self._log or []
        start, count, data = self._log_start, len(rows), b"".join(rows)
        if self._log is not None:
            self._log = []
        self._log_start = self.next_position
        return start, count, data

    def run(self, pending: bytes = b"") -> RelayOutcome:
        """Relay frames (``pending`` first: bytes the lane had read) until one it does not carry,
        a stop, or ``max_steps``; blocking, on a worker thread."""
        if len(pending) > self._capacity:
            return RelayOutcome(HANDED_BACK, pending, 0, 0, 0, 0, 0)
        self._buffer = bytearray(pending)
        if self._log is not None:  # rows not taken after the last run are dropped
            self._log = []
        self._log_start = self.next_position
        # steps, compute ns, write ns, bytes in, bytes out, wait ns, reply bytes in, reply bytes out
        counters = [0, 0, 0, 0, 0, 0, 0, 0]
        status = self._loop(counters)
        leftover, self._buffer = bytes(self._buffer), bytearray()
        reply, self._reply = (bytes(self._reply) if status == REPLY_PENDING else b""), bytearray()
        steps, compute_ns, write_ns, bytes_in, bytes_out, wait_ns, replies_in, replies_out = counters
        pending = self._pending if status == REPLY_PENDING else (0, 0, 0)
        return RelayOutcome(status, leftover, steps, compute_ns // 1000, write_ns // 1000, bytes_in, bytes_out,
                            wait_ns // 1000, replies_in, replies_out, reply, *pending)

    def _loop(self, counters: list[int]) -> int:
        while counters[0] < self._max_steps:
            status = self._fill(self._in_length, counters)
            if status >= 0:
                return status
            if not self._carries():
                return HANDED_BACK
            started = time.perf_counter_ns()
            if not self._step():
                return HANDED_BACK
            elapsed = time.perf_counter_ns() - started
            counters[1] += elapsed
            if self._compute_offset >= 0:  # the Timings record's compute_us, as the lane measures it
                struct.pack_into("<q", self._out, self._compute_offset, elapsed // 1000)
            started = time.perf_counter_ns()
            written = self._write(self._downstream, self._out, DOWNSTREAM_FAILED)
            if written is not None:
                return written
            sent = time.perf_counter_ns()
            counters[2] += sent - started
            counters[4] += self._out_length
            if self._hop is not None:  # hop by hop: the downstream's reply, this stage's share added, upstream
                self._pending = (elapsed // 1000, (sent - started) // 1000, started // 1000)
                status = self._answer(counters, sent)
                if status == REPLY_PENDING:
                    return status
                if status >= 0:  # the reply's write failed: the message is done here
                    del self._buffer[:self._in_length]
                    self.next_position += 1
                    counters[0] += 1
                    return status
            del self._buffer[:self._in_length]
            self.next_position += 1
            counters[0] += 1
        return STEP_LIMIT

    def _fill(self, wanted: int, counters: list[int]) -> int:
        while True:
            if len(self._buffer) >= FIXED_HEADER and not self._header_matches():
                return -1
            if len(self._buffer) >= wanted:
                return -1
            ready = dict(self._poll.poll())
            if ready.get(self._stop) or ready.get(self._abort):
                return STOPPED
            if not ready.get(self._upstream):
                continue
            try:
                data = os.read(self._upstream, self._capacity - len(self._buffer))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return HANDED_BACK
            if not data:
                return HANDED_BACK
            if not self._buffer:
                self.last_frame_ns = time.monotonic_ns()
            self._buffer += data
            counters[3] += len(data)

    def _header_matches(self) -> bool:
        frame, template = self._buffer, self._in_template
        count, source = layout.TOKEN_COUNT, layout.SOURCE_STAGE
        return (frame[:_POS_START] == template[:_POS_START] and frame[count:_DECODE_STEP] == template[count:_DECODE_STEP]
                and frame[source:_REQUEST_ID] == template[source:_REQUEST_ID]
                and frame[_SESSION_ID:FIXED_HEADER] == template[_SESSION_ID:FIXED_HEADER])

    def _carries(self) -> bool:
        frame = self._buffer
        if len(frame) < self._in_length or not self._header_matches():
            return False
        position = _I32.unpack_from(frame, _POS_START)[0]
        if position != self.next_position or (self._position_end > 0 and position >= self._position_end):
            return False
        runtime = self._runtime
        if self._first:
            token_n = _I32.unpack_from(frame, _TOKEN_N)[0]
            token = _I32.unpack_from(frame, FIXED_HEADER if token_n == 1 else _CURRENT_TOKEN)[0]
            if not 0 <= token < self._n_vocab:
                return False
            runtime.token[0] = token
        else:
            start, width = self._in_activation, self._width
            dtype = np.float32 if self._in_dtype == 0 else np.float16
            values = np.frombuffer(bytes(frame[start:start + width * np.dtype(dtype).itemsize]),
                                   dtype=np.dtype(dtype).newbyteorder("<")).astype(np.float32)
            low, high = float(values.min()), float(values.max())
            if not (-self._limit <= low and high <= self._limit):
                return False
            runtime.embd[:] = values
        runtime.position[0] = position
        return True

    def _step(self) -> bool:
        runtime = self._runtime
        if runtime.decode() != 0:
            return False
        if self._final:
            token = runtime.sample()
            if token < 0:
                return False
            struct.pack_into("<i", self._out, self._token_offset, token)
            struct.pack_into("<i", self._out, self._token_offset + layout.REPLY_VECTOR_ENTRY - layout.REPLY_TOKEN,
                             token)  # the token vector's entry
            return True
        hidden = runtime.hidden()
        if self._log is not None:  # contiguous positions from _log_start: one row per computed step
            self._log.append(np.asarray(hidden, dtype="<f4").tobytes())
        frame, out = self._buffer, self._out
        out[_POS_START:_POS_START + 4] = frame[_POS_START:_POS_START + 4]
        out[_DECODE_STEP:_DECODE_STEP + 8] = frame[_DECODE_STEP:_DECODE_STEP + 8]
        out[_REQUEST_ID:_REQUEST_ID + 8] = frame[_REQUEST_ID:_REQUEST_ID + 8]
        out[FIXED_HEADER:self._out_activation] = frame[FIXED_HEADER:self._out_activation]
        if self._out_dtype == 0:
            encoded = hidden.astype("<f4").tobytes()
        else:
            from skippy.codec import _wire_py  # the codec's own f16 rounding (ties away from zero)

            encoded = _wire_py.encode_activation(hidden.reshape(1, -1), 1)  # type: ignore[arg-type]
        out[self._out_activation:] = encoded
        return True

    def _write(self, fd: int, frame: bytearray, failed: int) -> int | None:
        """Write ``frame`` to ``fd``, waiting while the socket is full; None when it is out, else
        the outcome that ends the run (``failed`` for a failed write; upstream, an abort too)."""
        view = memoryview(frame)
        while view:
            try:
                view = view[os.write(fd, view):]
            except (BlockingIOError, InterruptedError):
                waiter = select.poll()
                waiter.register(fd, select.POLLOUT)
                waiter.register(self._abort, select.POLLIN)
                if dict(waiter.poll()).get(self._abort):
                    return ABORTED if failed == DOWNSTREAM_FAILED else failed
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EINTR):
                    continue
                return failed
        return None

    def _answer(self, counters: list[int], sent: int) -> int:
        """Hop by hop: read the downstream's reply, add this stage's share as the lane does
        (``skippy.lane.replies.relayed``), write it upstream; -1 when it is out, else the outcome."""
        hop = self._hop
        assert hop is not None
        reply, wanted = self._reply, len(self._reply_in)
        del reply[:]
        while len(reply) < wanted:
            ready = dict(self._reply_poll.poll())
            if ready.get(self._stop) or ready.get(self._abort):
                return REPLY_PENDING  # the lane reads the reply
            if not ready.get(self._downstream):
                continue
            try:
                data = os.read(self._downstream, wanted - len(reply))  # never past this reply
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return REPLY_PENDING
            if not data:
                return REPLY_PENDING
            reply += data
            counters[6] += len(data)
            if not self._reply_matches():
                return REPLY_PENDING
        wait_ns = max(0, time.perf_counter_ns() - sent)
        counters[5] += wait_ns
        durations = struct.Struct(f"<{(RECORD_BYTES - RECORD_DURATIONS) // 8}q")
        for index in range(hop.records):
            if min(durations.unpack_from(reply, hop.records_in + RECORD_BYTES * index + RECORD_DURATIONS)) < 0:
                return REPLY_PENDING  # the lane refuses it (a timing value out of range)
        if hop.logprobs and not logprob_pairs_valid(bytes(reply[layout.LOGPROBS_HEAD:hop.logprobs])):
            return REPLY_PENDING  # (likewise)
        out = self._reply_out
        if hop.logprobs_out:
            out[:hop.logprobs] = reply[:hop.logprobs]
        if hop.records_out >= 0:
            out[hop.records_out:hop.own_record] = reply[hop.records_in:hop.prediction_in]
            compute_us, write_us, _ = self._pending
            durations.pack_into(out, hop.own_record + RECORD_DURATIONS, compute_us, write_us, wait_ns // 1000, 0)
        out[hop.prediction_out:] = reply[hop.prediction_in:]
        written = self._write(self._upstream, out, UPSTREAM_FAILED)
        if written is not None:
            return written
        counters[7] += len(out)
        return -1

    def _reply_matches(self) -> bool:
        """What was read of the reply equals the template outside the per-token fields."""
        hop, reply, template = self._hop, self._reply, self._reply_in
        assert hop is not None
        filled = len(reply)
        for start, end in hop.fixed:
            if start >= filled:
                break
            end = min(end, filled)
            if reply[start:end] != template[start:end]:
                return False
        return True
