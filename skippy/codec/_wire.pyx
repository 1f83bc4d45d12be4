# cython: language_level=3, embedsignature=True, cdivision=True, initializedcheck=False
# distutils: language = c
"""Cython hot paths of the stage frame codec; the API and semantics of ``skippy.codec._wire_py``.

Strategy
--------
Same two-step decode as the twin (read the module header of ``_wire_py.py``): ``_layout`` walks
the uncommitted ``bytearray`` with a pointer-plus-length cursor in the reference reader's order,
checking every size field against its limit as soon as its bytes are there, and returns either
the frame length needed so far or a complete :c:type:`MessageLayout`. A complete frame is copied
once into a ``bytes`` object; sidebands and f32 activations become zero-copy numpy views of it
(base = the frame, read-only), f16/q8 activations are dequantized into a fresh float32 array by
``nogil`` loops.

Encoding computes the exact frame size after validating everything, allocates the ``bytes``
once and writes it with the little-endian stores of ``_byteorder.h`` (the only byte-order code).
Cold paths whose cost does not matter (the sampling section, unusual argument types, error
construction) call the twin's helpers, so both implementations raise identical errors.

f16 encoding rounds ties away from zero like the reference (not the hardware's ties-to-even);
the f16 and q8 kernels are branch-free C in ``_activation.h`` so the compiler vectorises them, with
AVX2/F16C versions (``_activation_x86.h``, same bytes) picked at run time where the CPU has them.
"""

cimport cython
cimport numpy as cnp
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.bool cimport PyBool_Check
from cpython.long cimport PyLong_Check
from cpython.object cimport PyObject, PyTypeObject, Py_TYPE
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int8_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy

import dataclasses
import os as _os
from types import MemberDescriptorType

import numpy as np

from skippy.codec import _wire_py as _twin
from skippy.codec.protocol import (
    END_OF_STREAM,
    MAX_MESSAGE_FRAME_BYTES,
    MAX_REPLY_FRAME_BYTES,
    NEED_DATA,
    LogitBias,
    MessageKind,
    NativeMtpDraft,
    ReplyKind,
    ReplyStats,
    SamplingConfig,
    StageMessage,
    StageReply,
    StateHeader,
    WireDType,
    WireError,
)

cnp.import_array()

if not SKIPPY_HOST_LITTLE_ENDIAN:
    raise ImportError("skippy.codec._wire supports little-endian hosts only; the pure twin is used")

#: Which implementation this module is.
IMPLEMENTATION = "cython"

# Limits and bits of protocol.py, as C constants for the hot paths.
cdef enum:
    MAX_LOGIT_BIAS = 256
    MAX_PREDICTED = 262144
    MAX_SIDEBAND = 1048576
    MAX_METADATA = 8388608
    MAX_STATE_IMPORT = 536870912
    MAX_ACTIVATION = 536870912
    MAX_DECODED = 536870912
    VERSION = 11
    SAMPLING_BIT = 8
    CHAT_BIT = 32
    STATS_BYTES = 184
    # Activations smaller than this are converted without releasing the GIL: for a decode frame
    # (one row) releasing and retaking it costs more than the conversion.
    NOGIL_ELEMENTS = 65536


cdef frozenset _KIND_CODES = frozenset(int(kind) for kind in MessageKind)
cdef tuple _KINDS = tuple(MessageKind(code) if code in _KIND_CODES else None for code in range(23))
cdef tuple _REPLY_KINDS = (None, ReplyKind.ACK, ReplyKind.PREDICTED_TOKEN,
                           ReplyKind.PREDICTED_TOKENS)
cdef object _EMPTY_I32 = _twin._EMPTY_I32
cdef tuple _STATE_FIELDS = _twin._STATE_FIELDS


# ------------------------------------------------------------------------------------------
# Frame objects without __init__
# ------------------------------------------------------------------------------------------
# The decoders build frozen, slotted dataclasses from values they have already validated, and
# the generated __init__ (one object.__setattr__ per field) was most of the per-frame cost. So a
# decoded object is allocated as object.__new__ would (PyType_GenericAlloc) and its slots are
# filled directly at the offsets their member descriptors name. This is done only for classes
# that _slot_layout has checked: every field is an object slot (T_OBJECT_EX, writable), there is
# no instance __dict__, no __new__ and no __post_init__ (protocol.py validates nothing in
# __init__; keep it that way or drop the class from here); otherwise the class is called as
# usual. All fields are always given, so the result equals what __init__ would build.

