# Extension reply frames (Error 0x5E00, Timings 0x5E01, Identity 0x5E02, SamplingAccepted 0x5E03,
# Logprobs 0x5E04): the Cython section matching skippy/codec/_wire_ext_py.py, included by _wire.pyx (one
# module, one build command).  Identity, SamplingAccepted and Logprobs (docs/protocol.md §9, §10)
# are cold frames (one per identity query, one per configure, one per predicted reply of a logprobs
# request): they are decoded and encoded by the twin's own functions, called from here, so one
# implementation serves both and the two cannot disagree.
#
# Strategy: same layouts, same checks, same order as the twin (docs/protocol.md "Extensions").
# Sizes are read with the _byteorder.h loads and checked before use; any check that fails is
# handed to the twin, which raises the identical WireError (as the v11 section does). These
# frames are rare (one error per lane, one small timings frame per reply when negotiated), so the
# dataclasses are built by calling their classes; only the v11 reply path is tuned. Call order:
# ReplyDecoder.next_reply() -> _extension_layout() (only when the decoder accepts extensions and
# the kind is 0x5E00..0x5E02) -> _commit() -> _build_extension().  The Identity frame is sent once
# per probe connection (docs/protocol.md §9), so its layout, build and encode are the twin's own
# functions called from here: one implementation of a cold path, identical by construction.

from skippy.codec import _wire_ext_py as _ext_twin
from skippy.codec.protocol_ext import ErrorCode, ErrorFrame, ExtensionReplyKind, TimingRecord, TimingsFrame

cdef enum:
    ERROR_KIND = 0x5E00
    TIMINGS_KIND = 0x5E01
    IDENTITY_KIND = 0x5E02
    SAMPLING_ACCEPTED_KIND = 0x5E03
    LOGPROBS_KIND = 0x5E04
    MAX_ERROR_CODE = 9
    MAX_ADDRESS = 256
    MAX_ERROR_MESSAGE = 4096
    MAX_RECORDS = 64
    RECORD_BYTES = 48

cdef tuple _ERROR_CODES = tuple(ErrorCode(code) if code in ErrorCode._value2member_map_ else None
                                for code in range(MAX_ERROR_CODE + 1))


cdef inline bint _is_extension_kind(int32_t kind) noexcept:
    return ERROR_KIND <= kind <= LOGPROBS_KIND

encode_sampling_accepted = _ext_twin.encode_sampling_accepted
encode_logprobs = _ext_twin.encode_logprobs


cdef bint _record_valid(const unsigned char *record) noexcept:
    cdef int index
    for index in range(4):
        if skippy_load_i32(record + 4 * index) < 0:
            return False
    for index in range(4):
        if skippy_load_i64(record + 16 + 8 * index) < 0:
            return False
    return skippy_load_i32(record + 8) >= skippy_load_i32(record + 4)


cdef bint _utf8_valid(const unsigned char *data, Py_ssize_t length):
    try:
        (<const char *>data)[:length].decode("utf-8")
    except UnicodeDecodeError:  # reported by the twin with its message
        return False
    return True


cdef Py_ssize_t _extension_layout(object owner, Py_ssize_t start, const unsigned char *data,
                                  Py_ssize_t available, Py_ssize_t *length) except -1:
    """0 with ``length`` set when the frame is complete, else the length needed so far."""
    cdef int32_t kind = skippy_load_i32(data)
    cdef int32_t code, origin, reporter, count
    cdef uint32_t address_n, message_n
    cdef int64_t offset
    cdef Py_ssize_t index
    if kind == IDENTITY_KIND or kind == SAMPLING_ACCEPTED_KIND or kind == LOGPROBS_KIND:  # cold: the twin's layout
        needed = _ext_twin.extension_layout(owner, start, start + available)
        if needed < 0:
            return -needed
        length[0] = needed
        return 0
    if kind == ERROR_KIND:
        if available < 20:
            return 20
        code = skippy_load_i32(data + 4)
        origin = skippy_load_i32(data + 8)
        reporter = skippy_load_i32(data + 12)
        address_n = skippy_load_u32(data + 16)
        if code < 1 or code > MAX_ERROR_CODE or _ERROR_CODES[code] is None or origin < -1 \
                or reporter < -1 or address_n > MAX_ADDRESS:
            _ext_twin.extension_layout(owner, start, start + available)  # raises
        offset = 20 + <int64_t>address_n
        if available < offset + 4:
            return offset + 4
        message_n = skippy_load_u32(data + offset)
        if message_n > MAX_ERROR_MESSAGE:
            _ext_twin.extension_layout(owner, start, start + available)  # raises
        offset += 4 + <int64_t>message_n
        if available < offset:
            return offset
        if not _utf8_valid(data + 20, address_n) or \
                not _utf8_valid(data + offset - message_n, message_n):
            _ext_twin.extension_layout(owner, start, start + available)  # raises
        length[0] = offset
        return 0
    if available < 8:
        return 8
    count = skippy_load_i32(data + 4)
    if count < 0 or count > MAX_RECORDS:
        _ext_twin.extension_layout(owner, start, start + available)  # raises
    offset = 8 + RECORD_BYTES * <int64_t>count
    if available < offset:
        return offset
    for index in range(count):
        if not _record_valid(data + 8 + RECORD_BYTES * index):
            _ext_twin.extension_layout(owner, start, start + available)  # raises
    length[0] = offset
    return 0


