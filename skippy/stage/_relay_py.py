"""The steady-state decode relay of a stage, in pure Python (twin of ``skippy.stage._relay``).

Strategy: the same loop as the Cython module (read its header for what the relay carries and
what it hands back), step for step and byte for byte: ``select.poll`` and ``os.read`` /
``os.write`` on the two sockets, the header compared with the template outside the per-message
fields, the activation checked and dequantized with numpy, a rollback trimmed, the message's rows
decoded through the runtime's batch (one for a decode, a verify window's rows, any up to the
batch; each kind's templates a :class:`Family`, a window's replies kept as one row's), the
outgoing frame built from its kind's template (a final stage's: the sampled tokens, a window's
id, rows and verify-window durations, and the Timings record's compute time in its reply), and hop by hop
the downstream's reply read, checked against its template and answered upstream with this
stage's share.  It holds the GIL throughout, so it
saves the lane's trio hand-offs but not the interpreter; ``SKIPPY_NO_EXTENSIONS=1`` selects it
and the relay tests run against both.
"""

from __future__ import annotations

import collections
import errno
import math
import os
import select
import struct
import time
from typing import Any, NamedTuple

import numpy as np

from skippy.codec import _frame_layout as layout
from skippy.codec.protocol import BOUNDARY_ROWS_FLAG, MessageKind, ReplyKind, StateFlag
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
#: Hop by hop: the frames at the head of ``leftover`` (``in_flight``) were computed and forwarded,
#: but the oldest one's reply was not carried (not the template's shape, end of stream, a stop
#: or an abort while waiting): ``reply_leftover`` holds what was read of it; the lane takes the
#: messages over from there.
REPLY_PENDING = 5
#: Hop by hop: writing the reply upstream failed or was cut off by the abort descriptor.
UPSTREAM_FAILED = 6
#: A decode run's steps (``run``): the run made its last prediction (its budget, or a stop token).
RUN_ENDED = 7

#: A final stage's reply to a decode: PredictedToken (kind, token, a token vector of that one
#: token, window id, no draft, 23 i64 stats); with a Timings frame of one record in front (head,
#: 4 i32, 4 i64) when the return lane negotiated the extensions (docs/protocol.md §4).  A verify
#: window's: PredictedTokens, one vector entry per row (:func:`reply_bytes`).
REPLY_BYTES = layout.REPLY_BYTES
TIMINGS_BYTES = layout.TIMINGS_BYTES

#: The fixed part of a message frame (docs/protocol.md §2.2).
FIXED_HEADER = layout.FIXED_HEADER
_POS_START, _TOKEN_N, _POSITION_N = layout.POS_START, layout.TOKEN_N, layout.POSITION_N
_DECODE_STEP, _CURRENT_TOKEN, _FLAGS, _DTYPE = layout.DECODE_STEP, layout.CURRENT_TOKEN, layout.FLAGS, layout.WIRE_DTYPE
_REQUEST_ID, _SESSION_ID = layout.REQUEST_ID, layout.SESSION_ID
#: The state header's seq_id: a verify window's id (it changes from one window to the next).
_SEQ_ID = layout.STATE + 4
#: The state flags that add a section or rows the relay does not carry (sampling, chat metadata,
#: the activation row multipliers).
_UNCARRIED_FLAGS = int(StateFlag.SAMPLING | StateFlag.CHAT_SAMPLING_METADATA | StateFlag.RWKV7_V_FIRST_SIDEBAND
                       | StateFlag.GEMMA3N_ALTUP_SIDEBAND | StateFlag.INKLING_MTP_EMBD_SIDEBAND) | BOUNDARY_ROWS_FLAG
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
#: A summed verify-window duration the relay adds to must stay below this (else the lane decides).
SUM_LIMIT = 1 << 62
#: Hop by hop, the most messages a run keeps in flight (computed and forwarded, their replies
#: not yet answered): a pipelining upstream's (a speculating driver keeps up to 4 windows in flight).
MAX_IN_FLIGHT = 8
#: Where a reply's verify-window token count and largest window (i64 each) are, from its sums.
_TOKEN_COUNTS = layout.STATS_VERIFY_COUNTS - layout.STATS_VERIFY_SUMS + 16
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
    #: Rollbacks the run trimmed (the executor's auto-aligns) and the positions they removed
    #: (the message in flight's included).
    trims: int = 0
    trimmed: int = 0
    #: The rows of the messages relayed, how many of them were verify windows, the rows of the
    #: last one decoded (the message in flight's included), and with REPLY_PENDING the length of
    #: the message in flight (the head of ``leftover``).
    rows: int = 0
    windows: int = 0
    last_rows: int = 0
    pending_length: int = 0
    #: Hop by hop with REPLY_PENDING: every message in flight, oldest first (the head of
    #: ``leftover``, in order): its length, compute and write times and when its write began (a
    #: message the run took over from the lane, :meth:`DecodeRelay.run`'s ``adopted``: length 0,
    #: its frame is not in ``leftover``).
    in_flight: tuple[tuple[int, int, int, int], ...] = ()
    #: Hop by hop: the messages taken over from the lane whose replies the run answered (the
    #: oldest ``adopted``; not counted in ``steps``).
    adopted: int = 0


#: A Timings record's size, and where its four i64 durations start in it (compute_us first).
RECORD_BYTES = layout.TIMINGS_BYTES - layout.TIMINGS_HEAD
RECORD_DURATIONS = layout.TIMINGS_COMPUTE - layout.TIMINGS_HEAD


def _timings_count(frame: bytes) -> int:
    """The records of the Timings frame ``frame`` starts with (-1: it starts with none)."""
    if len(frame) >= layout.TIMINGS_HEAD and _I32.unpack_from(frame, 0)[0] == layout.TIMINGS_MAGIC:
        return _I32.unpack_from(frame, 4)[0]
    return -1


def reply_bytes(rows: int) -> int:
    """The length of a PredictedToken(s) reply with ``rows`` vector entries and no draft."""
    return layout.REPLY_BYTES + 4 * (rows - 1)


class HopLayout(NamedTuple):
    """Where a hop-by-hop reply's parts lie: the downstream's reply (``reply_in``: a Logprobs frame
    of one row, if the session asked, its Timings records, if any, then a plain PredictedToken,
    or a verify window's PredictedTokens) and this stage's (``reply_out``: the same Logprobs frame
    when the upstream negotiated the extensions, the same records and this stage's own after
    them, then the same prediction; a window's with this stage's verify-window share added);
    ``fixed``: the byte ranges of ``reply_in`` that must equal the template's (everything but the
    tokens, a window's id and summed verify-window durations, the records' durations and the
    log-probability pairs)."""

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
    #: A verify window's reply: its rows, and where its verify-window sums start in ``reply_in``
    #: and ``reply_out`` (-1: a decode's reply).
    rows: int = 1
    sums_in: int = -1
    sums_out: int = -1