cdef extern from "Python.h":
    # object.__new__'s allocation for these classes (their tp_alloc), typed for a C type pointer.
    object _allocate "PyType_GenericAlloc" (PyTypeObject *cls, Py_ssize_t items)
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member

cdef enum:
    MEMBER_OBJECT_EX = 16   # T_OBJECT_EX / Py_T_OBJECT_EX (structmember.h)
    MEMBER_READONLY = 1     # READONLY / Py_READONLY
    MAX_SLOTS = 24

cdef struct SlotLayout:
    PyTypeObject *cls        # borrowed: the classes live as long as skippy.codec.protocol
    Py_ssize_t count         # 0: build by calling the class
    Py_ssize_t offsets[MAX_SLOTS]


cdef int _slot_layout(SlotLayout *layout, object cls, tuple expected=None) except -1:
    """Fill ``layout`` for ``cls``, or leave ``count`` 0 (the slow path) if it does not qualify
    or its field names are not ``expected`` (the order the encoder's indices assume)."""
    layout.cls = <PyTypeObject *>cls
    layout.count = 0
    names = [field.name for field in dataclasses.fields(cls)]
    if (expected is not None and tuple(names) != expected) or (len(names) > MAX_SLOTS or cls.__new__ is not object.__new__ or cls.__dictoffset__
            or hasattr(cls, "__post_init__") or not cls.__dataclass_params__.init):
        return 0
    cdef PyMemberDef *member
    for index, name in enumerate(names):
        descriptor = cls.__dict__.get(name)
        if type(descriptor) is not MemberDescriptorType:
            return 0
        member = (<PyMemberDescrObject *><PyObject *>descriptor).d_member
        if member.type != MEMBER_OBJECT_EX or member.flags & MEMBER_READONLY:
            return 0
        layout.offsets[index] = member.offset
    layout.count = len(names)
    return 0


cdef inline void _set_slot(object instance, Py_ssize_t offset, object value) noexcept:
    # The instance is fresh, so the slot is NULL: store a new reference, release nothing.
    Py_INCREF(value)
    (<PyObject **>((<char *><PyObject *>instance) + offset))[0] = <PyObject *>value


cdef object _new_object(SlotLayout *layout, tuple values):
    """``cls(*values)`` for a checked layout, without running ``__init__``."""
    if layout.count != len(values):
        return (<object>layout.cls)(*values)
    instance = _allocate(layout.cls, 0)
    cdef Py_ssize_t index
    for index in range(layout.count):
        _set_slot(instance, layout.offsets[index], <object>PyTuple_GET_ITEM(values, index))
    return instance


cdef inline object _field(object instance, SlotLayout *layout, Py_ssize_t index, str name):
    """``instance.<name>``, read straight from its slot when ``instance`` is of the layout's class
    (``name`` is field ``index`` there; checked at import)."""
    cdef PyObject *value
    if layout.count and Py_TYPE(instance) == layout.cls:
        value = (<PyObject **>((<char *><PyObject *>instance) + layout.offsets[index]))[0]
        if value != NULL:
            return <object>value
    return getattr(instance, name)


cdef SlotLayout _STATE_LAYOUT, _MESSAGE_LAYOUT, _SAMPLING_LAYOUT, _BIAS_LAYOUT
cdef SlotLayout _REPLY_LAYOUT, _STATS_LAYOUT, _DRAFT_LAYOUT
_slot_layout(&_STATE_LAYOUT, StateHeader, _STATE_FIELDS + ("reserved",))
_slot_layout(&_MESSAGE_LAYOUT, StageMessage, (
    "kind", "pos_start", "token_count", "state", "request_id", "session_id", "sampling",
    "chat_sampling_metadata", "tokens", "positions", "activation", "raw_bytes"))
_slot_layout(&_SAMPLING_LAYOUT, SamplingConfig)
_slot_layout(&_BIAS_LAYOUT, LogitBias)
_slot_layout(&_REPLY_LAYOUT, StageReply)
_slot_layout(&_STATS_LAYOUT, ReplyStats)
_slot_layout(&_DRAFT_LAYOUT, NativeMtpDraft)


cdef object _state_header(const unsigned char *data):
    """The StateHeader of the ten i32 at ``data`` (frame offset 20)."""
    if _STATE_LAYOUT.count != 10:
        return StateHeader(*[skippy_load_i32(data + 4 * index) for index in range(10)])
    instance = _allocate(_STATE_LAYOUT.cls, 0)
    cdef Py_ssize_t index
    for index in range(10):
        _set_slot(instance, _STATE_LAYOUT.offsets[index], skippy_load_i32(data + 4 * index))
    return instance


