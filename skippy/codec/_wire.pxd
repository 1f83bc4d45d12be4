# Declarations shared by skippy/codec/_wire.pyx: the byte-order header and the decoder types.
#
# Call order for a decoder (both kinds):
#   receive_data(chunk)*  ->  next_message() / next_reply() until NEED_DATA  ->  ...
#   receive_data(b"")     ->  next_*() until END_OF_STREAM (or WireError if a frame was cut).
# _layout() only reads the uncommitted bytes (_pending_data/_pending_size: the received bytes chunk
# when one is held, else the bytearray); _commit() hands out exactly one frame (the chunk itself
# when the frame is all of it, else a copy) and advances _start; _build() turns that committed
# frame into Python objects.

from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t


cdef extern from "_byteorder.h":
    int SKIPPY_HOST_LITTLE_ENDIAN
    uint16_t skippy_load_u16(const unsigned char *p) noexcept nogil
    uint32_t skippy_load_u32(const unsigned char *p) noexcept nogil
    int32_t skippy_load_i32(const unsigned char *p) noexcept nogil
    uint64_t skippy_load_u64(const unsigned char *p) noexcept nogil
    int64_t skippy_load_i64(const unsigned char *p) noexcept nogil
    float skippy_load_f32(const unsigned char *p) noexcept nogil
    void skippy_store_u16(unsigned char *p, uint16_t v) noexcept nogil
    void skippy_store_u32(unsigned char *p, uint32_t v) noexcept nogil
    void skippy_store_i32(unsigned char *p, int32_t v) noexcept nogil
    void skippy_store_u64(unsigned char *p, uint64_t v) noexcept nogil
    void skippy_store_i64(unsigned char *p, int64_t v) noexcept nogil
    void skippy_store_f32(unsigned char *p, float v) noexcept nogil


# Where the sections of one message frame lie, relative to the frame start (see _layout).
cdef struct MessageLayout:
    int64_t length
    int64_t sampling_offset        # -1: no sampling section
    int64_t payload_offset         # tokens (or StateImport raw bytes)
    int64_t token_sideband_count
    int64_t position_sideband_count
    int64_t activation_rows        # -1: the frame carries no activation
    int64_t activation_width
    int64_t draft_offset           # replies only: -1 when no native MTP draft


cdef class _FrameDecoder:
    cdef bytearray _buffer
    cdef bytes _chunk               # a received bytes object parsed in place, or None
    cdef Py_ssize_t _start
    cdef Py_ssize_t _needed
    cdef bint _closed
    cdef Py_ssize_t _max_buffer_bytes
    cdef MessageLayout _layout_result
    cdef object _metadata          # decoded chat metadata of the pending frame, or None

    cdef const unsigned char *_pending_data(self) noexcept
    cdef Py_ssize_t _pending_size(self) noexcept
    cdef object _pending_object(self)
    cdef object _not_ready(self, Py_ssize_t needed)
    cdef bytes _commit(self, Py_ssize_t length)