def _logprobs_length(frame: bytes) -> int:
    """The length of the one-row Logprobs frame ``frame`` starts with (0: it starts with none)."""
    if len(frame) < layout.LOGPROBS_HEAD or _I32.unpack_from(frame, 0)[0] != layout.LOGPROBS_MAGIC:
        return 0
    _, rows, top = struct.unpack_from("<iii", frame, 0)
    if rows != 1 or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError("the reply's Logprobs frame is not one row of a carried size")
    return layout.LOGPROBS_HEAD + layout.LOGPROBS_PAIR * (1 + top)


def hop_layout(reply_in: bytes, reply_out: bytes, *, rows: int = 1, window: bool = False) -> HopLayout:
    """The layout of a non-final stage's hop-by-hop replies (offsets -1: absent) to a decode, or
    to a verify window of ``rows`` rows.

    ``reply_out`` must be what the lane answered for ``reply_in`` (``skippy.lane.replies.relayed``):
    its prediction identical (stats merged into nothing pending; a window's with this stage's
    verify-window share: its durations added, one more stage, at least one token), its records
    the downstream's.

    Raises:
        ValueError: replies the relay cannot carry.
    """
    logprobs = _logprobs_length(reply_in)
    if window and logprobs:
        raise ValueError("a verify window's reply carries no Logprobs frame the relay carries")
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
    size = reply_bytes(rows)
    if len(reply_in) != prediction_in + size or len(reply_out) != prediction_out + size:
        raise ValueError("a hop-by-hop reply template is not (Logprobs, Timings and) one plain PredictedToken"
                         + (f"s of {rows} tokens" if window else ""))
    shape = reply_layout(reply_in[prediction_in:], rows=rows, window=window)
    sums_in = sums_out = -1
    mine, theirs = reply_in[prediction_in:], reply_out[prediction_out:]
    if window:  # skippy.lane.stats.timing_stats: this stage's durations added, one more stage
        sums = shape.stats + layout.STATS_VERIFY_SUMS
        counts, end = shape.stats + layout.STATS_VERIFY_COUNTS, shape.stats + layout.STATS_VERIFY_END
        stage, request, tokens, largest = struct.unpack_from("<4q", mine, counts)
        if struct.unpack_from("<4q", theirs, counts) != (stage + 1, request, tokens, max(largest, 1)):
            raise ValueError("the upstream reply's verify-window counts are not the downstream's plus this stage")
        mine, theirs = mine[:sums] + mine[end:], theirs[:sums] + theirs[end:]
        sums_in, sums_out = prediction_in + sums, prediction_out + sums
    if mine != theirs:
        raise ValueError("the upstream reply's prediction is not the downstream's")
    if records_out >= 0 and count and (reply_in[records_in:prediction_in]
                                        != reply_out[records_out:records_out + RECORD_BYTES * count]):
        raise ValueError("the upstream reply's records are not the downstream's")
    varying = [(layout.LOGPROBS_HEAD, logprobs - layout.LOGPROBS_HEAD)] if logprobs else []
    varying += [(records_in + RECORD_BYTES * index + RECORD_DURATIONS, RECORD_BYTES - RECORD_DURATIONS)
                for index in range(count)]
    if window:  # the token, the count and the vector (a window's rows vary), its id, the summed
        # durations and the token counts (of its rows: checked per message)
        varying += [(prediction_in + layout.REPLY_TOKEN, layout.REPLY_VECTOR_ENTRY - layout.REPLY_TOKEN + 4 * rows),
                    (prediction_in + shape.window, 4), (sums_in, layout.STATS_VERIFY_COUNTS - layout.STATS_VERIFY_SUMS),
                    (sums_in + _TOKEN_COUNTS, 16)]
    else:
        varying += [(prediction_in + layout.REPLY_TOKEN, 4), (prediction_in + layout.REPLY_VECTOR_ENTRY, 4 * rows)]
    fixed, start = [], 0
    for offset, length in varying:
        if offset > start:
            fixed.append((start, offset))
        start = offset + length
    fixed.append((start, len(reply_in)))
    return HopLayout(count, records_in, records_out, own_record, prediction_in, prediction_out, tuple(fixed),
                     logprobs, logprobs_out > 0, rows, sums_in, sums_out)


def logprob_pairs_valid(pairs: bytes) -> bool:
    """Every (i32 token, f32 log-probability) pair is one the lane's decoder takes: a token >= 0,
    a log-probability finite and <= 0."""
    for token, logprob in struct.iter_unpack("<if", pairs):
        if token < 0 or not -math.inf < logprob <= 0.0:
            return False
    return True


class ReplyLayout(NamedTuple):
    """Where a final stage's reply template is patched (offsets into it; -1: absent)."""

    #: The predicted token (the first row's); the vector's entries start 8 bytes on.
    token: int
    #: The Timings record's compute_us (-1: no Timings frame).
    compute: int
    #: A verify window's id (-1: a decode's PredictedToken).
    window: int
    #: The 23 stats.
    stats: int


def reply_layout(reply: bytes, *, rows: int = 1, window: bool = False) -> ReplyLayout:
    """Where a final stage's reply template to a decode (a PredictedToken) or a verify window of
    ``rows`` rows (PredictedTokens) is patched.

    Raises:
        ValueError: not such a reply (with one Timings record in front, or none).
    """
    size = reply_bytes(rows)
    timings = len(reply) == TIMINGS_BYTES + size
    name = f"PredictedTokens of {rows} tokens" if window else "PredictedToken"
    if len(reply) != size and not timings:
        raise ValueError(f"the reply template is not one {name} (with one Timings record)")
    start = TIMINGS_BYTES if timings else 0
    if timings and reply[:layout.TIMINGS_HEAD] != struct.pack("<ii", layout.TIMINGS_MAGIC, 1):
        raise ValueError("the reply template's first frame is not a Timings frame of one record")
    kind, _, count = struct.unpack_from("<iii", reply, start)
    vector_end = start + layout.REPLY_VECTOR_ENTRY + 4 * rows
    wanted = ReplyKind.PREDICTED_TOKENS if window else ReplyKind.PREDICTED_TOKEN
    if kind != wanted or count != rows or reply[vector_end + 4:vector_end + 8] != bytes(4):
        raise ValueError(f"the reply template is not a plain {name}")
    return ReplyLayout(start + layout.REPLY_TOKEN, layout.TIMINGS_COMPUTE if timings else -1,
                       vector_end if window else -1, vector_end + 8)