include "_frame_layout.pxi"
include "_wire_activation.pxi"


# ------------------------------------------------------------------------------------------
# Encoding
# ------------------------------------------------------------------------------------------

cdef inline int _check_dtype(object dtype) except -1:
    if type(dtype) is not WireDType:
        return _twin._check_dtype(dtype)
    return <int>dtype


cdef inline bint _is_int(object value) noexcept:
    # int and its subclasses (IntEnum members such as Phase), but not bool, as the twin.
    return PyLong_Check(value) and not PyBool_Check(value)


cdef inline int64_t _i32(str name, object value) except? -1:
    cdef int64_t number
    if _is_int(value):
        try:
            number = value
        except OverflowError:  # beyond int64: let the twin build the range error
            return _twin._check_range(name, value, -(1 << 31), (1 << 31) - 1)
        if -2147483648 <= number <= 2147483647:
            return number
    return _twin._check_range(name, value, -(1 << 31), (1 << 31) - 1)


cdef inline uint64_t _u64(str name, object value) except? 0xFFFFFFFFFFFFFFFF:
    if _is_int(value):
        try:
            return value
        except OverflowError:  # negative or beyond u64: the twin builds the range error
            pass
    return _twin._check_range(name, value, 0, 0xFFFFFFFFFFFFFFFF)


cdef object _sideband(str name, object values, str reason):
    if _is_array(values, cnp.NPY_INT32, 1) and cnp.PyArray_SIZE(values) <= MAX_SIDEBAND:
        return values
    return _twin._int32_values(name, values, MAX_SIDEBAND, reason)


