# cython: language_level=3, embedsignature=True, cdivision=True, boundscheck=False, wraparound=False
# distutils: language = c
"""The steady-state decode relay of a stage, as a ``nogil`` loop (twin: ``skippy.stage._relay_py``).

Strategy
--------
A stage decoding one session steadily does the same thing for every token (or every verify
window of speculative decoding: the same steps on the window's rows).  With direct return
(docs/protocol.md §8) a non-final stage reads a DecodeEmbd frame from upstream, runs one row
through its layers and writes the same message downstream with its own activation; no reply
goes upstream.  Hop by hop it then also reads the downstream's reply (a PredictedToken, with
the Timings records of the stages after it) and answers upstream exactly as the lane's
``skippy.lane.replies.relayed`` does: the same records and prediction (the stats merged into
nothing pending are the downstream's), with this stage's own record after them when the
upstream negotiated the extensions.  Nothing in the lane protocol changes from one token to the
next, so :class:`DecodeRelay` does the whole loop without the GIL: ``poll`` / ``recv`` on the
upstream socket, the header checked against its kind's *template* (a decode's and a verify
window's: messages of the session the Python lane handled in full; a run carries both kinds
interleaved, a window of any rows up to the runtime's batch), the activation checked (finite,
within the limit) and dequantized, ``llama_decode`` of the message's rows through the typed table
of llama.cpp calls skippy._llama fills, the output written into the outgoing frame (its kind's
template header) and sent.  Only the fields that change per message are taken from the frame:
``pos_start``, the row count and the token sideband's count (a window's rows, checked against the
batch before anything is computed from them), ``decode_step``, ``current_token``, ``request_id``,
a window's id (``seq_id``), the token sideband and the activation; everything else must equal its
kind's template byte for byte.  A message whose rows start before the session's next position (a
rollback after rejected drafts) trims the session's KV back to them first, as the executor's
auto-align does.  A window's replies are kept as a one-row window's (the twin's ``one_row``) and
spread to each window's rows: the token vector, and after it everything shifted by 4 bytes a row
with the token count and largest window set to the rows.  The downstream's reply must equal its
template (the reply the lane relayed for the template message) outside the token(s), their vector
entries, a window's id, token counts and summed verify-window durations and the records'
durations, which must be >= 0 as the lane's decoder requires (a window's count of tokens its
rows); the answer is the lane's answer template with those and this stage's durations patched
in.  On the final stage the outgoing template is the session's PredictedToken reply, or a
window's PredictedTokens (with its Timings frame when the lane or return lane negotiated one):
the loop samples each row in order (the greedy pick of the lane's path, the first maximum, or the
session's llama.cpp sampler chain) and patches the tokens, a window's id, rows and verify-window
compute and total times, and the compute time into it before writing it into the return lane,
or hop by hop upstream.  Hop by hop, a window's reply gets this stage's verify-window share added
as ``skippy.lane.stats.timing_stats`` adds it.

The loop never refuses anything: the first frame it would not carry exactly as the Python lane
does (a kind with no template, rows past the batch, another session, a position past the
session's next one or before 0, a non-finite activation, a token outside the vocabulary, a failed trim or decode) ends
the run with that frame and everything after it *handed back* unread, so the lane decodes it and gives it its one path, errors included.  The
same happens on end of stream or a reset upstream (the lane's reader then sees it), when the
glue writes the stop descriptor (another job wants the runtime, the lane is closing), and
after ``max_steps`` rows (so per-token figures reach the stage's statistics).  Hop by hop, a
downstream reply it would not carry (another shape, an annotation or Error frame, end of
stream) or a stop while it waits ends the run with ``REPLY_PENDING``: the message in flight
heads the leftover, what was read of its reply comes back too, and the lane takes the message
over from its forward (skippy.stage.decode_relay).  Hop by hop the loop pipelines as the lane's
path does: a message arriving while replies are outstanding (a speculating driver's windows) is
computed and forwarded at once, up to ``MAX_IN_FLIGHT`` in flight, their frames kept at the head of
the buffer until their replies, read in order, are answered; a message it does not carry (or the
rows' limit) stops the reading and the run ends once the ones in flight are answered, and a reply
it does not carry hands every message in flight back (``in_flight``, oldest first).  A run may
also start with messages the lane forwarded in flight (``run``'s ``adopted``: a pipelining
upstream never lets the lane go quiet): they head the messages in flight with no frame in the
buffer, their replies are answered first, in order, and a reply not carried hands them back too.
A write waits for a full socket until the abort descriptor says the lane is closing.

Thread safety: ``run`` is called on one worker thread while the lane's trio task waits for it;
the scheduler holds the runtime for it, and the lane closes neither socket before it returns.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memmove, memset

cdef extern from "_byteorder.h":
    int32_t skippy_load_i32(const unsigned char *p) noexcept nogil
    float skippy_load_f32(const unsigned char *p) noexcept nogil
    void skippy_store_i32(unsigned char *p, int32_t v) noexcept nogil
    void skippy_store_i64(unsigned char *p, int64_t v) noexcept nogil
    int64_t skippy_load_i64(const unsigned char *p) noexcept nogil

cdef extern from "_activation.h":
    void _encode_f16 "skippy_encode_f16" (const uint32_t *source, unsigned char *target,
                                          Py_ssize_t count) noexcept nogil
    void _decode_f16 "skippy_decode_f16" (const unsigned char *source, uint32_t *target,
                                          Py_ssize_t count) noexcept nogil
    int _select_kernels "skippy_activation_select" (int accelerated) noexcept

cdef extern from "_relay_pick.h" nogil:
    # numpy's argmax of a row (the first maximum, or the first NaN), vectorised: see the header.
    int32_t _first_maximum "skippy_first_maximum" (const float *values, int32_t count) noexcept

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum:
        POLLIN
        POLLOUT
        POLLERR
        POLLHUP

cdef extern from "<sys/types.h>":
    ctypedef long ssize_t

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void *buffer, size_t length, int flags)
    ssize_t send(int fd, const void *buffer, size_t length, int flags)
    enum:
        MSG_NOSIGNAL

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clock, timespec *now)
    enum:
        CLOCK_MONOTONIC

import os as _os
import struct as _struct

from skippy.stage import _relay_py as _twin

#: Which implementation this module is.
IMPLEMENTATION = "cython"

# Outcomes: the twin's values (checked below), as C constants for the loop.
cdef enum:
    _HANDED_BACK = 0
    _STOPPED = 1
    _STEP_LIMIT = 2
    _DOWNSTREAM_FAILED = 3
    _ABORTED = 4
    _REPLY_PENDING = 5
    _UPSTREAM_FAILED = 6
    _RUN_ENDED = 7

HANDED_BACK, STOPPED, STEP_LIMIT, DOWNSTREAM_FAILED, ABORTED, REPLY_PENDING, UPSTREAM_FAILED, RUN_ENDED = (
    _HANDED_BACK, _STOPPED, _STEP_LIMIT, _DOWNSTREAM_FAILED, _ABORTED, _REPLY_PENDING, _UPSTREAM_FAILED, _RUN_ENDED)
if (HANDED_BACK, STOPPED, STEP_LIMIT, DOWNSTREAM_FAILED, ABORTED, REPLY_PENDING, UPSTREAM_FAILED, RUN_ENDED) != (
        _twin.HANDED_BACK, _twin.STOPPED, _twin.STEP_LIMIT, _twin.DOWNSTREAM_FAILED, _twin.ABORTED,
        _twin.REPLY_PENDING, _twin.UPSTREAM_FAILED, _twin.RUN_ENDED):
    raise ImportError("skippy.stage._relay and its twin disagree on the outcome codes")
RelayOutcome = _twin.RelayOutcome
hop_layout = _twin.hop_layout
FIXED_HEADER = _twin.FIXED_HEADER
REPLY_BYTES = _twin.REPLY_BYTES
TIMINGS_BYTES = _twin.TIMINGS_BYTES
template_layout = _twin.template_layout
reply_layout = _twin.reply_layout
family_layout = _twin.family_layout
frame_length = _twin.frame_length
one_row = _twin.one_row
MAX_IN_FLIGHT = _twin.MAX_IN_FLIGHT
if MAX_IN_FLIGHT != _MAX_IN_FLIGHT:
    raise ImportError("skippy.stage._relay and its twin disagree on the messages in flight")

include "_frame_layout.pxi"

cdef enum:
    _DTYPE_F32 = 0
    _DTYPE_F16 = 1
    # a Timings record's size, and where its four i64 durations start in it
    _RECORD_BYTES = FRAME_TIMINGS_BYTES - FRAME_TIMINGS_HEAD
    _RECORD_DURATIONS = FRAME_TIMINGS_COMPUTE - FRAME_TIMINGS_HEAD
    _MAX_FIXED = 64
    # the state header's seq_id: a verify window's id
    _SEQ_ID = FRAME_STATE + 4
    # a reply's verify-window token count and largest window, from its sums (the twin's _TOKEN_COUNTS)
    _TOKEN_COUNTS = FRAME_STATS_VERIFY_COUNTS - FRAME_STATS_VERIFY_SUMS + 16
    # a reply's token count, from its prediction
    _REPLY_COUNT = FRAME_REPLY_VECTOR_ENTRY - 4
    # hop by hop, the most messages in flight (the twin's MAX_IN_FLIGHT)
    _MAX_IN_FLIGHT = 8

# a summed verify-window duration the relay adds to stays below this (the twin's SUM_LIMIT)
cdef int64_t _SUM_LIMIT = <int64_t>1 << 62

# The llama.cpp calls, typed by the table skippy._llama fills with the functions themselves (the C
# compiler checks each entry against llama.h there; native/cdef/skippy_relay_calls.h).
cdef extern from "skippy_relay_calls.h" nogil:
    struct llama_context
    struct llama_batch
    struct llama_sampler
    struct skippy_relay_calls:
        int32_t (*decode)(llama_context *ctx, const llama_batch *batch) noexcept nogil
        float *(*embeddings)(llama_context *ctx) noexcept nogil
        float *(*logits)(llama_context *ctx, int32_t i) noexcept nogil
        int32_t (*sample)(llama_sampler *smpl, llama_context *ctx, int32_t idx) noexcept nogil
        int32_t (*trim)(llama_context *ctx, int32_t seq, int32_t length) noexcept nogil

_select_kernels(_os.environ.get("SKIPPY_PORTABLE_KERNELS") != "1")


def first_maximum(values):
    """The relay's greedy pick over a float32 array (for tests: it must equal ``values.argmax()``)."""
    cdef const float[::1] view = values
    if view.shape[0] == 0 or view.shape[0] > 0x7FFFFFFF:
        raise ValueError("first_maximum takes 1 to 2^31-1 values")
    return _first_maximum(&view[0], <int32_t>view.shape[0])