class TemplateLayout(NamedTuple):
    """A session's template frames: their lengths, where their activations start, their wire
    dtypes (a final stage's out fields are 0), the rows of each message and whether it is a
    verify window."""

    in_length: int
    out_length: int
    in_activation: int
    out_activation: int
    in_dtype: int
    out_dtype: int
    rows: int = 1
    window: bool = False


def template_layout(in_template: bytes, out_template: bytes, *, width: int,
                    first: bool, final: bool = False, tokens_only: bool = False) -> TemplateLayout:
    """The layout of a session's template frames (a decode's, or a verify window's of any rows;
    a final stage's outgoing template is its reply, :func:`reply_layout`, and its out fields
    are 0; a stage that is first and final takes token ids and answers with its reply).
    ``tokens_only``: ``in_template`` checked against itself as a frame of token ids only (the
    incoming side of a stage that is first and final: no activation, any dtype field).

    Raises:
        ValueError: a pair of frames the relay cannot carry (the glue checks first; this keeps
            either implementation from running on one).
    """
    if len(in_template) < FIXED_HEADER or len(out_template) < (0 if final else FIXED_HEADER):
        raise ValueError("a template is shorter than the fixed header")
    kind, _, rows = struct.unpack_from("<iii", in_template, 0)
    window = kind == MessageKind.VERIFY_WINDOW
    if final:  # the incoming side checked as a frame passed on unchanged (its own out template)
        inner = template_layout(in_template, in_template, width=width, first=False, tokens_only=first)
        reply_layout(out_template, rows=inner.rows, window=window)
        return TemplateLayout(inner.in_length, len(out_template), inner.in_activation, 0, inner.in_dtype, 0,
                              inner.rows, window)
    if not window and rows != 1:
        raise ValueError("the incoming template is not one row")
    if rows < 1:
        raise ValueError("a template of no rows")
    token_n, position_n = struct.unpack_from("<ii", in_template, _TOKEN_N)
    if position_n != 0 or (window and token_n != rows) or token_n not in (0, rows):
        raise ValueError("the incoming template's sidebands are not its rows' tokens")
    for name, frame in (("incoming", in_template), ("outgoing", out_template)):
        if _I32.unpack_from(frame, _FLAGS)[0] & _UNCARRIED_FLAGS:
            raise ValueError(f"the {name} template carries a section or rows the relay does not carry")
        if _I32.unpack_from(frame, layout.TOKEN_COUNT)[0] != rows or _I32.unpack_from(frame, layout.KIND)[0] != kind:
            raise ValueError(f"the {name} template is not the message's {rows} rows")
    sidebands = 4 * (token_n + position_n)
    if out_template[_TOKEN_N:_POSITION_N + 4] != in_template[_TOKEN_N:_POSITION_N + 4]:
        raise ValueError("the templates' sidebands differ")
    in_dtype = _I32.unpack_from(in_template, _DTYPE)[0]
    out_dtype = _I32.unpack_from(out_template, _DTYPE)[0]
    activation = FIXED_HEADER + sidebands
    if tokens_only:
        if len(in_template) != activation:
            raise ValueError("a template's length does not match its layout")
        return TemplateLayout(activation, activation, activation, activation, in_dtype, in_dtype, rows, window)
    if out_dtype not in _DTYPE_BYTES or (not first and in_dtype not in _DTYPE_BYTES):
        raise ValueError("the relay carries f32 and f16 activations only")
    in_length = activation + (0 if first else rows * width * _DTYPE_BYTES[in_dtype])
    out_length = activation + rows * width * _DTYPE_BYTES[out_dtype]
    if len(in_template) != in_length or len(out_template) != out_length:
        raise ValueError("a template's length does not match its layout")
    return TemplateLayout(in_length, out_length, activation, activation, in_dtype, out_dtype, rows, window)


def one_row(reply: bytes, prediction: int, rows: int) -> bytes:
    """A verify window's reply (its PredictedTokens of ``rows`` rows at ``prediction``, whose token
    count and largest window are ``rows``, as every stage writes them) as the same reply to a
    window of one row: the shape a run keeps, spread again to each window's rows.

    Raises:
        ValueError: not such a reply.
    """
    vector = prediction + layout.REPLY_VECTOR_ENTRY
    counts = vector + 4 * rows + 8 + layout.STATS_VERIFY_COUNTS
    if (len(reply) < counts + 32 or _I32.unpack_from(reply, prediction + 8)[0] != rows
            or struct.unpack_from("<2q", reply, counts + 16) != (rows, rows)):
        raise ValueError(f"the reply is not a verify window's of {rows} rows")
    single = bytearray(reply[:vector + 4] + reply[vector + 4 * rows:])
    _I32.pack_into(single, prediction + 8, 1)
    struct.pack_into("<2q", single, counts + 16 - 4 * (rows - 1), 1, 1)
    return bytes(single)


class Family(NamedTuple):
    """The templates of one kind a run carries (a decode, or a verify window of any rows: its
    replies kept as a window of one row's, :func:`one_row`), from one message the lane handled
    and what it wrote for it."""

    kind: int
    window: bool
    #: The fixed part of the incoming and (a non-final stage) the outgoing frame.
    in_header: bytes
    out_header: bytes
    #: The token sideband holds the rows' tokens (else it is empty: a decode's token is its
    #: ``current_token``).
    sideband: bool
    in_dtype: int
    out_dtype: int
    #: A final stage's reply (one row's) and where it is patched.
    reply: bytes
    reply_shape: ReplyLayout | None
    #: Hop by hop on a non-final stage: the downstream's reply and this stage's answer (one
    #: row's), and their layout (None: no replies).
    reply_in: bytes
    reply_out: bytes
    hop: HopLayout | None