def encode_message(message, wire_dtype, width=None):
    """Encode ``message`` as one frame; see ``_wire_py.encode_message`` for the contract."""
    kind_value = _field(message, &_MESSAGE_LAYOUT, 0, "kind")
    cdef int64_t kind = _i32("kind", kind_value)
    if kind < 0 or kind > 22 or _KINDS[kind] is None:
        _twin._check_kind(kind_value)
    cdef int dtype = _check_dtype(wire_dtype)
    state = _field(message, &_MESSAGE_LAYOUT, 3, "state")
    tokens = _sideband("tokens", _field(message, &_MESSAGE_LAYOUT, 8, "tokens"),
                       "too many tokens")
    positions = _sideband("positions", _field(message, &_MESSAGE_LAYOUT, 9, "positions"),
                          "too many position sideband values")
    cdef int64_t header[10]
    cdef Py_ssize_t index
    for index in range(9):
        name = <str>PyTuple_GET_ITEM(_STATE_FIELDS, index)
        header[index] = _i32(name, _field(state, &_STATE_LAYOUT, index, name))
    header[9] = dtype
    if header[0] != VERSION:
        _twin._check_version(header[0])
    cdef int64_t flags = header[3] & ~(SAMPLING_BIT | CHAT_BIT)
    sampling = b""
    metadata = b""
    sampling_config = _field(message, &_MESSAGE_LAYOUT, 6, "sampling")
    if sampling_config is not None:
        flags |= SAMPLING_BIT
        sampling = _twin._encode_sampling(sampling_config)
    chat_metadata = _field(message, &_MESSAGE_LAYOUT, 7, "chat_sampling_metadata")
    if chat_metadata is not None:
        flags |= CHAT_BIT
        metadata = _twin._encode_metadata(chat_metadata)
    header[3] = flags
    cdef int64_t pos_start = _i32("pos_start", _field(message, &_MESSAGE_LAYOUT, 1, "pos_start"))
    cdef int64_t token_count = _i32("token_count",
                                    _field(message, &_MESSAGE_LAYOUT, 2, "token_count"))
    cdef uint64_t request_id = _u64("request_id",
                                    _field(message, &_MESSAGE_LAYOUT, 4, "request_id"))
    cdef uint64_t session_id = _u64("session_id",
                                    _field(message, &_MESSAGE_LAYOUT, 5, "session_id"))
    activation = _field(message, &_MESSAGE_LAYOUT, 10, "activation")
    raw = _field(message, &_MESSAGE_LAYOUT, 11, "raw_bytes")
    if type(raw) is not bytes:
        raw = bytes(raw)
    cdef Py_ssize_t token_n = cnp.PyArray_SIZE(tokens), position_n = cnp.PyArray_SIZE(positions)
    cdef int64_t rows = 0, wire_bytes = 0, payload = 0
    cdef bint write_activation = False
    if kind == 3 or kind == 7 or raw:
        # Rare kinds and shapes: the twin validates, then its checks are already done.
        _twin._validate_special_payload(kind, token_count, tokens, positions, activation, raw,
                                        False)
        payload = len(raw) if kind == 7 else 0
    else:
        if token_count < 0:
            _twin._validate_special_payload(kind, token_count, tokens, positions, activation, raw,
                                            True)
        payload = 4 * (token_n + position_n)
        if header[8] >= 0 and kind != 15 and kind != 16 and kind != 17:
            if activation is not None and not _is_array(activation, cnp.NPY_FLOAT32, 2):
                activation = _twin._float32_rows(activation)
            if width is None:
                width = 0 if activation is None else cnp.PyArray_DIMS(activation)[1]
            _activation_sizes(dtype, token_count, width, flags, &rows, &wire_bytes)
            if activation is None or cnp.PyArray_SIZE(activation) + rows * width == 0:
                # No values: fine only when there are none to send (q8 still sends row scales).
                if rows * width != 0:
                    _twin._activation_shape_error(None, rows, width)
                activation = np.zeros((rows, width), dtype=np.float32)
            if (cnp.PyArray_DIMS(activation)[0] != rows
                    or cnp.PyArray_DIMS(activation)[1] != width):
                _twin._activation_shape_error(activation.shape, rows, width)
            write_activation = wire_bytes > 0
            payload += wire_bytes
        elif activation is not None and activation.size:
            _twin._validate_special_payload(kind, token_count, tokens, positions, activation,
                                            raw, False)
    cdef Py_ssize_t sampling_n = len(sampling), metadata_n = len(metadata)
    cdef Py_ssize_t total = FRAME_FIXED_HEADER + sampling_n + metadata_n + payload
    out = PyBytes_FromStringAndSize(NULL, total)
    cdef unsigned char *cursor = <unsigned char *>PyBytes_AS_STRING(out)
    skippy_store_i32(cursor + FRAME_KIND, <int32_t>kind)
    skippy_store_i32(cursor + FRAME_POS_START, <int32_t>pos_start)
    skippy_store_i32(cursor + FRAME_TOKEN_COUNT, <int32_t>token_count)
    skippy_store_i32(cursor + FRAME_TOKEN_N, <int32_t>token_n)
    skippy_store_i32(cursor + FRAME_POSITION_N, <int32_t>position_n)
    for index in range(FRAME_STATE_FIELDS):
        skippy_store_i32(cursor + FRAME_STATE + 4 * index, <int32_t>header[index])
    skippy_store_u64(cursor + FRAME_REQUEST_ID, request_id)
    skippy_store_u64(cursor + FRAME_SESSION_ID, session_id)
    cursor += FRAME_FIXED_HEADER
    if sampling_n:
        memcpy(cursor, PyBytes_AS_STRING(sampling), sampling_n)
        cursor += sampling_n
    if metadata_n:
        memcpy(cursor, PyBytes_AS_STRING(metadata), metadata_n)
        cursor += metadata_n
    if kind == 7:
        memcpy(cursor, <const char *>raw, payload)
    elif kind != 3:
        memcpy(cursor, cnp.PyArray_DATA(tokens), 4 * token_n)
        cursor += 4 * token_n
        memcpy(cursor, cnp.PyArray_DATA(positions), 4 * position_n)
        cursor += 4 * position_n
        if write_activation:
            _write_activation(activation, dtype, rows, width, cursor)
    return out


