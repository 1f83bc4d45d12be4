# Activation kernels, sizes and arrays of skippy.codec._wire (textually included by _wire.pyx, where
# the module docstring describes the codec; the pure-Python twin is _activation_py.py and the
# array half of _wire_py.py).  Kept apart so each source file stays one job.

# ------------------------------------------------------------------------------------------
# Activation kernels (pure C, no Python objects)
# ------------------------------------------------------------------------------------------

cdef extern from "_activation.h":
    # The f16 and q8 encoders and the f16 decoder are C, so the compiler sees branch-free loops
    # it vectorises (the header explains how each stays byte-exact under SSE2).
    void _encode_f16 "skippy_encode_f16" (const uint32_t *source, unsigned char *target,
                                          Py_ssize_t count) noexcept nogil
    void _decode_f16 "skippy_decode_f16" (const unsigned char *source, uint32_t *target,
                                          Py_ssize_t count) noexcept nogil
    void _encode_q8 "skippy_encode_q8" (const float *source, unsigned char *target,
                                        Py_ssize_t rows, Py_ssize_t width) noexcept nogil
    # Picks the AVX2/F16C kernels where the CPU has them (same bytes; see _activation_x86.h).
    int _select_kernels "skippy_activation_select" (int accelerated) noexcept


cdef str _KERNELS = "portable"


def activation_kernels(accelerated=None):
    """The f16/q8 kernels in use: ``"avx2"`` or ``"portable"``.

    ``accelerated=False`` switches to the portable loops and ``True`` back to AVX2/F16C where
    the CPU has it (both write identical bytes; tests compare them). Not thread-safe: switch
    only while no conversion runs. ``SKIPPY_PORTABLE_KERNELS=1`` starts with the portable ones.
    """
    global _KERNELS
    if accelerated is not None:
        _KERNELS = "avx2" if _select_kernels(bool(accelerated)) else "portable"
    return _KERNELS


activation_kernels(_os.environ.get("SKIPPY_PORTABLE_KERNELS") != "1")


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _decode_q8(const unsigned char *source, float *target, Py_ssize_t rows,
                     Py_ssize_t width) noexcept nogil:
    cdef Py_ssize_t row, column
    cdef float scale
    cdef const int8_t *quantized = <const int8_t *>(source + 4 * rows)
    for row in range(rows):
        scale = skippy_load_f32(source + 4 * row)
        for column in range(width):
            target[row * width + column] = <float>quantized[row * width + column] * scale


# ------------------------------------------------------------------------------------------
# Sizes and arrays
# ------------------------------------------------------------------------------------------