def family_layout(in_template: bytes, out_template: bytes, *, width: int, first: bool, final: bool = False,
                  reply_in: bytes = b"", reply_out: bytes = b"") -> Family:
    """One kind's templates (:func:`template_layout`'s frames, :func:`hop_layout`'s replies).

    Raises:
        ValueError: templates the relay cannot carry.
    """
    shape = template_layout(in_template, out_template, width=width, first=first, final=final)
    rows, window = shape.rows, shape.window
    kind, token_n = _I32.unpack_from(in_template, layout.KIND)[0], _I32.unpack_from(in_template, _TOKEN_N)[0]
    reply, reply_shape = b"", None
    if final:
        reply_shape = reply_layout(out_template, rows=rows, window=window)
        reply = one_row(out_template, reply_shape.token - layout.REPLY_TOKEN, rows) if window else out_template
        reply_shape = reply_layout(reply, rows=1, window=window)
    hop = None
    if reply_in:
        hop = hop_layout(reply_in, reply_out, rows=rows, window=window)
        if window:
            reply_in, reply_out = (one_row(reply_in, hop.prediction_in, rows),
                                   one_row(reply_out, hop.prediction_out, rows))
            hop = hop_layout(reply_in, reply_out, rows=1, window=True)
    return Family(kind, window, in_template[:FIXED_HEADER], b"" if final else out_template[:FIXED_HEADER],
                  token_n != 0, shape.in_dtype, shape.out_dtype, reply, reply_shape, reply_in, reply_out, hop)


def frame_length(header: bytes, *, width: int, first: bool) -> int:
    """The length of the message frame whose (carried) fixed part is ``header``."""
    _, _, rows, token_n, position_n = struct.unpack_from("<5i", header, 0)
    dtype = _I32.unpack_from(header, _DTYPE)[0]
    return FIXED_HEADER + 4 * (token_n + position_n) + (0 if first else rows * width * _DTYPE_BYTES[dtype])


class _InFlight(NamedTuple):
    """Hop by hop, a message computed and forwarded whose reply is not answered yet: its kind's
    templates, rows, shift and length (0: one the lane forwarded and the run took over), its
    compute and write times and when its write began (microseconds), when the write ended and
    when it was read whole (``perf_counter_ns``)."""

    family: Family
    rows: int
    shift: int
    length: int
    compute_us: int
    write_us: int
    sent_us: int
    sent_ns: int
    received_ns: int