def encode_reply(reply):
    """Encode ``reply``; see ``_wire_py.encode_reply`` for the contract."""
    kind = reply.kind
    if type(kind) is not ReplyKind:
        return _twin.encode_reply(reply)  # validates and raises for unknown kinds
    tokens = reply.predicted_tokens
    draft = reply.native_mtp_draft
    stats = reply.stats.as_tuple()
    if len(tokens) > MAX_PREDICTED or (draft is not None and len(draft.token_ids) > MAX_PREDICTED):
        return _twin.encode_reply(reply)  # raises the limit error
    cdef Py_ssize_t token_n = len(tokens), draft_n = 0 if draft is None else len(draft.token_ids)
    cdef Py_ssize_t total = 12 + 4 * token_n + 8 + (0 if draft is None else 12 + 4 * draft_n)
    total += STATS_BYTES
    cdef int64_t predicted = _i32("predicted", reply.predicted)
    cdef int64_t window_id = _i32("window_id", reply.window_id)
    cdef int64_t compute_us = 0
    cdef Py_ssize_t index
    if draft is not None:
        if not (type(draft.proposal_compute_us) is int
                and -(1 << 63) <= draft.proposal_compute_us < (1 << 63)):
            return _twin.encode_reply(reply)
        compute_us = draft.proposal_compute_us
    for value in stats:
        if not (type(value) is int and -(1 << 63) <= value < (1 << 63)):
            return _twin.encode_reply(reply)
    out = PyBytes_FromStringAndSize(NULL, total)
    cdef unsigned char *cursor = <unsigned char *>PyBytes_AS_STRING(out)
    skippy_store_i32(cursor, <int32_t>int(kind))
    skippy_store_i32(cursor + 4, <int32_t>predicted)
    skippy_store_i32(cursor + 8, <int32_t>token_n)
    cursor += 12
    for index in range(token_n):
        skippy_store_i32(cursor, <int32_t>_i32("predicted_tokens", tokens[index]))
        cursor += 4
    skippy_store_i32(cursor, <int32_t>window_id)
    cursor += 4
    if draft is None:
        skippy_store_i32(cursor, 0)
        cursor += 4
    else:
        skippy_store_i32(cursor, 1)
        skippy_store_i32(cursor + 4, <int32_t>draft_n)
        cursor += 8
        for index in range(draft_n):
            skippy_store_i32(cursor, <int32_t>_i32("native_mtp_draft.token_ids",
                                                   draft.token_ids[index]))
            cursor += 4
        skippy_store_i64(cursor, compute_us)
        cursor += 8
    for index in range(23):
        skippy_store_i64(cursor + 8 * index, <int64_t>stats[index])
    return out


# ------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------

cdef class _FrameDecoder:
    """Buffer shared by both decoders; see ``_wire_py._FrameDecoder`` for the contract.

    Unlike the twin, a ``bytes`` chunk that arrives while nothing is buffered is not copied: the
    decoder keeps a reference to it (``_chunk``, immutable) and parses it in place, and when a
    frame is the whole chunk ``_commit`` returns the chunk itself, so the usual one frame per
    read costs no copy at all. Anything else (a partial frame followed by more data, a
    ``bytearray``/``memoryview`` chunk) goes through the ``bytearray`` as in the twin.
    """

    def __cinit__(self, *args, **kwargs):
        self._buffer = bytearray()
        self._chunk = None
        self._start = 0
        self._needed = 0
        self._closed = False
        self._metadata = None

    cdef inline const unsigned char *_pending_data(self) noexcept:
        if self._chunk is not None:
            return <const unsigned char *>PyBytes_AS_STRING(self._chunk) + self._start
        return <const unsigned char *>PyByteArray_AS_STRING(self._buffer) + self._start

    cdef inline Py_ssize_t _pending_size(self) noexcept:
        if self._chunk is not None:
            return PyBytes_GET_SIZE(self._chunk) - self._start
        return PyByteArray_GET_SIZE(self._buffer) - self._start

    cdef inline object _pending_object(self):
        return self._chunk if self._chunk is not None else self._buffer

    @property
    def buffered_bytes(self):
        """Bytes received and not yet returned as frames."""
        return self._pending_size()

    @property
    def bytes_needed(self):
        """Length the pending frame is known to need (0 when nothing is pending)."""
        return self._needed

    def receive_data(self, data):
        """Buffer ``data``; ``b""`` marks the end of the stream (see the twin)."""
        if self._closed:
            raise RuntimeError("received data after the end of the stream")
        cdef Py_ssize_t size = len(data)
        if size == 0:
            self._closed = True
            return
        cdef Py_ssize_t buffered = self._pending_size()
        if buffered + size > self._max_buffer_bytes:
            raise WireError("buffered data exceeds the decoder's cap", field="buffered_bytes",
                            value=buffered + size, limit=self._max_buffer_bytes)
        if buffered == 0:
            self._chunk = None
            self._start = 0
            if PyByteArray_GET_SIZE(self._buffer):
                self._buffer.clear()
            if type(data) is bytes:
                self._chunk = data  # immutable: parsed in place, never copied
                return
        elif self._chunk is not None:
            # A frame continues past this chunk: move its unconsumed tail into the buffer.
            self._buffer += memoryview(self._chunk)[self._start:]
            self._chunk = None
            self._start = 0
        self._buffer += data

    cdef object _not_ready(self, Py_ssize_t needed):
        if needed > self._max_buffer_bytes:
            raise WireError("frame exceeds the decoder's buffer cap", field="frame_bytes",
                            value=needed, limit=self._max_buffer_bytes)
        self._needed = needed
        if not self._closed:
            return NEED_DATA
        cdef Py_ssize_t buffered = self._pending_size()
        if buffered == 0:
            return END_OF_STREAM
        raise WireError("failed to fill whole buffer", field="frame_bytes", value=buffered,
                        limit=needed, end_of_stream=True)

    cdef bytes _commit(self, Py_ssize_t length):
        cdef Py_ssize_t size
        cdef bytes frame
        self._needed = 0
        if self._chunk is not None:
            size = PyBytes_GET_SIZE(self._chunk)
            if self._start == 0 and length == size:
                frame = self._chunk  # the frame is the whole chunk: no copy
            else:
                frame = PyBytes_FromStringAndSize(PyBytes_AS_STRING(self._chunk) + self._start,
                                                  length)
            self._start += length
            if self._start == size:
                self._chunk = None
                self._start = 0
            return frame
        size = PyByteArray_GET_SIZE(self._buffer)
        frame = PyBytes_FromStringAndSize(PyByteArray_AS_STRING(self._buffer) + self._start,
                                          length)
        self._start += length
        if self._start == size:
            self._buffer.clear()
            self._start = 0
        elif self._start > 65536 and self._start * 2 > size:
            del self._buffer[:self._start]
            self._start = 0
        return frame