cdef object _build_extension(bytes frame):
    cdef const unsigned char *data = <const unsigned char *>PyBytes_AS_STRING(frame)
    cdef uint32_t address_n, message_n
    cdef const unsigned char *record
    cdef int32_t index
    cdef int32_t kind = skippy_load_i32(data)
    if kind == IDENTITY_KIND or kind == SAMPLING_ACCEPTED_KIND or kind == LOGPROBS_KIND:
        return _ext_twin.build_extension(frame)
    if kind == ERROR_KIND:
        address_n = skippy_load_u32(data + 16)
        message_n = skippy_load_u32(data + 20 + address_n)
        return ErrorFrame(
            _ERROR_CODES[skippy_load_i32(data + 4)], skippy_load_i32(data + 8),
            skippy_load_i32(data + 12), (<const char *>data)[20:20 + address_n].decode("utf-8"),
            (<const char *>data)[24 + address_n:24 + address_n + message_n].decode("utf-8"),
        )
    records = []
    for index in range(skippy_load_i32(data + 4)):
        record = data + 8 + RECORD_BYTES * index
        records.append(TimingRecord(
            skippy_load_i32(record), skippy_load_i32(record + 4), skippy_load_i32(record + 8),
            skippy_load_i32(record + 12), skippy_load_i64(record + 16),
            skippy_load_i64(record + 24), skippy_load_i64(record + 32),
            skippy_load_i64(record + 40),
        ))
    return TimingsFrame(tuple(records))


cdef inline bytes _utf8_field(str name, object text, Py_ssize_t limit):
    if type(text) is str:
        try:
            data = (<str>text).encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: the twin raises the WireError
            data = None
        if data is not None and len(<bytes>data) <= limit:
            return <bytes>data
    return _ext_twin._utf8(name, text, limit)  # raises


cdef inline int32_t _stage_index(str name, object value) except? -2:
    cdef int64_t number
    if _is_int(value):
        try:
            number = value
        except OverflowError:  # beyond int64: the twin builds the range error
            number = -2
        if -1 <= number <= 2147483647:
            return <int32_t>number
    return _ext_twin._check_stage_index(name, value)  # raises


def encode_error(error):
    """Encode an Error frame (see ``_wire_ext_py.encode_error``)."""
    code_value = error.code
    if not _is_int(code_value) or not 1 <= code_value <= MAX_ERROR_CODE or \
            _ERROR_CODES[code_value] is None:
        _ext_twin._check_code(code_value)  # raises
    cdef int32_t code = code_value
    cdef int32_t origin = _stage_index("origin_stage_index", error.origin_stage_index)
    cdef int32_t reporter = _stage_index("reporter_stage_index", error.reporter_stage_index)
    cdef bytes address = _utf8_field("address", error.origin_address, MAX_ADDRESS)
    cdef bytes message = _utf8_field("message", error.message, MAX_ERROR_MESSAGE)
    cdef Py_ssize_t address_n = len(address), message_n = len(message)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 24 + address_n + message_n)
    cdef unsigned char *cursor = <unsigned char *>PyBytes_AS_STRING(out)
    skippy_store_i32(cursor, ERROR_KIND)
    skippy_store_i32(cursor + 4, code)
    skippy_store_i32(cursor + 8, origin)
    skippy_store_i32(cursor + 12, reporter)
    skippy_store_u32(cursor + 16, <uint32_t>address_n)
    memcpy(cursor + 20, PyBytes_AS_STRING(address), address_n)
    skippy_store_u32(cursor + 20 + address_n, <uint32_t>message_n)
    memcpy(cursor + 24 + address_n, PyBytes_AS_STRING(message), message_n)
    return out


cdef bint _store_record(unsigned char *cursor, object record):
    """Write ``record``'s 48 bytes; False (nothing trusted) when a value needs the twin's check."""
    cdef int64_t values[8]
    cdef int index
    fields = (record.stage_index, record.layer_start, record.layer_end, record.batch_size,
              record.compute_us, record.forward_write_us, record.downstream_wait_us,
              record.queue_wait_us)
    for index in range(8):
        value = fields[index]
        if not _is_int(value):
            return False
        try:
            values[index] = value
        except OverflowError:  # beyond int64: the twin builds the range error
            return False
        if values[index] < 0 or (index < 4 and values[index] > 2147483647):
            return False
    if values[2] < values[1]:
        return False
    for index in range(4):
        skippy_store_i32(cursor + 4 * index, <int32_t>values[index])
        skippy_store_i64(cursor + 16 + 8 * index, values[4 + index])
    return True


def encode_identity(identity):
    """Encode an Identity frame (the twin's ``encode_identity``; see the header)."""
    return _ext_twin.encode_identity(identity)


def encode_timings(timings):
    """Encode a Timings frame (see ``_wire_ext_py.encode_timings``)."""
    cdef tuple records = tuple(timings.records)
    cdef Py_ssize_t count = len(records), index
    if count > MAX_RECORDS:
        _ext_twin._check_record_count(count)  # raises
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 8 + RECORD_BYTES * count)
    cdef unsigned char *cursor = <unsigned char *>PyBytes_AS_STRING(out)
    skippy_store_i32(cursor, TIMINGS_KIND)
    skippy_store_i32(cursor + 4, <int32_t>count)
    for index in range(count):
        record = records[index]
        if not _store_record(cursor + 8 + RECORD_BYTES * index, record):
            _ext_twin._check_record(index, tuple(  # raises
                getattr(record, name) for name in _ext_twin._RECORD_FIELDS))
    return out