class DecodeRelay:
    """One session's steady-state decode relay.

    Args:
        upstream_fd / downstream_fd: the lane's sockets (non-blocking; the lane keeps owning
            them); a final stage's downstream is the session's return lane.
        stop_fd: readable when the run must end between frames (an eventfd the glue writes).
        abort_fd: readable when it must end at once, even in the middle of writing a frame.
        in_template / out_template: a message the lane handled (a decode, or a verify window)
            as received, and the frame the lane forwarded for it (a final stage: the reply it
            wrote, :func:`reply_layout`): the run carries messages of its kind (a window's of any
            rows up to the runtime's batch).
        reply_in / reply_out: hop by hop on a non-final stage, the downstream's reply to it and
            this stage's answer (:func:`hop_layout`).
        other: the same four templates of the other kind (a decode's when the first are a
            window's, or the reverse), so a run carries both interleaved; None: one kind.
        final: the stage samples; the runtime's ``sample`` picks each row's token.
        width: the activation width; first: the stage takes token ids (layer 0).
        n_vocab: token ids must be below it (first stage).
        next_position: the session's next position (its KV length); position_end: the cells
            the stage holds (0: no limit).
        activation_limit: the largest magnitude an activation value may have.
        runtime: the batch (``skippy.runtime.RowBatch``) whose ``rows`` are the most one message
            may have; each message decodes ``set_rows(rows)`` of them.
        max_steps: the most rows one :meth:`run` relays (a message that would pass it ends the
            run, unless it is the run's first).
        log_rows: a non-final stage keeps the f32 output rows of every message it computes, for
            the stage's activation log (:meth:`take_log`, after each run).
        run: a one-stage chain's decode run (docs/protocol.md §11) the loop drives itself, as
            ``(frame, left, stop_tokens)``: the run's next step as the lane would execute it (a
            DecodeEmbd of the template's shape), the predictions still to make (that step's
            included) and the tokens that end it.  The loop reads nothing from the upstream
            then: it computes the step, writes its reply upstream and, unless the run is over,
            makes the next step from its own pick (the next position and decode step, the pick
            as its token); the stop descriptor (the lane received a message) ends it between
            steps, and so does an upstream socket with no room for a reply (an upstream that does
            not read: the lane's path waits for it, the runtime does not).  :attr:`run_steps`, :attr:`run_token` and :attr:`run_over` say how far it got.
    """

    def __init__(self, *, upstream_fd: int, downstream_fd: int, stop_fd: int, abort_fd: int, in_template: bytes,
                 out_template: bytes, width: int, first: bool, n_vocab: int, next_position: int,
                 position_end: int, activation_limit: float, runtime: Any, final: bool = False,
                 max_steps: int = 1024, reply_in: bytes = b"", reply_out: bytes = b"",
                 other: tuple[bytes, bytes, bytes, bytes] | None = None, log_rows: bool = False,
                 run: tuple[bytes, int, tuple[int, ...]] | None = None) -> None:
        if reply_in and final:
            raise ValueError("a final stage answers hop by hop with its reply as the outgoing template")
        if run is not None and not (first and final and not reply_in):
            raise ValueError("the loop drives a decode run on a one-stage chain's stage only")
        self._capacity_rows = int(getattr(runtime, "rows", 1))
        families = [family_layout(in_template, out_template, width=width, first=first, final=final,
                                  reply_in=reply_in, reply_out=reply_out)]
        if other is not None:
            families.append(family_layout(other[0], other[1], width=width, first=first, final=final,
                                          reply_in=other[2], reply_out=other[3]))
            if families[0].kind == families[1].kind or (families[0].hop is None) != (families[1].hop is None):
                raise ValueError("the other templates are not the other kind's, alike hop by hop")
        rows = _I32.unpack_from(in_template, layout.TOKEN_COUNT)[0]
        if rows > self._capacity_rows:
            raise ValueError(f"the runtime's batch holds {self._capacity_rows} rows, the template {rows}")
        self._families = {family.kind: family for family in families}
        #: Hop by hop (a non-final stage): replies are read and answered.
        self._hop = families[0].hop is not None
        #: Hop by hop: what was read of the oldest message in flight's reply, the messages in
        #: flight (oldest first) and their frames.
        self._reply = bytearray()
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._held: collections.deque[bytes] = collections.deque()
        self._final = final
        self._upstream, self._downstream, self._stop, self._abort = upstream_fd, downstream_fd, stop_fd, abort_fd
        self._out = bytearray()
        self._width, self._first, self._n_vocab = width, first, n_vocab
        self.next_position, self._position_end = next_position, position_end
        self._limit = float(np.float32(activation_limit))
        self._runtime = runtime
        self._max_steps = max_steps
        largest = FIXED_HEADER + 4 * self._capacity_rows + (0 if first else self._capacity_rows * width * 4)
        self._capacity = largest * 2 + (1 << 16)  # (hop by hop the frames in flight are held apart)
        self._buffer = bytearray()
        self._poll = select.poll()
        self._poll.register(upstream_fd, select.POLLIN)
        self._poll.register(stop_fd, select.POLLIN)
        self._poll.register(abort_fd, select.POLLIN)
        self._poll_stop = select.poll()  # (a decode run's check between steps)
        self._poll_stop.register(stop_fd, select.POLLIN)
        self._poll_stop.register(abort_fd, select.POLLIN)
        if run is not None:
            self._poll_stop.register(downstream_fd, select.POLLOUT)
        self.last_frame_ns = time.monotonic_ns()
        #: The rows of the messages computed this run (None: not logging), as (start, count,
        #: rows) entries: a message that starts where the last one ended extends it.
        self._log: list[list[Any]] | None = [] if log_rows and not final else None
        #: This message: its kind's templates, its rows, its length, how far a window's replies
        #: after the token vector lie from the one-row templates', where its rows start (a
        #: rollback trims the KV back to it first), when it was read whole (``perf_counter_ns``:
        #: a window's total time counts from there).
        self._family = families[0]
        self._rows = self._length = self._shift = self._position = 0
        self._received_ns = 0
        #: A decode run's next step (a frame of the template's shape), its predictions left and
        #: stop tokens; the steps it carried, the last one's pick and whether the run is over.
        self._run_frame = bytearray(run[0]) if run is not None else None
        self._run_left = run[1] if run is not None else 0
        self._run_stops = frozenset(run[2]) if run is not None else frozenset()
        if self._run_frame is not None:
            rows, token_n = struct.unpack_from("<2i", self._run_frame, layout.TOKEN_COUNT)
            if rows != 1 or token_n not in (0, 1) or len(self._run_frame) != FIXED_HEADER + 4 * token_n:
                raise ValueError("a decode run's step is one DecodeEmbd row of token ids")
        self.run_steps = 0
        self.run_token = -1
        self.run_over = False
        self._pick = -1

    def take_log(self) -> list[tuple[int, int, bytes]]:
        """The f32 output rows the last :meth:`run` computed (the message in flight when it ended
        ``REPLY_PENDING`` included), as ``(start, count, rows)`` entries in the order computed:
        ``count * width`` little-endian floats for the positions ``[start, start + count)`` (an
        entry starting before the last one ended follows a rollback); then forgets them."""
        entries = [(start, count, b"".join(rows)) for start, count, rows in self._log or []]
        if self._log is not None:
            self._log = []
        return entries

    def adopts(self, kind: int, rows: int) -> bool:
        """Whether :meth:`run` may take over a message of ``kind`` and ``rows`` the lane forwarded
        (hop by hop, a kind the run carries, rows it would carry)."""
        family = self._families.get(kind)
        return (self._hop and family is not None
                and (1 <= rows <= self._capacity_rows if family.window else rows == 1))

    def run(self, pending: bytes = b"", adopted: tuple[tuple[int, int, int, int, int, int, int], ...] = ()
            ) -> RelayOutcome:
        """Relay messages (``pending`` first: bytes the lane had read) until one it does not carry,
        a stop, or ``max_steps`` rows; blocking, on a worker thread.

        ``adopted``: hop by hop, the messages the lane forwarded whose replies it has not read
        (oldest first, at most :data:`MAX_IN_FLIGHT`, each one :meth:`adopts`), as (kind, rows,
        compute_us, write_us, when its write began in microseconds, when it ended and when the
        message was received, ``perf_counter_ns``): the run answers their replies first, in
        order, as the lane would (a pipelining upstream never lets the lane go quiet).

        Raises:
            ValueError: an ``adopted`` message the run may not take over.
        """
        if len(adopted) > MAX_IN_FLIGHT or any(not self.adopts(kind, rows) for kind, rows, *_ in adopted):
            raise ValueError("a message in flight the run may not take over")
        if len(pending) > self._capacity:
            return RelayOutcome(HANDED_BACK, pending, 0, 0, 0, 0, 0)
        self._buffer = bytearray(pending)
        if self._log is not None:  # rows not taken after the last run are dropped
            self._log = []
        # steps, compute ns, write ns, bytes in, bytes out, wait ns, reply bytes in, reply bytes out,
        # trims, positions trimmed, rows, windows, the last message's rows, adopted messages answered
        counters = [0] * 14
        self._in_flight.clear()
        self._held.clear()
        for kind, rows, compute_us, write_us, sent_us, sent_ns, received_ns in adopted:
            self._in_flight.append(_InFlight(self._families[kind], rows, 4 * (rows - 1), 0, compute_us, write_us,
                                             sent_us, sent_ns, received_ns))
            self._held.append(b"")
        status = self._loop(counters)
        leftover = b"".join(self._held) + bytes(self._buffer)
        self._buffer = bytearray()
        reply, self._reply = (bytes(self._reply) if status == REPLY_PENDING else b""), bytearray()
        steps, compute_ns, write_ns, bytes_in, bytes_out, wait_ns, replies_in, replies_out = counters[:8]
        in_flight = tuple((entry.length, entry.compute_us, entry.write_us, entry.sent_us)
                          for entry in self._in_flight) if status == REPLY_PENDING else ()
        self._in_flight.clear()
        self._held.clear()
        head = in_flight[0] if in_flight else (0, 0, 0, 0)
        return RelayOutcome(status, leftover, steps, compute_ns // 1000, write_ns // 1000, bytes_in, bytes_out,
                            wait_ns // 1000, replies_in, replies_out, reply, *head[1:], *counters[8:13], head[0],
                            in_flight, counters[13])

    def _loop(self, counters: list[int]) -> int:
        if self._hop:
            return self._loop_hop(counters)
        if self._run_frame is not None:
            return self._loop_run(counters)
        while counters[10] < self._max_steps:
            status = self._fill(counters)
            if status >= 0:
                return status
            if not self._carries():
                return HANDED_BACK
            if counters[0] and counters[10] + self._rows > self._max_steps:
                return STEP_LIMIT  # (the next run starts with it)
            status = self._wait_room(self._downstream)  # (before computing: a stop may still hand it back)
            if status >= 0:
                return status
            self._received_ns = started = time.perf_counter_ns()
            if not self._step(counters):
                return HANDED_BACK
            elapsed = time.perf_counter_ns() - started
            counters[1] += elapsed
            self._patch_reply(elapsed)
            started = time.perf_counter_ns()
            written = self._write(self._downstream, self._out, DOWNSTREAM_FAILED)
            if written is not None:
                return written
            sent = time.perf_counter_ns()
            counters[2] += sent - started
            counters[4] += len(self._out)
            del self._buffer[:self._length]
            counters[0] += 1
            counters[10] += self._rows
            counters[11] += self._family.window
        return STEP_LIMIT

    def _loop_run(self, counters: list[int]) -> int:
        """A one-stage chain's decode run: each step made from the last one's pick, computed and
        answered upstream; nothing is read from the upstream (the lane's receiving task reads
        it and writes the stop descriptor when a message comes)."""
        frame = self._run_frame
        assert frame is not None
        while True:
            if self.run_over:
                return RUN_ENDED
            if counters[0] and counters[10] + 1 > self._max_steps:
                return STEP_LIMIT
            ready = dict(self._poll_stop.poll(0))
            if ready.get(self._stop) or ready.get(self._abort) or not ready.get(self._downstream, 0) & select.POLLOUT:
                return STOPPED  # (an upstream that does not read its replies: the lane's path waits, not the runtime)
            self._buffer = bytearray(frame)
            self.last_frame_ns = time.monotonic_ns()
            if not self._carries():  # (the lane runs the step and says why)
                self._buffer = bytearray()
                return STOPPED
            self._received_ns = started = time.perf_counter_ns()
            if not self._step(counters):
                self._buffer = bytearray()
                return STOPPED
            elapsed = time.perf_counter_ns() - started
            counters[1] += elapsed
            self._patch_reply(elapsed)
            started = time.perf_counter_ns()
            self._buffer = bytearray()
            written = self._write(self._downstream, self._out, DOWNSTREAM_FAILED)
            if written is not None:
                return written
            counters[2] += time.perf_counter_ns() - started
            counters[4] += len(self._out)
            counters[0] += 1
            counters[10] += 1
            token = self._pick
            self.run_steps += 1
            self.run_token = token
            self._run_left -= 1
            if self._run_left <= 0 or token in self._run_stops:
                self.run_over = True
                continue
            struct.pack_into("<i", frame, _POS_START, _I32.unpack_from(frame, _POS_START)[0] + 1)
            step = _I32.unpack_from(frame, _DECODE_STEP)[0]
            if step >= 0:
                struct.pack_into("<i", frame, _DECODE_STEP, step + 1)
            struct.pack_into("<i", frame, _CURRENT_TOKEN, token)
            if len(frame) > FIXED_HEADER:  # the token sideband
                struct.pack_into("<i", frame, FIXED_HEADER, token)

    def _loop_hop(self, counters: list[int]) -> int:
        """Hop by hop on a non-final stage, pipelined as the lane's path is: every whole message
        buffered is computed and forwarded (up to :data:`MAX_IN_FLIGHT` in flight) while the
        downstream's replies are read and answered upstream in order; a message the loop does
        not carry (or the rows' limit) stops the reading, and the run ends once the messages in
        flight are answered."""
        held, in_flight = self._held, self._in_flight
        ending = -1  # the outcome once the messages in flight are answered (nothing more is read)
        forward_waits = answer_waits = False  # a whole message waits for room downstream; a reply, upstream
        while True:
            while ending < 0 and len(in_flight) < MAX_IN_FLIGHT and not forward_waits:
                buffered = len(self._buffer)
                if buffered < FIXED_HEADER or (self._header_matches() and buffered < self._length):
                    break  # (more bytes to read)
                flying = sum(entry.rows for entry in in_flight)
                if not self._carries():
                    ending = HANDED_BACK
                elif (counters[0] or in_flight) and counters[10] + flying + self._rows > self._max_steps:
                    ending = STEP_LIMIT  # (the next run starts with it)
                elif self._full(self._downstream):
                    forward_waits = True  # (the next stage is behind: its replies are still read meanwhile)
                else:
                    status = self._forward(counters)
                    if status >= 0:
                        return status
            if not in_flight and (ending >= 0 or counters[10] >= self._max_steps):
                return ending if ending >= 0 else STEP_LIMIT
            # A socket with no room is waited for here, not in a write: a stop (the scheduler wants
            # the runtime) then hands the run back, and a reader that fell behind waits on the
            # lane's path, in trio, not on the runtime thread.
            poller = select.poll()
            for fd in (self._stop, self._abort):
                poller.register(fd, select.POLLIN)
            room = select.POLLOUT | select.POLLERR | select.POLLHUP
            down = (select.POLLIN if in_flight and not answer_waits else 0) | (select.POLLOUT if forward_waits else 0)
            reading = ending < 0 and len(in_flight) < MAX_IN_FLIGHT and not forward_waits
            up = (select.POLLIN if reading else 0) | (select.POLLOUT if answer_waits else 0)
            if down:
                poller.register(self._downstream, down)
            if up:
                poller.register(self._upstream, up)
            ready = dict(poller.poll())
            if ready.get(self._stop) or ready.get(self._abort):
                return REPLY_PENDING if in_flight else STOPPED  # (the lane reads the replies)
            if forward_waits and ready.get(self._downstream, 0) & room:
                forward_waits = False  # (room, or an error its write reports)
            if answer_waits and ready.get(self._upstream, 0) & room:
                answer_waits = False
            if ready.get(self._downstream) and down & select.POLLIN:
                if self._full(self._upstream):  # the answer has no room: wait for it (or a stop)
                    answer_waits = True
                    continue
                status = self._read_reply(counters)
                if status in (HANDED_BACK, UPSTREAM_FAILED):  # answered (or its write failed): it is done
                    entry = in_flight.popleft()
                    held.popleft()
                    if entry.length:
                        counters[0] += 1
                        counters[10] += entry.rows
                        counters[11] += entry.family.window
                    else:  # (the lane's: taken over)
                        counters[13] += 1
                if status not in (-1, HANDED_BACK):
                    return status
            if ready.get(self._upstream) and up & select.POLLIN:
                try:
                    data = os.read(self._upstream, self._capacity - len(self._buffer))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    ending = HANDED_BACK  # end of stream (or a reset): the lane's reader sees it
                    continue
                if not self._buffer:
                    self.last_frame_ns = time.monotonic_ns()
                self._buffer += data
                counters[3] += len(data)

    def _forward(self, counters: list[int]) -> int:
        """Hop by hop: compute the buffered message and forward it (it joins the messages in
        flight); -1 when it is out, else the outcome that ends the run."""
        self._received_ns = started = time.perf_counter_ns()
        if not self._step(counters):
            return HANDED_BACK
        elapsed = time.perf_counter_ns() - started
        counters[1] += elapsed
        started = time.perf_counter_ns()
        written = self._write(self._downstream, self._out, DOWNSTREAM_FAILED)
        if written is not None:
            return written
        sent = time.perf_counter_ns()
        counters[2] += sent - started
        counters[4] += len(self._out)
        self._in_flight.append(_InFlight(self._family, self._rows, self._shift, self._length, elapsed // 1000,
                                         (sent - started) // 1000, started // 1000, sent, self._received_ns))
        self._held.append(bytes(self._buffer[:self._length]))
        del self._buffer[:self._length]
        return -1

    def _patch_reply(self, elapsed: int) -> None:
        """A final stage's reply: the Timings record's compute_us, and a window's verify-window
        compute and total times (skippy.lane.messages.final_prediction), as the lane measures them."""
        shape = self._family.reply_shape
        if shape is None:
            return
        if shape.compute >= 0:
            _I64.pack_into(self._out, shape.compute, elapsed // 1000)
        if shape.window >= 0:
            sums = shape.stats + self._shift + layout.STATS_VERIFY_SUMS
            _I64.pack_into(self._out, sums, elapsed // 1000)
            _I64.pack_into(self._out, sums + 24, (time.perf_counter_ns() - self._received_ns) // 1000)

    def _fill(self, counters: list[int]) -> int:
        """Read until the buffer holds a whole message of a carried shape, or a fixed part that is
        not one; -1 when it is there, else the outcome that ends the run."""
        while True:
            if len(self._buffer) >= FIXED_HEADER and (not self._header_matches()
                                                     or len(self._buffer) >= self._length):
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
        """The fixed part is one of a carried kind: equal to its template outside the per-message
        fields, its rows (checked before anything is computed from them: every peer number is
        hostile) one decode's, or a window's within the batch, its sidebands its rows' tokens;
        notes the message's family, rows and length."""
        frame = self._buffer
        family = self._families.get(_I32.unpack_from(frame, layout.KIND)[0])
        if family is None:
            return False
        template = family.in_header
        rows, token_n, position_n = struct.unpack_from("<3i", frame, layout.TOKEN_COUNT)
        if not (1 <= rows <= self._capacity_rows if family.window else rows == 1):
            return False
        if token_n != (rows if family.sideband else 0) or position_n != 0:
            return False
        source = layout.SOURCE_STAGE
        if not (frame[layout.VERSION:_SEQ_ID] == template[layout.VERSION:_SEQ_ID]
                and (family.window or frame[_SEQ_ID:_SEQ_ID + 4] == template[_SEQ_ID:_SEQ_ID + 4])
                and frame[_SEQ_ID + 4:_DECODE_STEP] == template[_SEQ_ID + 4:_DECODE_STEP]
                and frame[source:_REQUEST_ID] == template[source:_REQUEST_ID]
                and frame[_SESSION_ID:FIXED_HEADER] == template[_SESSION_ID:FIXED_HEADER]):
            return False
        self._family, self._rows = family, rows
        self._shift = 4 * (rows - 1)
        self._length = (FIXED_HEADER + 4 * token_n
                        + (0 if self._first else rows * self._width * _DTYPE_BYTES[family.in_dtype]))
        return True

    def _carries(self) -> bool:
        """The buffered message is one the lane would run without a word: of a carried shape,
        its rows starting at the session's next position or before it (a rollback, which the
        executor's auto-align trims), inside the cells, with valid tokens or activations (the
        runtime's batch holds them then)."""
        frame = self._buffer
        if len(frame) < FIXED_HEADER or not self._header_matches() or len(frame) < self._length:
            return False
        position, rows, family = _I32.unpack_from(frame, _POS_START)[0], self._rows, self._family
        if not 0 <= position <= self.next_position or (self._position_end > 0
                                                        and position + rows > self._position_end):
            return False  # a gap, a position before 0 or the end of the cells: the lane decides
        runtime = self._runtime
        if self._first:
            if family.sideband:
                tokens = np.frombuffer(bytes(frame[FIXED_HEADER:FIXED_HEADER + 4 * rows]), dtype="<i4")
            else:
                tokens = np.array([_I32.unpack_from(frame, _CURRENT_TOKEN)[0]], dtype=np.int32)
            if not (0 <= int(tokens.min()) and int(tokens.max()) < self._n_vocab):
                return False
            runtime.token[:rows] = tokens
        else:
            start, count = FIXED_HEADER + (4 * rows if family.sideband else 0), rows * self._width
            dtype = np.float32 if family.in_dtype == 0 else np.float16
            values = np.frombuffer(bytes(frame[start:start + count * np.dtype(dtype).itemsize]),
                                   dtype=np.dtype(dtype).newbyteorder("<")).astype(np.float32)
            low, high = float(values.min()), float(values.max())
            if not (-self._limit <= low and high <= self._limit):
                return False
            runtime.embd[:count] = values
        runtime.position[:rows] = np.arange(position, position + rows, dtype=np.int32)
        runtime.set_rows(rows)
        self._position = position
        return True

    def _step(self, counters: list[int]) -> bool:
        """Trim a rollback, decode the rows and build the outgoing frame; False when the trim or
        the decode failed (the lane runs the message again and reports it)."""
        runtime, position, rows, family = self._runtime, self._position, self._rows, self._family
        if position < self.next_position:  # the executor's auto-align
            if not runtime.trim(position):
                return False
            counters[8] += 1
            counters[9] += self.next_position - position
            self.next_position = position
        counters[12] = rows
        if runtime.decode() != 0:
            return False
        frame = self._buffer
        if self._final:
            shape = family.reply_shape
            assert shape is not None
            tokens = []
            for row in range(rows):
                token = runtime.sample(row)
                if token < 0:
                    return False
                tokens.append(token)
            self._pick = tokens[0]
            self.next_position = position + rows
            vector = shape.token + layout.REPLY_VECTOR_ENTRY - layout.REPLY_TOKEN
            reply = family.reply  # one row's, spread to this message's rows
            out = self._out = bytearray(reply[:vector]) + struct.pack(f"<{rows}i", *tokens) + reply[vector + 4:]
            _I32.pack_into(out, shape.token, tokens[0])  # the prediction: the first row's
            if shape.window >= 0:
                _I32.pack_into(out, shape.token + 4, rows)
                out[shape.window + self._shift:shape.window + self._shift + 4] = frame[_SEQ_ID:_SEQ_ID + 4]
                struct.pack_into("<2q", out, shape.stats + self._shift + layout.STATS_VERIFY_COUNTS + 16, rows, rows)
            return True
        self.next_position = position + rows
        hidden = runtime.hidden()
        if self._log is not None:  # one entry per message, extended by the next contiguous one
            row_bytes = np.asarray(hidden, dtype="<f4").tobytes()
            last = self._log[-1] if self._log else None
            if last is not None and last[0] + last[1] == position:
                last[1] += rows
                last[2].append(row_bytes)
            else:
                self._log.append([position, rows, [row_bytes]])
        sidebands = FIXED_HEADER + (4 * rows if family.sideband else 0)
        out = self._out = bytearray(family.out_header)  # the per-message fields from the message:
        out[_POS_START:layout.VERSION] = frame[_POS_START:layout.VERSION]  # position, rows, sidebands
        if family.window:
            out[_SEQ_ID:_SEQ_ID + 4] = frame[_SEQ_ID:_SEQ_ID + 4]
        out[_DECODE_STEP:_DECODE_STEP + 8] = frame[_DECODE_STEP:_DECODE_STEP + 8]
        out[_REQUEST_ID:_REQUEST_ID + 8] = frame[_REQUEST_ID:_REQUEST_ID + 8]
        out += frame[FIXED_HEADER:sidebands]
        if family.out_dtype == 0:
            out += np.asarray(hidden).astype("<f4").tobytes()
        else:
            from skippy.codec import _wire_py  # the codec's own f16 rounding (ties away from zero)

            out += _wire_py.encode_activation(np.asarray(hidden).reshape(rows, -1), 1)  # type: ignore[arg-type]
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

    @staticmethod
    def _full(fd: int) -> bool:
        """``fd`` has no room for a frame now.  A socket in error is not full: its write says
        what happened."""
        waiter = select.poll()
        waiter.register(fd, select.POLLOUT)
        ready = dict(waiter.poll(0)).get(fd, 0)
        return not ready & (select.POLLOUT | select.POLLERR | select.POLLHUP)

    def _wait_room(self, fd: int) -> int:
        """Wait until ``fd`` has room for a frame: -1 then, else the outcome: STOPPED when the
        scheduler wants the runtime meanwhile (a reader that fell behind waits on the lane's
        path, in trio, not on the runtime thread), ABORTED."""
        waiter = select.poll()
        waiter.register(fd, select.POLLOUT)
        waiter.register(self._stop, select.POLLIN)
        waiter.register(self._abort, select.POLLIN)
        while True:
            ready = dict(waiter.poll())
            if ready.get(self._abort):
                return ABORTED
            if ready.get(fd, 0) & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                return -1
            if ready.get(self._stop):
                return STOPPED

    def _read_reply(self, counters: list[int]) -> int:
        """Hop by hop: read what the downstream has of the oldest message in flight's reply (never
        past it); once it is whole, add this stage's share as the lane does
        (``skippy.lane.replies.relayed``) and write it upstream.  Returns -1 while it is not
        whole, HANDED_BACK once it is answered, else the outcome (REPLY_PENDING: not carried)."""
        entry = self._in_flight[0]
        family, rows, shift = entry.family, entry.rows, entry.shift
        hop = family.hop
        assert hop is not None
        reply, wanted = self._reply, len(family.reply_in) + shift
        try:
            data = os.read(self._downstream, wanted - len(reply))  # never past this reply
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError:
            return REPLY_PENDING
        if not data:
            return REPLY_PENDING
        reply += data
        counters[6] += len(data)
        if not self._reply_matches(entry):
            return REPLY_PENDING
        if len(reply) < wanted:
            return -1
        wait_ns = max(0, time.perf_counter_ns() - entry.sent_ns)
        counters[5] += wait_ns
        durations = struct.Struct(f"<{(RECORD_BYTES - RECORD_DURATIONS) // 8}q")
        for index in range(hop.records):
            if min(durations.unpack_from(reply, hop.records_in + RECORD_BYTES * index + RECORD_DURATIONS)) < 0:
                return REPLY_PENDING  # the lane refuses it (a timing value out of range)
        if hop.logprobs and not logprob_pairs_valid(bytes(reply[layout.LOGPROBS_HEAD:hop.logprobs])):
            return REPLY_PENDING  # (likewise)
        sums_in = hop.sums_in + shift
        sums = struct.unpack_from("<4q", reply, sums_in) if hop.sums_in >= 0 else ()
        if not all(0 <= value < SUM_LIMIT for value in sums):
            return REPLY_PENDING  # a summed duration the relay does not add to: the lane's
        if sums and (_I32.unpack_from(reply, hop.prediction_in + 8)[0] != rows
                     or struct.unpack_from("<2q", reply, sums_in + _TOKEN_COUNTS) != (rows, rows)):
            return REPLY_PENDING  # not this window's count of tokens: the lane's
        out = bytearray(family.reply_out[:hop.prediction_out])
        if hop.logprobs_out:
            out[:hop.logprobs] = reply[:hop.logprobs]
        if hop.records_out >= 0:
            out[hop.records_out:hop.own_record] = reply[hop.records_in:hop.prediction_in]
            durations.pack_into(out, hop.own_record + RECORD_DURATIONS, entry.compute_us, entry.write_us,
                                wait_ns // 1000, 0)
        out += reply[hop.prediction_in:]
        if sums:  # a window: this stage's share (skippy.lane.stats.timing_stats): one more stage, the
            # request count the template's, the tokens and the largest window (its rows) the reply's
            counts = hop.sums_out + layout.STATS_VERIFY_COUNTS - layout.STATS_VERIFY_SUMS
            out[counts + shift:counts + shift + 16] = family.reply_out[counts:counts + 16]
            total_us = (time.perf_counter_ns() - entry.received_ns) // 1000
            struct.pack_into("<4q", out, hop.sums_out + shift, sums[0] + entry.compute_us, sums[1] + entry.write_us,
                             sums[2] + wait_ns // 1000, sums[3] + total_us)
        written = self._write(self._upstream, out, UPSTREAM_FAILED)
        if written is not None:
            return written
        counters[7] += len(out)
        del reply[:]
        return HANDED_BACK

    def _reply_matches(self, entry: "_InFlight") -> bool:
        """What was read of ``entry``'s reply equals the template outside the per-message fields
        (a window's after its token vector where its rows put them)."""
        family, reply, shift = entry.family, self._reply, entry.shift
        hop, template = family.hop, family.reply_in
        assert hop is not None
        vector_end = hop.prediction_in + layout.REPLY_VECTOR_ENTRY + 4
        filled = len(reply)
        for start, end in hop.fixed:
            at = start + shift if start >= vector_end else start
            if at >= filled:
                break
            length = min(end - start, filled - at)
            if reply[at:at + length] != template[start:start + length]:
                return False
        return True