cdef class MessageDecoder(_FrameDecoder):
    """Incremental :class:`StageMessage` decoder (see ``_wire_py.MessageDecoder``)."""

    cdef readonly Py_ssize_t width

    def __init__(self, Py_ssize_t width, *, max_buffer_bytes=MAX_MESSAGE_FRAME_BYTES + (1 << 20)):
        self.width = width
        self._max_buffer_bytes = max_buffer_bytes

    cdef Py_ssize_t _layout(self) except -1:
        """0 when a whole valid frame is buffered (``_layout_result`` set), else the frame
        length needed so far. Reads only; checks every size before it is used."""
        cdef const unsigned char *data = self._pending_data()
        cdef Py_ssize_t available = self._pending_size()
        cdef MessageLayout *layout = &self._layout_result
        if available < 4:
            return 4
        cdef int32_t kind = skippy_load_i32(data)
        if kind < 0 or kind > 22 or _KINDS[kind] is None:
            _twin._check_kind(kind)
        if available < FRAME_FIXED_HEADER:
            return FRAME_FIXED_HEADER
        cdef int32_t token_count = skippy_load_i32(data + FRAME_TOKEN_COUNT)
        cdef int32_t token_n = skippy_load_i32(data + FRAME_TOKEN_N)
        cdef int32_t position_n = skippy_load_i32(data + FRAME_POSITION_N)
        cdef int32_t version = skippy_load_i32(data + FRAME_VERSION)
        cdef int32_t flags = skippy_load_i32(data + FRAME_FLAGS)
        cdef int32_t source = skippy_load_i32(data + FRAME_SOURCE_STAGE)
        cdef int32_t dtype = skippy_load_i32(data + FRAME_WIRE_DTYPE)
        if version != VERSION:
            _twin._check_version(version)
        cdef int64_t offset = FRAME_FIXED_HEADER
        cdef uint32_t count
        layout.sampling_offset = -1
        if flags & SAMPLING_BIT:
            if available < offset + FRAME_SAMPLING_HEAD:
                return offset + FRAME_SAMPLING_HEAD
            count = skippy_load_u32(data + offset + FRAME_SAMPLING_FIXED)
            if count > MAX_LOGIT_BIAS:
                raise WireError("logit bias count exceeds maximum", field="logit_bias_count",
                                value=count, limit=MAX_LOGIT_BIAS)
            layout.sampling_offset = offset
            offset += FRAME_SAMPLING_HEAD + FRAME_SAMPLING_BIAS * <int64_t>count
            if available < offset:
                return offset
        self._metadata = None
        if flags & CHAT_BIT:
            if available < offset + 4:
                return offset + 4
            count = skippy_load_u32(data + offset)
            if count > MAX_METADATA:
                raise WireError("chat sampling metadata length exceeds maximum",
                                field="chat_sampling_metadata_length", value=count,
                                limit=MAX_METADATA)
            offset += 4 + <int64_t>count
            if available < offset:
                return offset
            try:
                self._metadata = (<const char *>data)[offset - count:offset].decode("utf-8")
            except UnicodeDecodeError as error:  # §2.5: the reader refuses non-UTF-8 metadata
                raise WireError("chat sampling metadata is not UTF-8",
                                field="chat_sampling_metadata", value=error.reason) from error
        if dtype < 0 or dtype > 2:
            _twin._check_dtype(dtype)
        layout.payload_offset = offset
        layout.token_sideband_count = 0
        layout.position_sideband_count = 0
        layout.activation_rows = -1
        if kind == 3:
            layout.length = offset
            return 0
        if token_count < 0 or token_n < 0 or position_n < 0 or token_n > MAX_SIDEBAND or \
                position_n > MAX_SIDEBAND or (kind == 7 and token_count > MAX_STATE_IMPORT):
            # The twin walks the same bytes and raises the same error with its message.
            _twin._message_layout(self._pending_object(), self._start, self._start + available, self.width)
        if kind == 7:
            offset += token_count
            if available < offset:
                return offset
            layout.length = offset
            return 0
        layout.token_sideband_count = token_n
        layout.position_sideband_count = position_n
        offset += 4 * (<int64_t>token_n + position_n)
        cdef int64_t rows, wire_bytes
        if source >= 0 and kind != 15 and kind != 16 and kind != 17:
            _activation_sizes(dtype, token_count, self.width, flags, &rows, &wire_bytes)
            layout.activation_rows = rows
            offset += wire_bytes
        if available < offset:
            return offset
        layout.length = offset
        return 0

    def next_message(self):
        """The next complete message, ``NEED_DATA``, or ``END_OF_STREAM`` after EOF.

        Raises:
            WireError: the frame is malformed, or the stream ended inside it.
        """
        cdef Py_ssize_t buffered = self._pending_size()
        if buffered < self._needed or buffered == 0:
            return self._not_ready(self._needed)
        cdef Py_ssize_t needed = self._layout()
        if needed:
            return self._not_ready(needed)
        cdef MessageLayout layout = self._layout_result
        frame = self._commit(layout.length)
        return self._build(frame, &layout)

    cdef object _build(self, bytes frame, MessageLayout *layout):
        cdef const unsigned char *data = <const unsigned char *>PyBytes_AS_STRING(frame)
        cdef int32_t kind = skippy_load_i32(data)
        state = _state_header(data + FRAME_STATE)
        sampling = None
        if layout.sampling_offset >= 0:
            sampling = _sampling(data + layout.sampling_offset)
        tokens = positions = _EMPTY_I32
        activation = None
        raw = b""
        cdef int64_t offset = layout.payload_offset
        cdef cnp.npy_intp dims[1]
        if kind == 7:
            raw = frame[offset:layout.length]
        elif kind != 3:
            if layout.token_sideband_count:
                dims[0] = layout.token_sideband_count
                tokens = _view(frame, data + offset, 1, dims, cnp.NPY_INT32)
                offset += 4 * layout.token_sideband_count
            if layout.position_sideband_count:
                dims[0] = layout.position_sideband_count
                positions = _view(frame, data + offset, 1, dims, cnp.NPY_INT32)
                offset += 4 * layout.position_sideband_count
            if layout.activation_rows >= 0:
                activation = _decode_activation(frame, data + offset, skippy_load_i32(data + FRAME_WIRE_DTYPE),
                                                layout.activation_rows, self.width)
        return _new_object(&_MESSAGE_LAYOUT, (
            _KINDS[kind], skippy_load_i32(data + FRAME_POS_START), skippy_load_i32(data + FRAME_TOKEN_COUNT), state,
            skippy_load_u64(data + FRAME_REQUEST_ID), skippy_load_u64(data + FRAME_SESSION_ID), sampling, self._metadata,
            tokens, positions, activation, raw,
        ))


