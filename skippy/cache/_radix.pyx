# cython: language_level=3, embedsignature=True, cdivision=True, initializedcheck=False
# distutils: language = c
"""Cython hot path of the chained page hash; the API and semantics of ``skippy.cache._radix_py``.

Strategy
--------
The hash ("skippy page hash v1") is defined in the twin's module header: a splitmix64-finaliser
sponge over little-endian token pairs, chained across pages and seeded by the cache identity.
Here the loop runs in C over a typed int32 memoryview, without the GIL; one page of 64 tokens is
32 dependent mixes. Argument checking and conversion of unusual inputs (lists, byte buffers,
other integer dtypes) reuse the twin's helpers, so both implementations accept and refuse the
same inputs with the same errors.
"""

cimport cython
from libc.stdint cimport int32_t, uint32_t, uint64_t

import numpy as np

from skippy.cache import _radix_py as _twin

IMPLEMENTATION = "cython"
DEFAULT_PAGE_SIZE = _twin.DEFAULT_PAGE_SIZE
MAX_PAGE_SIZE = _twin.MAX_PAGE_SIZE
as_tokens = _twin.as_tokens
mix64 = _twin.mix64
initial_state = _twin.initial_state


cdef inline uint64_t _mix(uint64_t value) noexcept nogil:
    value ^= value >> 30
    value *= <uint64_t>0xBF58476D1CE4E5B9ULL
    value ^= value >> 27
    value *= <uint64_t>0x94D049BB133111EBULL
    return value ^ (value >> 31)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _chain(const int32_t[::1] tokens, Py_ssize_t n_pages, Py_ssize_t page_size,
                 uint64_t state, uint64_t[::1] out) noexcept nogil:
    cdef Py_ssize_t page, index, base
    cdef uint64_t word
    for page in range(n_pages):
        base = page * page_size
        index = 0
        while index + 1 < page_size:
            word = (<uint64_t><uint32_t>tokens[base + index]) | (
                (<uint64_t><uint32_t>tokens[base + index + 1]) << 32)
            state = _mix(state ^ word)
            index += 2
        if index < page_size:  # odd page size: the last token's partner is 0
            state = _mix(state ^ (<uint64_t><uint32_t>tokens[base + index]))
        out[page] = state


def page_hashes(tokens, seed=0, page_size=DEFAULT_PAGE_SIZE):
    """Chained hashes of the full pages of ``tokens`` (see ``skippy.cache._radix_py.page_hashes``)."""
    cdef Py_ssize_t size = _twin.check_page_size(page_size)
    cdef uint64_t state = _twin.initial_state(_twin.check_seed(seed), size)
    array = _twin.as_tokens(tokens)
    cdef Py_ssize_t n_pages = array.shape[0] // size
    out = np.zeros(n_pages, dtype=np.uint64)
    if n_pages == 0:
        return out
    cdef const int32_t[::1] view = array
    cdef uint64_t[::1] result = out
    with nogil:
        _chain(view, n_pages, size, state, result)
    return out