cdef inline bint _nonpositive_finite(const unsigned char *p) noexcept nogil:
    """The little-endian f32 at ``p`` is finite and <= 0 (+0.0, or negative and not -inf)."""
    cdef uint32_t bits = (<uint32_t>p[0]) | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)
    return bits == 0 or ((bits >> 31) != 0 and ((bits >> 23) & 0xFF) != 0xFF)


cdef struct _Family:
    # One kind's templates (the twin's Family; a window's replies one row's, spread per message).
    int32_t kind
    bint window, sideband  # (sideband: the token sideband holds the rows' tokens)
    int in_dtype, out_dtype
    const unsigned char *in_header
    const unsigned char *out_header
    # a final stage's reply: its bytes, where its token, Timings compute, window id and stats are (-1: none)
    const unsigned char *reply
    Py_ssize_t reply_length, token_offset, compute_offset, window_offset, stats_offset
    # hop by hop: the downstream's reply and this stage's answer, and where their parts lie
    bint hop
    const unsigned char *reply_in
    const unsigned char *reply_out
    Py_ssize_t reply_in_length, reply_out_length
    Py_ssize_t records, records_in, records_out, own_record, prediction_in, prediction_out
    Py_ssize_t logprobs  # the one-row Logprobs frame heading the downstream's reply (0: none)
    bint logprobs_out  # the answer starts with it too
    Py_ssize_t sums_in, sums_out  # a window's verify-window sums (-1: none)
    Py_ssize_t fixed[_MAX_FIXED][2]
    int fixed_count


cdef struct _InFlight:
    # Hop by hop, a message computed and forwarded whose reply is not answered yet (the twin's _InFlight).
    _Family *family
    int32_t rows
    Py_ssize_t shift, length
    int64_t compute_us, write_us, sent_us, sent_ns, received_ns


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return <int64_t>now.tv_sec * 1000000000 + now.tv_nsec