cdef object _sampling(const unsigned char *data):
    cdef uint32_t count = skippy_load_u32(data + FRAME_SAMPLING_FIXED)
    cdef tuple biases = PyTuple_New(count)
    cdef uint32_t index
    cdef object bias
    for index in range(count):
        bias = _new_object(&_BIAS_LAYOUT, (skippy_load_i32(data + FRAME_SAMPLING_HEAD + FRAME_SAMPLING_BIAS * index),
                                           skippy_load_f32(data + FRAME_SAMPLING_HEAD + 4 + FRAME_SAMPLING_BIAS * index)))
        Py_INCREF(bias)
        PyTuple_SET_ITEM(biases, index, bias)
    return _new_object(&_SAMPLING_LAYOUT, (
        skippy_load_u32(data), skippy_load_u32(data + 4), skippy_load_f32(data + 8),
        skippy_load_f32(data + 12), skippy_load_i32(data + 16), skippy_load_f32(data + 20),
        skippy_load_f32(data + 24), skippy_load_f32(data + 28), skippy_load_f32(data + 32),
        skippy_load_i32(data + 36), biases,
    ))


cdef object _reply_stats(const unsigned char *data):
    """The ReplyStats of the 23 i64 at ``data``."""
    if _STATS_LAYOUT.count != 23:
        return ReplyStats(*[skippy_load_i64(data + 8 * index) for index in range(23)])
    instance = _allocate(_STATS_LAYOUT.cls, 0)
    cdef Py_ssize_t index
    for index in range(23):
        _set_slot(instance, _STATS_LAYOUT.offsets[index], skippy_load_i64(data + 8 * index))
    return instance