cdef int _activation_sizes(int dtype, int64_t token_count, int64_t width, int64_t flags,
                           int64_t *rows, int64_t *wire_bytes) except -1:
    """(rows, wire bytes) with the §2.6 checks; errors are built by the twin (same text)."""
    cdef int64_t multiplier = 4 if flags & 128 else (2 if flags & (256 | 64) else 1)
    if flags & 32768:  # docs/protocol.md §12: boundary rows (the twin validates the field)
        multiplier = _twin.boundary_rows(flags)
    cdef int64_t elements
    if token_count < 0 or width < 0 or (width > 0 and token_count * multiplier >
                                        (<int64_t>1 << 40) // width):
        _twin._activation_sizes(dtype, token_count, width, flags)  # raises
    rows[0] = token_count * multiplier
    elements = rows[0] * width
    wire_bytes[0] = elements * 4 if dtype == 0 else (elements * 2 if dtype == 1 else
                                                      rows[0] * 4 + elements)
    if wire_bytes[0] > MAX_ACTIVATION or (wire_bytes[0] > 0 and elements * 4 > MAX_DECODED):
        _twin._activation_sizes(dtype, token_count, width, flags)  # raises
    return 0


cdef object _view(object owner, const unsigned char *data, int nd, cnp.npy_intp *dims,
                  int typenum):
    """A read-only numpy view of ``data`` kept alive by ``owner``; a copy if unaligned."""
    cdef object array
    cdef Py_ssize_t count = dims[0] if nd == 1 else dims[0] * dims[1]
    if (<uintptr_t>data) & 3u:
        array = cnp.PyArray_SimpleNew(nd, dims, typenum)
        memcpy(cnp.PyArray_DATA(array), data, count * 4)
    else:
        array = cnp.PyArray_SimpleNewFromData(nd, dims, typenum, <void *>data)
        cnp.set_array_base(array, owner)
    cnp.PyArray_CLEARFLAGS(array, cnp.NPY_ARRAY_WRITEABLE)
    return array


cdef void _dequantize(const unsigned char *data, int dtype, void *target, Py_ssize_t rows,
                      Py_ssize_t width) noexcept nogil:
    if dtype == 1:
        _decode_f16(data, <uint32_t *>target, rows * width)
    else:
        _decode_q8(data, <float *>target, rows, width)


cdef object _decode_activation(object owner, const unsigned char *data, int dtype,
                               Py_ssize_t rows, Py_ssize_t width):
    cdef cnp.npy_intp dims[2]
    dims[0] = rows
    dims[1] = width
    if dtype == 0:
        return _view(owner, data, 2, dims, cnp.NPY_FLOAT32)
    cdef object array = cnp.PyArray_SimpleNew(2, dims, cnp.NPY_FLOAT32)
    cdef void *target = cnp.PyArray_DATA(array)
    if rows * width < NOGIL_ELEMENTS:
        _dequantize(data, dtype, target, rows, width)
    else:
        with nogil:
            _dequantize(data, dtype, target, rows, width)
    return array


cdef inline bint _is_array(object value, int typenum, int nd):
    return (cnp.PyArray_Check(value) and cnp.PyArray_TYPE(value) == typenum
            and cnp.PyArray_NDIM(value) == nd and cnp.PyArray_IS_C_CONTIGUOUS(value))


def int32_sideband(data, Py_ssize_t offset, Py_ssize_t count):
    """``count`` i32 values of ``data`` at ``offset``: a read-only view, or a copy if unaligned."""
    if count == 0:
        return _EMPTY_I32
    if not isinstance(data, bytes) or offset < 0 or count < 0 or offset + 4 * count > len(data):
        return _twin.int32_sideband(data, offset, count)
    cdef cnp.npy_intp dims[1]
    dims[0] = count
    return _view(data, <const unsigned char *>PyBytes_AS_STRING(data) + offset, 1, dims,
                 cnp.NPY_INT32)


def encode_activation(values, wire_dtype):
    """Encode a float32 ``(rows, width)`` activation (see ``_wire_py.encode_activation``)."""
    cdef int dtype = _check_dtype(wire_dtype)
    array = values if _is_array(values, cnp.NPY_FLOAT32, 2) else _twin._float32_rows(values)
    cdef int64_t rows_checked, wire_bytes
    cdef Py_ssize_t rows = cnp.PyArray_DIMS(array)[0], width = cnp.PyArray_DIMS(array)[1]
    _activation_sizes(dtype, rows, width, 0, &rows_checked, &wire_bytes)
    out = PyBytes_FromStringAndSize(NULL, wire_bytes)
    _write_activation(array, dtype, rows, width, <unsigned char *>PyBytes_AS_STRING(out))
    return out


cdef void _quantize(const void *source, int dtype, unsigned char *target, Py_ssize_t rows,
                    Py_ssize_t width) noexcept nogil:
    if dtype == 0:
        memcpy(target, source, rows * width * 4)
    elif dtype == 1:
        _encode_f16(<const uint32_t *>source, target, rows * width)
    else:
        _encode_q8(<const float *>source, target, rows, width)


cdef void _write_activation(object array, int dtype, Py_ssize_t rows, Py_ssize_t width,
                            unsigned char *target) noexcept:
    cdef const void *source = cnp.PyArray_DATA(array)
    if rows * width < NOGIL_ELEMENTS:
        _quantize(source, dtype, target, rows, width)
    else:
        with nogil:
            _quantize(source, dtype, target, rows, width)


def decode_activation(data, wire_dtype, Py_ssize_t rows, Py_ssize_t width,
                      Py_ssize_t offset=0):
    """Decode an activation segment to float32 ``(rows, width)`` (see the twin)."""
    cdef int dtype = _check_dtype(wire_dtype)
    cdef int64_t rows_checked, wire_bytes
    _activation_sizes(dtype, rows, width, 0, &rows_checked, &wire_bytes)
    if not isinstance(data, bytes) or offset < 0 or len(data) - offset < wire_bytes:
        return _twin.decode_activation(data, wire_dtype, rows, width, offset)
    return _decode_activation(data, <const unsigned char *>PyBytes_AS_STRING(data) + offset,
                              dtype, rows, width)