cdef class DecodeRelay:
    """One session's steady-state decode relay (see the module header; the twin documents the
    arguments, which both implementations take alike)."""

    cdef int _upstream, _downstream, _stop, _abort
    cdef bint _final
    cdef int32_t _seq, _position, _capacity_rows
    cdef int64_t _received_ns
    cdef const skippy_relay_calls *_calls
    cdef llama_sampler *_sampler  # NULL: the greedy pick
    cdef list _keep  # the templates' bytes the families point into
    cdef _Family _families[2]
    cdef int _family_count
    # this message: its kind's templates, rows, length, how far a window's replies after the
    # token vector lie from the one-row templates', and its outgoing frame's length
    cdef _Family *_f
    cdef int32_t _rows
    cdef Py_ssize_t _length, _shift, _out_length
    cdef Py_ssize_t _width
    cdef int _first
    cdef int32_t _n_vocab
    cdef int64_t _position_end
    cdef float _limit
    cdef llama_context *_context
    cdef const llama_batch *_batch
    cdef int32_t *_n_tokens
    cdef int32_t *_token_slot
    cdef int32_t *_position_slot
    cdef float *_embd_slot
    cdef unsigned char *_buffer
    cdef Py_ssize_t _capacity, _filled
    cdef unsigned char *_out
    cdef readonly int64_t next_position
    cdef readonly int64_t last_frame_ns
    cdef int64_t _max_steps
    # hop by hop (a non-final stage): replies are read and answered
    cdef bint _hop
    # hop by hop: the messages in flight (oldest first), their frames the buffer's first _base bytes
    cdef _InFlight _flight[_MAX_IN_FLIGHT]
    cdef int _flying
    cdef Py_ssize_t _base
    cdef Py_ssize_t _reply_length, _reply_filled, _answer_length
    cdef unsigned char *_reply
    cdef unsigned char *_answer
    # the activation log's rows (a non-final stage's f32 output rows per computed message; NULL:
    # off), as entries of contiguous positions (_entry_start[i], _entry_count[i])
    cdef float *_log
    cdef Py_ssize_t _logged, _log_capacity, _entries
    cdef int64_t *_entry_start
    cdef int64_t *_entry_count
    # a one-stage chain's decode run (the twin's ``run``): its next step's frame, the predictions
    # left, its stop tokens; the steps carried, the last pick, whether it is over
    cdef unsigned char *_run_frame
    cdef Py_ssize_t _run_length
    cdef int64_t _run_left
    cdef int32_t *_run_stops
    cdef Py_ssize_t _run_stop_count
    cdef readonly int64_t run_steps
    cdef readonly int32_t run_token
    cdef readonly bint run_over
    cdef int32_t _last_pick

    def __cinit__(self):
        self._buffer = NULL
        self._run_frame = NULL
        self._run_stops = NULL
        self._log = NULL
        self._entry_start = NULL
        self._entry_count = NULL
        self._out = NULL
        self._reply = NULL
        self._answer = NULL

    def __init__(self, *, int upstream_fd, int downstream_fd, int stop_fd, int abort_fd, bytes in_template,
                 bytes out_template, Py_ssize_t width, bint first, int n_vocab, int64_t next_position,
                 int64_t position_end, double activation_limit, object runtime, bint final=False,
                 int64_t max_steps=1024, bytes reply_in=b"", bytes reply_out=b"", object other=None,
                 bint log_rows=False, object run=None):
        cdef Py_ssize_t largest_reply = 0, largest_answer = 0, largest_out, index
        cdef _Family *family
        if reply_in and final:
            raise ValueError("a final stage answers hop by hop with its reply as the outgoing template")
        if run is not None and not (first and final and not reply_in):
            raise ValueError("the loop drives a decode run on a one-stage chain's stage only")
        self.run_steps, self.run_token, self.run_over, self._last_pick = 0, -1, False, -1
        if run is not None:
            run_frame, self._run_left, stops = bytes(run[0]), run[1], tuple(run[2])
            rows, token_n = _struct.unpack_from("<2i", run_frame, FRAME_TOKEN_COUNT)
            if rows != 1 or token_n not in (0, 1) or len(run_frame) != FRAME_FIXED_HEADER + 4 * token_n:
                raise ValueError("a decode run's step is one DecodeEmbd row of token ids")
            self._run_length = len(run_frame)
            self._run_frame = <unsigned char *>malloc(self._run_length)
            self._run_stops = <int32_t *>malloc(sizeof(int32_t) * (len(stops) + 1))
            if self._run_frame == NULL or self._run_stops == NULL:
                raise MemoryError()
            memcpy(self._run_frame, PyBytes_AS_STRING(run_frame), self._run_length)
            for index, stop in enumerate(stops):
                self._run_stops[index] = stop
            self._run_stop_count = len(stops)
        self._capacity_rows = getattr(runtime, "rows", 1)
        shapes = [_twin.family_layout(in_template, out_template, width=width, first=first, final=final,
                                      reply_in=reply_in, reply_out=reply_out)]
        if other is not None:
            shapes.append(_twin.family_layout(other[0], other[1], width=width, first=first, final=final,
                                              reply_in=other[2], reply_out=other[3]))
            if shapes[0].kind == shapes[1].kind or (shapes[0].hop is None) != (shapes[1].hop is None):
                raise ValueError("the other templates are not the other kind's, alike hop by hop")
        rows = _twin._I32.unpack_from(in_template, FRAME_TOKEN_COUNT)[0]
        if rows > self._capacity_rows:
            raise ValueError(f"the runtime's batch holds {self._capacity_rows} rows, the template {rows}")
        self._keep = []
        self._family_count = len(shapes)
        self._hop = shapes[0].hop is not None
        for index, shape in enumerate(shapes):
            family = &self._families[index]
            memset(family, 0, sizeof(_Family))
            self._keep += [shape.in_header, shape.out_header, shape.reply, shape.reply_in, shape.reply_out]
            family.kind, family.window, family.sideband = shape.kind, shape.window, shape.sideband
            family.in_dtype, family.out_dtype = shape.in_dtype, shape.out_dtype
            family.in_header = <const unsigned char *>PyBytes_AS_STRING(shape.in_header)
            family.out_header = <const unsigned char *>PyBytes_AS_STRING(shape.out_header)
            family.reply = <const unsigned char *>PyBytes_AS_STRING(shape.reply)
            family.reply_length = len(shape.reply)
            family.token_offset = family.compute_offset = family.window_offset = family.stats_offset = -1
            if shape.reply_shape is not None:
                (family.token_offset, family.compute_offset, family.window_offset,
                 family.stats_offset) = shape.reply_shape
            hop = shape.hop
            family.hop = hop is not None
            family.sums_in = family.sums_out = -1
            if hop is not None:
                if len(hop.fixed) > _MAX_FIXED:
                    raise ValueError("the downstream's reply holds too many Timings records for the relay")
                family.reply_in = <const unsigned char *>PyBytes_AS_STRING(shape.reply_in)
                family.reply_out = <const unsigned char *>PyBytes_AS_STRING(shape.reply_out)
                family.reply_in_length, family.reply_out_length = len(shape.reply_in), len(shape.reply_out)
                (family.records, family.records_in, family.records_out, family.own_record, family.prediction_in,
                 family.prediction_out) = hop[:6]
                family.logprobs, family.logprobs_out = hop.logprobs, hop.logprobs_out
                family.sums_in, family.sums_out = hop.sums_in, hop.sums_out
                family.fixed_count = len(hop.fixed)
                for field, (start, end) in enumerate(hop.fixed):
                    family.fixed[field][0], family.fixed[field][1] = start, end
                spread = 4 * (self._capacity_rows - 1) if shape.window else 0
                largest_reply = max(largest_reply, family.reply_in_length + spread)
                largest_answer = max(largest_answer, family.reply_out_length + spread)
        if self._hop:
            self._reply = <unsigned char *>malloc(largest_reply)
            self._answer = <unsigned char *>malloc(largest_answer)
            if self._reply == NULL or self._answer == NULL:
                raise MemoryError()
        self._f = &self._families[0]
        self._final = final
        self._upstream, self._downstream, self._stop, self._abort = upstream_fd, downstream_fd, stop_fd, abort_fd
        self._width, self._first, self._n_vocab = width, first, n_vocab
        self.next_position, self._position_end = next_position, position_end
        self._limit = <float>activation_limit
        self._max_steps = max_steps
        addresses = runtime.addresses()
        self._calls = <const skippy_relay_calls *><uintptr_t>addresses["calls"]
        self._context = <llama_context *><uintptr_t>addresses["context"]
        self._batch = <const llama_batch *><uintptr_t>addresses["batch"]
        self._n_tokens = <int32_t *><uintptr_t>addresses["n_tokens"]
        self._token_slot = <int32_t *><uintptr_t>addresses["token"]
        self._position_slot = <int32_t *><uintptr_t>addresses["position"]
        self._embd_slot = <float *><uintptr_t>addresses["embd"]
        self._sampler = <llama_sampler *><uintptr_t>addresses.get("sampler", 0)
        self._seq = getattr(runtime, "seq", 0)
        if final and "sampler" not in addresses:
            raise ValueError("a final stage's relay needs the runtime's sampler")
        largest_out = FRAME_FIXED_HEADER + 4 * <Py_ssize_t>self._capacity_rows  # (the token sideband)
        # (hop by hop the frames in flight stay at the buffer's head)
        self._capacity = ((largest_out + (0 if first else <Py_ssize_t>self._capacity_rows * width * 4))
                          * (_MAX_IN_FLIGHT + 2 if self._hop else 2) + (1 << 16))
        largest_out += <Py_ssize_t>self._capacity_rows * width * 4
        if final:  # the largest reply: one row's and the rest of the batch's tokens
            largest_out = max([len(shape.reply) for shape in shapes]) + 4 * (self._capacity_rows - 1)
        self._buffer = <unsigned char *>malloc(self._capacity)
        self._out = <unsigned char *>malloc(largest_out)
        if self._buffer == NULL or self._out == NULL:
            raise MemoryError()
        self._filled = 0
        self._logged = self._entries = 0
        self._log_capacity = max(max_steps, <int64_t>self._capacity_rows)
        if log_rows and not final and max_steps > 0:
            self._log = <float *>malloc(<size_t>self._log_capacity * <size_t>width * sizeof(float))
            self._entry_start = <int64_t *>malloc(<size_t>self._log_capacity * sizeof(int64_t))
            self._entry_count = <int64_t *>malloc(<size_t>self._log_capacity * sizeof(int64_t))
            if self._log == NULL or self._entry_start == NULL or self._entry_count == NULL:
                raise MemoryError()
        self.last_frame_ns = _now_ns()

    def __dealloc__(self):
        free(self._buffer)
        free(self._out)
        free(self._reply)
        free(self._answer)
        free(self._log)
        free(self._entry_start)
        free(self._entry_count)
        free(self._run_frame)
        free(self._run_stops)

    def adopts(self, int kind, int rows):
        """Whether ``run`` may take over a message of ``kind`` and ``rows``; see the twin's ``adopts``."""
        cdef int index
        if not self._hop:
            return False
        for index in range(self._family_count):
            if self._families[index].kind == kind:
                return (1 <= rows <= self._capacity_rows) if self._families[index].window else rows == 1
        return False

    def run(self, bytes pending=b"", tuple adopted=()):
        """Relay until a frame it does not carry, a stop, or ``max_steps`` rows; see the twin's ``run``."""
        cdef Py_ssize_t count = PyBytes_GET_SIZE(pending)
        cdef int index
        cdef _InFlight *entry
        if len(adopted) > _MAX_IN_FLIGHT or any(not self.adopts(message[0], message[1]) for message in adopted):
            raise ValueError("a message in flight the run may not take over")
        if count > self._capacity:
            return RelayOutcome(_HANDED_BACK, pending, 0, 0, 0, 0, 0)
        memcpy(self._buffer, PyBytes_AS_STRING(pending), count)
        self._filled = count
        self._base = self._flying = self._reply_filled = 0
        self._logged = self._entries = 0  # rows not taken after the last run are dropped
        for message in adopted:  # (the lane's: no frame in the buffer)
            entry = &self._flight[self._flying]
            for index in range(self._family_count):
                if self._families[index].kind == message[0]:
                    entry.family = &self._families[index]
            entry.rows, entry.length = message[1], 0
            entry.shift = 4 * (entry.rows - 1)
            entry.compute_us, entry.write_us, entry.sent_us, entry.sent_ns, entry.received_ns = message[2:7]
            self._flying += 1
        cdef int status
        # steps, compute ns, write ns, bytes in, bytes out, wait ns, reply bytes in / out, trims, positions
        # trimmed, rows, windows, the last message's rows, adopted messages answered
        cdef int64_t counters[14]
        memset(counters, 0, sizeof(counters))
        with nogil:
            status = self._loop(counters)
        leftover = PyBytes_FromStringAndSize(<char *>self._buffer, self._filled)
        self._filled = 0
        reply = b""
        in_flight = ()
        if status == _REPLY_PENDING:
            reply = PyBytes_FromStringAndSize(<char *>self._reply, self._reply_filled)
            in_flight = tuple((self._flight[index].length, self._flight[index].compute_us,
                               self._flight[index].write_us, self._flight[index].sent_us)
                              for index in range(self._flying))
        head = in_flight[0] if in_flight else (0, 0, 0, 0)
        self._reply_filled = self._base = self._flying = 0
        return RelayOutcome(status, leftover, counters[0], counters[1] // 1000, counters[2] // 1000, counters[3],
                            counters[4], counters[5] // 1000, counters[6], counters[7], reply, *head[1:],
                            counters[8], counters[9], counters[10], counters[11], counters[12], head[0], in_flight,
                            counters[13])

    def take_log(self):
        """The rows computed since the last call; see the twin's ``take_log``."""
        cdef Py_ssize_t index, offset = 0, count
        entries = []
        for index in range(self._entries):
            count = self._entry_count[index]
            entries.append((self._entry_start[index], count, PyBytes_FromStringAndSize(
                <char *>(self._log + offset * self._width), count * self._width * 4)))
            offset += count
        self._logged = self._entries = 0
        return entries

    cdef int _loop(self, int64_t *counters) noexcept nogil:
        cdef int status
        cdef int64_t started, elapsed, sent
        cdef int64_t *steps = counters
        cdef int64_t *compute_ns = counters + 1
        cdef int64_t *write_ns = counters + 2
        cdef int64_t *bytes_in = counters + 3
        cdef int64_t *bytes_out = counters + 4
        cdef Py_ssize_t sums
        if self._hop:
            return self._loop_hop(counters)
        if self._run_frame != NULL:
            return self._loop_run(counters)
        while counters[10] < self._max_steps:
            status = self._fill(bytes_in)
            if status >= 0:
                return status
            if not self._carries():
                return _HANDED_BACK
            if steps[0] > 0 and counters[10] + self._rows > self._max_steps:
                return _STEP_LIMIT  # (the next run starts with it)
            status = self._wait_room(self._downstream)  # (before computing: a stop may still hand it back)
            if status >= 0:
                return status
            started = _now_ns()
            self._received_ns = started
            if self._step(counters) != 0:
                return _HANDED_BACK  # the lane runs it again and reports what failed
            elapsed = _now_ns() - started
            compute_ns[0] += elapsed
            if self._f.compute_offset >= 0:  # the Timings record's compute_us, as the lane measures it
                skippy_store_i64(self._out + self._f.compute_offset, elapsed // 1000)
            if self._f.window_offset >= 0:  # a window's verify-window compute and total times (final_prediction)
                sums = self._f.stats_offset + self._shift + FRAME_STATS_VERIFY_SUMS
                skippy_store_i64(self._out + sums, elapsed // 1000)
                skippy_store_i64(self._out + sums + 24, (_now_ns() - self._received_ns) // 1000)
            started = _now_ns()
            status = self._write(self._downstream, self._out, self._out_length, _DOWNSTREAM_FAILED)
            if status >= 0:
                return status
            sent = _now_ns()
            write_ns[0] += sent - started
            bytes_out[0] += self._out_length
            self._consume(self._length)
            counters[0] += 1
            counters[10] += self._rows
            if self._f.window:
                counters[11] += 1
        return _STEP_LIMIT

    cdef int _loop_run(self, int64_t *counters) noexcept nogil:
        """A one-stage chain's decode run (the twin's _loop_run): each step made from the last
        one's pick, computed and answered upstream; nothing is read from the upstream."""
        cdef int status
        cdef int64_t started, elapsed
        cdef int32_t token, step
        cdef Py_ssize_t index
        cdef bint stop
        cdef pollfd fds[3]
        while True:
            if self.run_over:
                return _RUN_ENDED
            if counters[0] > 0 and counters[10] + 1 > self._max_steps:
                return _STEP_LIMIT
            fds[0].fd, fds[0].events, fds[0].revents = self._stop, POLLIN, 0
            fds[1].fd, fds[1].events, fds[1].revents = self._abort, POLLIN, 0
            fds[2].fd, fds[2].events, fds[2].revents = self._downstream, POLLOUT, 0
            if poll(fds, 3, 0) < 0 or fds[0].revents or fds[1].revents or not (fds[2].revents & POLLOUT):
                # (a stop, an abort, a failed poll, or an upstream with no room for a reply: one
                # that does not read waits on the lane's path, not on the runtime)
                return _STOPPED
            memcpy(self._buffer, self._run_frame, self._run_length)
            self._base = 0
            self._filled = self._run_length
            self.last_frame_ns = _now_ns()
            if not self._carries():  # (the lane runs the step and says why)
                self._filled = 0
                return _STOPPED
            started = _now_ns()
            self._received_ns = started
            if self._step(counters) != 0:
                self._filled = 0
                return _STOPPED
            self._filled = 0
            elapsed = _now_ns() - started
            counters[1] += elapsed
            if self._f.compute_offset >= 0:  # the Timings record's compute_us, as the lane measures it
                skippy_store_i64(self._out + self._f.compute_offset, elapsed // 1000)
            started = _now_ns()
            status = self._write(self._downstream, self._out, self._out_length, _DOWNSTREAM_FAILED)
            if status >= 0:
                return status
            counters[2] += _now_ns() - started
            counters[4] += self._out_length
            counters[0] += 1
            counters[10] += 1
            token = self._last_pick
            self.run_steps += 1
            self.run_token = token
            self._run_left -= 1
            stop = self._run_left <= 0
            for index in range(self._run_stop_count):
                if self._run_stops[index] == token:
                    stop = True
            if stop:
                self.run_over = True
                continue
            skippy_store_i32(self._run_frame + FRAME_POS_START, skippy_load_i32(self._run_frame + FRAME_POS_START) + 1)
            step = skippy_load_i32(self._run_frame + FRAME_DECODE_STEP)
            if step >= 0:
                skippy_store_i32(self._run_frame + FRAME_DECODE_STEP, step + 1)
            skippy_store_i32(self._run_frame + FRAME_CURRENT_TOKEN, token)
            if self._run_length > FRAME_FIXED_HEADER:  # the token sideband
                skippy_store_i32(self._run_frame + FRAME_FIXED_HEADER, token)

    cdef int _loop_hop(self, int64_t *counters) noexcept nogil:
        """Hop by hop on a non-final stage, pipelined as the lane's path is (the twin's _loop_hop):
        every whole message buffered is computed and forwarded (up to _MAX_IN_FLIGHT in flight)
        while the downstream's replies are read and answered upstream in order; a message the loop
        does not carry (or the rows' limit) stops the reading, and the run ends once the messages
        in flight are answered."""
        cdef int ending = -1, status, index
        cdef int64_t flying_rows
        cdef Py_ssize_t buffered
        cdef ssize_t got
        cdef pollfd fds[4]
        cdef unsigned long count
        cdef bint reading
        cdef bint forward_waits = False  # a whole message waits for room downstream
        cdef bint answer_waits = False  # a reply waits for room upstream
        cdef _InFlight *head
        while True:
            while ending < 0 and self._flying < _MAX_IN_FLIGHT and not forward_waits:
                buffered = self._filled - self._base
                if buffered < FRAME_FIXED_HEADER or (self._header_matches() and buffered < self._length):
                    break  # (more bytes to read)
                flying_rows = 0
                for index in range(self._flying):
                    flying_rows += self._flight[index].rows
                if not self._carries():
                    ending = _HANDED_BACK
                elif (counters[0] > 0 or self._flying > 0) and counters[10] + flying_rows + self._rows > self._max_steps:
                    ending = _STEP_LIMIT  # (the next run starts with it)
                elif self._full(self._downstream):
                    forward_waits = True  # (the next stage is behind: its replies are still read meanwhile)
                else:
                    status = self._forward(counters)
                    if status >= 0:
                        return status
            if self._flying == 0 and (ending >= 0 or counters[10] >= self._max_steps):
                return ending if ending >= 0 else _STEP_LIMIT
            # A socket with no room is waited for here, not in a write: a stop (the scheduler wants
            # the runtime) then hands the run back, and a reader that fell behind waits on the
            # lane's path, in trio, not on the runtime thread.
            reading = ending < 0 and self._flying < _MAX_IN_FLIGHT and not forward_waits
            fds[0].fd, fds[0].events, fds[0].revents = self._stop, POLLIN, 0
            fds[1].fd, fds[1].events, fds[1].revents = self._abort, POLLIN, 0
            fds[2].fd, fds[2].revents = self._downstream, 0
            fds[2].events = (POLLIN if self._flying > 0 and not answer_waits else 0) | (POLLOUT if forward_waits else 0)
            if fds[2].events == 0:
                fds[2].fd = -1
            fds[3].fd, fds[3].revents = self._upstream, 0
            fds[3].events = (POLLIN if reading else 0) | (POLLOUT if answer_waits else 0)
            if fds[3].events == 0:
                fds[3].fd = -1
            if poll(fds, 4, -1) < 0:
                if errno == EINTR:
                    continue
                return _REPLY_PENDING if self._flying > 0 else _HANDED_BACK
            if fds[0].revents or fds[1].revents:
                return _REPLY_PENDING if self._flying > 0 else _STOPPED  # (the lane reads the replies)
            if forward_waits and fds[2].revents & (POLLOUT | POLLERR | POLLHUP):
                forward_waits = False  # (room, or an error its write reports)
            if answer_waits and fds[3].revents & (POLLOUT | POLLERR | POLLHUP):
                answer_waits = False
            if fds[2].revents and fds[2].events & POLLIN:
                if self._full(self._upstream):  # the answer has no room: wait for it (or a stop)
                    answer_waits = True
                    continue
                status = self._read_reply(counters)
                if status == _HANDED_BACK or status == _UPSTREAM_FAILED:  # answered (or its write failed): done
                    head = &self._flight[0]
                    if head.length > 0:
                        counters[0] += 1
                        counters[10] += head.rows
                        if head.family.window:
                            counters[11] += 1
                    else:  # (the lane's: taken over)
                        counters[13] += 1
                    self._consume(head.length)
                    self._base -= head.length
                    self._flying -= 1
                    memmove(&self._flight[0], &self._flight[1], self._flying * sizeof(_InFlight))
                if status != -1 and status != _HANDED_BACK:
                    return status
            if fds[3].revents and fds[3].events & POLLIN:
                got = recv(self._upstream, self._buffer + self._filled, self._capacity - self._filled, 0)
                if got > 0:
                    if self._filled == self._base:
                        self.last_frame_ns = _now_ns()
                    self._filled += got
                    counters[3] += got
                elif got == 0 or (errno != EAGAIN and errno != EINTR):
                    ending = _HANDED_BACK  # end of stream (or a reset): the lane's reader sees it

    cdef int _forward(self, int64_t *counters) noexcept nogil:
        """Hop by hop: compute the buffered message and forward it (it joins the messages in
        flight); -1 when it is out, else the outcome that ends the run."""
        cdef int64_t started, elapsed, sent
        cdef int status
        cdef _InFlight *entry
        started = _now_ns()
        self._received_ns = started
        if self._step(counters) != 0:
            return _HANDED_BACK  # the lane runs it again and reports what failed
        elapsed = _now_ns() - started
        counters[1] += elapsed
        started = _now_ns()
        status = self._write(self._downstream, self._out, self._out_length, _DOWNSTREAM_FAILED)
        if status >= 0:
            return status
        sent = _now_ns()
        counters[2] += sent - started
        counters[4] += self._out_length
        entry = &self._flight[self._flying]
        entry.family, entry.rows, entry.shift, entry.length = self._f, self._rows, self._shift, self._length
        entry.compute_us, entry.write_us, entry.sent_us = elapsed // 1000, (sent - started) // 1000, started // 1000
        entry.sent_ns, entry.received_ns = sent, self._received_ns
        self._flying += 1
        self._base += self._length
        return -1

    cdef int _fill(self, int64_t *bytes_in) noexcept nogil:
        """Read until the buffer holds a whole message of a carried shape, or a fixed part that is
        not one; -1 when it is there, else the outcome that ends the run."""
        cdef int ready
        cdef ssize_t got
        while True:
            if self._filled >= FRAME_FIXED_HEADER and (not self._header_matches() or self._filled >= self._length):
                return -1  # (_carries() hands a fixed part that is not one back)
            ready = self._wait_readable(self._upstream)
            if ready < 0:
                return _HANDED_BACK
            if ready > 0:
                return _STOPPED
            got = recv(self._upstream, self._buffer + self._filled, self._capacity - self._filled, 0)
            if got > 0:
                if self._filled == 0:
                    self.last_frame_ns = _now_ns()
                self._filled += got
                bytes_in[0] += got
            elif got == 0:
                return _HANDED_BACK  # end of stream: the lane's reader sees it
            elif errno != EAGAIN and errno != EINTR:  # EWOULDBLOCK is EAGAIN on Linux
                return _HANDED_BACK  # a reset reads as end of stream there too

    cdef int _wait_readable(self, int fd) noexcept nogil:
        """Wait until ``fd`` is readable (0), the stop or abort descriptor is (1), or poll fails (-1)."""
        cdef pollfd fds[3]
        while True:
            fds[0].fd, fds[0].events, fds[0].revents = fd, POLLIN, 0
            fds[1].fd, fds[1].events, fds[1].revents = self._stop, POLLIN, 0
            fds[2].fd, fds[2].events, fds[2].revents = self._abort, POLLIN, 0
            if poll(fds, 3, -1) < 0:
                if errno == EINTR:
                    continue
                return -1
            return 1 if fds[1].revents or fds[2].revents else 0

    cdef bint _header_matches(self) noexcept nogil:
        """The fixed part is one of a carried kind: equal to its template outside the per-message
        fields, its rows (checked before anything is computed from them: every peer number is
        hostile) one decode's or a window's within the batch, its sidebands its rows' tokens;
        notes the message's family, rows and length."""
        cdef const unsigned char *frame = self._buffer + self._base
        cdef const unsigned char *template
        cdef _Family *family = NULL
        cdef int32_t kind = skippy_load_i32(frame + FRAME_KIND)
        cdef int32_t rows = skippy_load_i32(frame + FRAME_TOKEN_COUNT)
        cdef int32_t token_n = skippy_load_i32(frame + FRAME_TOKEN_N)
        cdef int index
        for index in range(self._family_count):
            if self._families[index].kind == kind:
                family = &self._families[index]
        if family == NULL:
            return False
        if family.window:
            if rows < 1 or rows > self._capacity_rows:
                return False
        elif rows != 1:
            return False
        if token_n != (rows if family.sideband else 0) or skippy_load_i32(frame + FRAME_POSITION_N) != 0:
            return False
        template = family.in_header
        if not (memcmp(frame + FRAME_VERSION, template + FRAME_VERSION, _SEQ_ID - FRAME_VERSION) == 0
                and (family.window or memcmp(frame + _SEQ_ID, template + _SEQ_ID, 4) == 0)
                and memcmp(frame + _SEQ_ID + 4, template + _SEQ_ID + 4, FRAME_DECODE_STEP - _SEQ_ID - 4) == 0
                and memcmp(frame + FRAME_SOURCE_STAGE, template + FRAME_SOURCE_STAGE,
                           FRAME_REQUEST_ID - FRAME_SOURCE_STAGE) == 0
                and memcmp(frame + FRAME_SESSION_ID, template + FRAME_SESSION_ID, 8) == 0):
            return False
        self._f, self._rows = family, rows
        self._shift = 4 * <Py_ssize_t>(rows - 1)
        self._length = FRAME_FIXED_HEADER + 4 * <Py_ssize_t>token_n
        if not self._first:
            self._length += <Py_ssize_t>rows * self._width * (4 if family.in_dtype == _DTYPE_F32 else 2)
        return True

    cdef bint _carries(self) noexcept nogil:
        """The buffered message is one the lane would run without a word: of a carried shape, its
        rows starting at the session's next position or before it (a rollback, which the
        executor's auto-align trims), inside the cells, with valid tokens or activations (the
        runtime's batch holds them then)."""
        cdef const unsigned char *frame = self._buffer + self._base
        cdef int32_t position, token, row, rows
        cdef Py_ssize_t index, count, activation
        cdef float value
        if (self._filled - self._base < FRAME_FIXED_HEADER or not self._header_matches()
                or self._filled - self._base < self._length):
            return False
        position, rows = skippy_load_i32(frame + FRAME_POS_START), self._rows
        count = <Py_ssize_t>rows * self._width
        if position < 0 or position > self.next_position or (
                self._position_end > 0 and <int64_t>position + rows > self._position_end):
            return False  # a gap, a position before 0 or the end of the cells: the lane decides
        if self._first:
            for row in range(rows):
                token = (skippy_load_i32(frame + FRAME_FIXED_HEADER + 4 * row) if self._f.sideband
                         else skippy_load_i32(frame + FRAME_CURRENT_TOKEN))
                if token < 0 or token >= self._n_vocab:
                    return False
                self._token_slot[row] = token
        else:
            activation = FRAME_FIXED_HEADER + (4 * <Py_ssize_t>rows if self._f.sideband else 0)
            if self._f.in_dtype == _DTYPE_F32:
                for index in range(count):
                    value = skippy_load_f32(frame + activation + 4 * index)
                    if not (-self._limit <= value <= self._limit):  # NaN fails both
                        return False
                    self._embd_slot[index] = value
            else:
                _decode_f16(frame + activation, <uint32_t *>self._embd_slot, count)
                for index in range(count):
                    value = self._embd_slot[index]
                    if not (-self._limit <= value <= self._limit):
                        return False
        for row in range(rows):
            self._position_slot[row] = position + row
        self._n_tokens[0] = rows
        self._position = position
        return True

    cdef int _step(self, int64_t *counters) noexcept nogil:
        """Trim a rollback, decode the rows and build the outgoing frame; nonzero when the trim or
        the decode failed (the lane runs the message again and reports it)."""
        cdef const unsigned char *frame = self._buffer + self._base
        cdef unsigned char *out = self._out
        cdef _Family *family = self._f
        cdef float *hidden
        cdef Py_ssize_t last, vector, sidebands
        cdef int32_t token, row, rows = self._rows, position = self._position
        if position < self.next_position:  # the executor's auto-align
            if self._calls.trim(self._context, self._seq, position) != 0:
                return 1
            counters[8] += 1
            counters[9] += self.next_position - position
            self.next_position = position
        counters[12] = rows
        if self._calls.decode(self._context, self._batch) != 0:
            return 1
        if self._final:  # the reply: one row's, spread to this message's rows
            vector = family.token_offset + (FRAME_REPLY_VECTOR_ENTRY - FRAME_REPLY_TOKEN)
            memcpy(out, family.reply, vector)
            memcpy(out + vector + 4 * <Py_ssize_t>rows, family.reply + vector + 4, family.reply_length - vector - 4)
            self._out_length = family.reply_length + self._shift
            for row in range(rows):  # in row order, as the lane samples them
                token = self._pick(row)
                if token < 0:
                    return 1
                if row == 0:  # the prediction: the first row's
                    skippy_store_i32(out + family.token_offset, token)
                    self._last_pick = token
                skippy_store_i32(out + vector + 4 * row, token)  # the token vector's entry
            if family.window_offset >= 0:
                skippy_store_i32(out + family.token_offset + 4, rows)
                memcpy(out + family.window_offset + self._shift, frame + _SEQ_ID, 4)
                last = family.stats_offset + self._shift + FRAME_STATS_VERIFY_COUNTS + 16
                skippy_store_i64(out + last, rows)
                skippy_store_i64(out + last + 8, rows)
            self.next_position = position + rows
            return 0
        self.next_position = position + rows
        hidden = self._calls.embeddings(self._context)
        if hidden == NULL:
            return 1
        if self._log != NULL and self._logged + rows <= self._log_capacity:  # one entry per contiguous stretch
            memcpy(self._log + self._logged * self._width, hidden, 4 * <Py_ssize_t>rows * self._width)
            self._logged += rows
            last = self._entries - 1
            if last >= 0 and self._entry_start[last] + self._entry_count[last] == position:
                self._entry_count[last] += rows
            else:
                self._entry_start[self._entries] = position
                self._entry_count[self._entries] = rows
                self._entries += 1
        sidebands = FRAME_FIXED_HEADER + (4 * <Py_ssize_t>rows if family.sideband else 0)
        memcpy(out, family.out_header, FRAME_FIXED_HEADER)  # the per-message fields from the message:
        memcpy(out + FRAME_POS_START, frame + FRAME_POS_START, FRAME_VERSION - FRAME_POS_START)  # position, rows, sidebands
        if family.window:
            memcpy(out + _SEQ_ID, frame + _SEQ_ID, 4)
        memcpy(out + FRAME_DECODE_STEP, frame + FRAME_DECODE_STEP, 8)
        memcpy(out + FRAME_REQUEST_ID, frame + FRAME_REQUEST_ID, 8)
        memcpy(out + FRAME_FIXED_HEADER, frame + FRAME_FIXED_HEADER, sidebands - FRAME_FIXED_HEADER)
        if family.out_dtype == _DTYPE_F32:
            memcpy(out + sidebands, hidden, 4 * <Py_ssize_t>rows * self._width)
            self._out_length = sidebands + 4 * <Py_ssize_t>rows * self._width
        else:
            _encode_f16(<const uint32_t *>hidden, out + sidebands, <Py_ssize_t>rows * self._width)
            self._out_length = sidebands + 2 * <Py_ssize_t>rows * self._width
        return 0

    cdef int32_t _pick(self, int32_t row) noexcept nogil:
        """The final stage's token for decoded row ``row`` (-1: no logits)."""
        cdef float *logits
        if self._sampler != NULL:
            return self._calls.sample(self._sampler, self._context, row)
        logits = self._calls.logits(self._context, row)
        if logits == NULL:
            return -1
        return _first_maximum(logits, self._n_vocab)

    cdef int _write(self, int fd, const unsigned char *frame, Py_ssize_t length, int failed) noexcept nogil:
        """Write ``frame`` to ``fd``, waiting while the socket is full; -1 when it is out, else the
        outcome that ends the run (``failed`` for a failed write; upstream, an abort too)."""
        cdef Py_ssize_t sent = 0
        cdef ssize_t wrote
        cdef pollfd fds[2]
        while sent < length:
            wrote = send(fd, frame + sent, length - sent, MSG_NOSIGNAL)
            if wrote > 0:
                sent += wrote
                continue
            if wrote < 0 and (errno == EAGAIN or errno == EINTR):
                fds[0].fd, fds[0].events, fds[0].revents = fd, POLLOUT, 0
                fds[1].fd, fds[1].events, fds[1].revents = self._abort, POLLIN, 0
                if poll(fds, 2, -1) < 0 and errno != EINTR:
                    return failed
                if fds[1].revents:
                    return _ABORTED if failed == _DOWNSTREAM_FAILED else failed
                continue
            return failed
        return -1

    cdef bint _full(self, int fd) noexcept nogil:
        """``fd`` has no room for a frame now (the twin's _full).  A failed poll or a socket in
        error is not full: its write says what happened."""
        cdef pollfd fds[1]
        fds[0].fd, fds[0].events, fds[0].revents = fd, POLLOUT, 0
        if poll(fds, 1, 0) < 0:
            return False
        return not (fds[0].revents & (POLLOUT | POLLERR | POLLHUP))

    cdef int _wait_room(self, int fd) noexcept nogil:
        """Wait until ``fd`` has room for a frame (the twin's _wait_room): -1 then, else the
        outcome: _STOPPED when the scheduler wants the runtime meanwhile (a reader that fell
        behind waits on the lane's path, in trio, not on the runtime thread), _ABORTED."""
        cdef pollfd fds[3]
        while True:
            fds[0].fd, fds[0].events, fds[0].revents = fd, POLLOUT, 0
            fds[1].fd, fds[1].events, fds[1].revents = self._stop, POLLIN, 0
            fds[2].fd, fds[2].events, fds[2].revents = self._abort, POLLIN, 0
            if poll(fds, 3, -1) < 0:
                if errno == EINTR:
                    continue
                return -1  # (the write says what happened)
            if fds[2].revents:
                return _ABORTED
            if fds[0].revents & (POLLOUT | POLLERR | POLLHUP):
                return -1
            if fds[1].revents:
                return _STOPPED

    cdef int _read_reply(self, int64_t *counters) noexcept nogil:
        """Hop by hop: read what the downstream has of the oldest message in flight's reply (never
        past it); once it is whole, add this stage's share as the lane does
        (``skippy.lane.replies.relayed``) and write it upstream.  Returns -1 while it is not whole,
        _HANDED_BACK once it is answered, else the outcome (_REPLY_PENDING: not carried)."""
        cdef _InFlight *entry = &self._flight[0]
        cdef _Family *family = entry.family
        cdef ssize_t got
        cdef int64_t wait_ns, value
        cdef int64_t sums[4]
        cdef Py_ssize_t index, field, offset, sums_in, sums_out, shift = entry.shift
        cdef int status
        self._reply_length = family.reply_in_length + shift
        self._answer_length = family.reply_out_length + shift
        got = recv(self._downstream, self._reply + self._reply_filled,
                   self._reply_length - self._reply_filled, 0)  # never past this reply
        if got > 0:
            self._reply_filled += got
            counters[6] += got
            if not self._reply_matches():
                return _REPLY_PENDING
        elif got == 0 or (errno != EAGAIN and errno != EINTR):
            return _REPLY_PENDING
        if self._reply_filled < self._reply_length:
            return -1
        wait_ns = _now_ns() - entry.sent_ns
        if wait_ns < 0:
            wait_ns = 0
        counters[5] += wait_ns
        for index in range(family.records):  # the lane refuses a negative timing value
            for field in range(4):
                offset = family.records_in + _RECORD_BYTES * index + _RECORD_DURATIONS + 8 * field
                if self._reply[offset + 7] & 0x80:
                    return _REPLY_PENDING
        offset = FRAME_LOGPROBS_HEAD
        while offset < family.logprobs:  # the lane's decoder takes a token >= 0, a log-probability finite, <= 0
            if self._reply[offset + 3] & 0x80 or not _nonpositive_finite(self._reply + offset + 4):
                return _REPLY_PENDING
            offset += FRAME_LOGPROBS_PAIR
        sums_in = family.sums_in + shift
        if family.sums_in >= 0:  # a summed duration the relay does not add to: the lane's
            for field in range(4):
                value = skippy_load_i64(self._reply + sums_in + 8 * field)
                if value < 0 or value >= _SUM_LIMIT:
                    return _REPLY_PENDING
                sums[field] = value
            if (skippy_load_i32(self._reply + family.prediction_in + _REPLY_COUNT) != entry.rows
                    or skippy_load_i64(self._reply + sums_in + _TOKEN_COUNTS) != entry.rows
                    or skippy_load_i64(self._reply + sums_in + _TOKEN_COUNTS + 8) != entry.rows):
                return _REPLY_PENDING  # not this window's count of tokens: the lane's
        memcpy(self._answer, family.reply_out, family.prediction_out)
        if family.logprobs_out:
            memcpy(self._answer, self._reply, family.logprobs)
        if family.records_out >= 0:
            memcpy(self._answer + family.records_out, self._reply + family.records_in, _RECORD_BYTES * family.records)
            offset = family.own_record + _RECORD_DURATIONS
            skippy_store_i64(self._answer + offset, entry.compute_us)
            skippy_store_i64(self._answer + offset + 8, entry.write_us)
            skippy_store_i64(self._answer + offset + 16, wait_ns // 1000)
            skippy_store_i64(self._answer + offset + 24, 0)
        memcpy(self._answer + family.prediction_out, self._reply + family.prediction_in,
               self._reply_length - family.prediction_in)
        if family.sums_out >= 0:  # a window: this stage's share (timing_stats): one more stage, the request
            # count the template's, the tokens and the largest window (its rows) the reply's
            offset = family.sums_out + (FRAME_STATS_VERIFY_COUNTS - FRAME_STATS_VERIFY_SUMS)
            memcpy(self._answer + offset + shift, family.reply_out + offset, 16)
            sums_out = family.sums_out + shift
            skippy_store_i64(self._answer + sums_out, sums[0] + entry.compute_us)
            skippy_store_i64(self._answer + sums_out + 8, sums[1] + entry.write_us)
            skippy_store_i64(self._answer + sums_out + 16, sums[2] + wait_ns // 1000)
            skippy_store_i64(self._answer + sums_out + 24, sums[3] + (_now_ns() - entry.received_ns) // 1000)
        status = self._write(self._upstream, self._answer, self._answer_length, _UPSTREAM_FAILED)
        if status >= 0:
            return status
        counters[7] += self._answer_length
        self._reply_filled = 0
        return _HANDED_BACK

    cdef bint _reply_matches(self) noexcept nogil:
        """What was read of the reply equals the template outside the per-message fields (a
        window's after its token vector where its rows put them)."""
        cdef _Family *family = self._flight[0].family
        cdef const unsigned char *template = family.reply_in
        cdef Py_ssize_t index, start, at, length
        cdef Py_ssize_t vector_end = family.prediction_in + FRAME_REPLY_VECTOR_ENTRY + 4
        for index in range(family.fixed_count):
            start = family.fixed[index][0]
            at = start + self._flight[0].shift if start >= vector_end else start
            if at >= self._reply_filled:
                break
            length = family.fixed[index][1] - start
            if length > self._reply_filled - at:
                length = self._reply_filled - at
            if memcmp(self._reply + at, template + start, length) != 0:
                return False
        return True

    cdef void _consume(self, Py_ssize_t length) noexcept nogil:
        self._filled -= length
        if self._filled:
            memmove(self._buffer, self._buffer + length, self._filled)