cdef tuple _int32_tuple(const unsigned char *data, Py_ssize_t count):
    cdef tuple out = PyTuple_New(count)
    cdef Py_ssize_t index
    cdef object value
    for index in range(count):
        value = skippy_load_i32(data + 4 * index)
        Py_INCREF(value)
        PyTuple_SET_ITEM(out, index, value)
    return out


include "_wire_ext.pxi"


cdef class ReplyDecoder(_FrameDecoder):
    """Incremental :class:`StageReply` decoder (see ``_wire_py.ReplyDecoder``); with
    ``extensions=True`` it also returns ErrorFrame / TimingsFrame (``_wire_ext.pxi``)."""

    cdef public bint extensions

    def __init__(self, *, max_buffer_bytes=MAX_REPLY_FRAME_BYTES + (1 << 20), extensions=False):
        self._max_buffer_bytes = max_buffer_bytes
        self.extensions = extensions

    cdef Py_ssize_t _layout(self) except -1:
        cdef const unsigned char *data = self._pending_data()
        cdef Py_ssize_t available = self._pending_size()
        cdef MessageLayout *layout = &self._layout_result
        if available < 12:
            # Too short to know the size; the twin reports a bad kind from 4 bytes.
            result = _twin._reply_layout(self._pending_object(), self._start, self._start + available)
            return result
        cdef int32_t kind = skippy_load_i32(data)
        cdef int32_t count = skippy_load_i32(data + 8)
        if kind < 1 or kind > 3 or count < 0 or count > MAX_PREDICTED:
            _twin._reply_layout(self._pending_object(), self._start, self._start + available)  # raises
        cdef int64_t offset = 12 + 4 * <int64_t>count + 4
        if available < offset + 4:
            return offset + 4
        cdef int32_t marker = skippy_load_i32(data + offset)
        offset += 4
        layout.draft_offset = -1
        if marker == 1:
            if available < offset + 4:
                return offset + 4
            count = skippy_load_i32(data + offset)
            if count < 0 or count > MAX_PREDICTED:
                _twin._reply_layout(self._pending_object(), self._start, self._start + available)  # raises
            layout.draft_offset = offset
            offset += 4 + 4 * <int64_t>count + 8
        elif marker != 0:
            _twin._reply_layout(self._pending_object(), self._start, self._start + available)  # raises
        offset += STATS_BYTES
        if available < offset:
            return offset
        layout.length = offset
        return 0

    def next_reply(self):
        """The next complete reply, ``NEED_DATA``, or ``END_OF_STREAM`` after EOF.

        Raises:
            WireError: the reply is malformed, or the stream ended inside it.
        """
        cdef Py_ssize_t buffered = self._pending_size()
        if buffered < self._needed or buffered == 0:
            return self._not_ready(self._needed)
        cdef Py_ssize_t needed, length
        if self.extensions and buffered >= 4 and _is_extension_kind(
                skippy_load_i32(self._pending_data())):
            needed = _extension_layout(self._pending_object(), self._start, self._pending_data(),
                                       buffered, &length)
            if needed:
                return self._not_ready(needed)
            return _build_extension(self._commit(length))
        needed = self._layout()
        if needed:
            return self._not_ready(needed)
        cdef MessageLayout layout = self._layout_result
        frame = self._commit(layout.length)
        cdef const unsigned char *data = <const unsigned char *>PyBytes_AS_STRING(frame)
        cdef int32_t count = skippy_load_i32(data + 8)
        draft = None
        cdef int32_t draft_count
        if layout.draft_offset >= 0:
            draft_count = skippy_load_i32(data + layout.draft_offset)
            draft = _new_object(&_DRAFT_LAYOUT, (
                _int32_tuple(data + layout.draft_offset + 4, draft_count),
                skippy_load_i64(data + layout.draft_offset + 4 + 4 * draft_count),
            ))
        stats = _reply_stats(data + layout.length - STATS_BYTES)
        return _new_object(&_REPLY_LAYOUT, (
            _REPLY_KINDS[skippy_load_i32(data)], skippy_load_i32(data + 4),
            _int32_tuple(data + 12, count), skippy_load_i32(data + 12 + 4 * count), draft, stats,
        ))
