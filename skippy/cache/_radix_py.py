"""Chained page hashes of a token sequence: the typed pure-Python twin of ``skippy.cache._radix``.

Strategy
--------
A prompt is cut into pages of ``page_size`` tokens; the hash of page ``k`` covers pages ``0..k``
and a 64-bit seed (the cache identity, :mod:`skippy.cache.identity`), so two prompts share page
hash ``k`` exactly when they share their first ``k + 1`` pages (up to 64-bit collisions, which the
prefix tree rules out by comparing the page's tokens). Only full pages get a hash.

The hash ("skippy page hash v1") is defined on 64-bit words, all arithmetic modulo 2**64:

* ``mix(x)`` is the splitmix64 finaliser (Stafford's variant 13), a bijection of 64-bit words
  with full avalanche::

      x ^= x >> 30; x *= 0xBF58476D1CE4E5B9
      x ^= x >> 27; x *= 0x94D049BB133111EB
      x ^= x >> 31

* the state starts at ``mix(seed ^ (page_size * 0x9E3779B97F4A7C15))``, so caches with different
  page sizes never share hashes;
* each page is read as ``ceil(page_size / 2)`` words, word ``j`` being the little-endian pair
  ``u32(token[2j]) | u32(token[2j + 1]) << 32`` (a missing odd partner is 0; the page length is
  fixed, so this is unambiguous), and absorbed one word at a time: ``state = mix(state ^ word)``;
* the hash of page ``k`` is the state after absorbing pages ``0..k``.

``mix`` being a bijection makes each step injective in its word, so two sequences that agree up
to a page and then differ in one token get different states from there on with certainty for that
page and with probability ``1 - 2**-64`` for every later one. The Cython module runs the same
loop in C (a few ns per token); this twin does it with Python integers over the words that numpy
packs, and both are checked against each other in ``tests/test_radix.py``.
"""

from __future__ import annotations

from typing import Final, Union

import numpy as np
import numpy.typing as npt

IMPLEMENTATION: Final = "python"

#: Default tokens per page.
DEFAULT_PAGE_SIZE: Final = 64
#: Largest accepted page size (a page is one radix-tree edge; bigger pages make no sense).
MAX_PAGE_SIZE: Final = 1 << 16

MASK64: Final = (1 << 64) - 1
GOLDEN64: Final = 0x9E3779B97F4A7C15
_MUL1: Final = 0xBF58476D1CE4E5B9
_MUL2: Final = 0x94D049BB133111EB

TokenInput = Union[npt.NDArray[np.integer], bytes, bytearray, memoryview, "list[int]", "tuple[int, ...]"]
HashArray = npt.NDArray[np.uint64]
TokenArray = npt.NDArray[np.int32]


def mix64(value: int) -> int:
    """The splitmix64 finaliser of a 64-bit word (see the module header)."""
    value &= MASK64
    value ^= value >> 30
    value = (value * _MUL1) & MASK64
    value ^= value >> 27
    value = (value * _MUL2) & MASK64
    return value ^ (value >> 31)


def initial_state(seed: int, page_size: int) -> int:
    """The chain state before the first page."""
    return mix64((seed & MASK64) ^ ((page_size * GOLDEN64) & MASK64))


def check_page_size(page_size: int) -> int:
    """Validate a page size.

    Raises:
        ValueError: not an integer in ``1..MAX_PAGE_SIZE``.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
        raise ValueError(f"page size must be an integer, got {page_size!r}")
    if not 1 <= int(page_size) <= MAX_PAGE_SIZE:
        raise ValueError(f"page size must be in 1..{MAX_PAGE_SIZE}, got {page_size}")
    return int(page_size)


def check_seed(seed: int) -> int:
    """Validate a 64-bit seed.

    Raises:
        ValueError: not an integer in ``0..2**64-1``.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not 0 <= int(seed) <= MASK64:
        raise ValueError(f"seed must fit in 64 unsigned bits, got {seed}")
    return int(seed)


def as_tokens(tokens: TokenInput) -> TokenArray:
    """A C-contiguous int32 view (or copy) of ``tokens``.

    Accepts a numpy integer array (1-D), a buffer of 4-byte signed items (``array('i')``, an int32
    memoryview), a raw bytes-like object holding little-endian int32 values, or a sequence of
    Python ints.

    Raises:
        ValueError: not 1-D, a byte buffer whose length is not a multiple of 4, or a value
            outside the int32 range.
    """
    array: npt.NDArray[np.generic]
    if isinstance(tokens, np.ndarray):
        array = tokens
    elif isinstance(tokens, (list, tuple)):
        array = np.asarray(tokens, dtype=np.int64) if tokens else np.zeros(0, dtype=np.int32)
    else:
        try:
            view = memoryview(tokens)
        except TypeError:  # not a buffer: any other sequence of ints
            array = np.asarray(tokens)
        else:
            if view.itemsize == 1 and view.format in ("B", "b", "c"):
                if view.nbytes % 4:
                    raise ValueError(f"a token byte buffer must hold whole int32 values ({view.nbytes} bytes)")
                raw = view if view.c_contiguous else view.tobytes()
                return np.frombuffer(raw, dtype="<i4").astype(np.int32, copy=False)
            array = np.asarray(view)
    if array.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {array.shape}")
    if array.dtype == np.int32:
        return np.ascontiguousarray(array)
    if array.size == 0:
        return np.zeros(0, dtype=np.int32)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    if int(array.min()) < -(1 << 31) or int(array.max()) >= (1 << 31):
        raise ValueError("token ids must fit in int32")
    return np.ascontiguousarray(array, dtype=np.int32)


def _page_words(tokens: TokenArray, n_pages: int, page_size: int) -> npt.NDArray[np.uint64]:
    """``n_pages x ceil(page_size/2)`` little-endian token pairs (zero-padded odd pages)."""
    pages = tokens[: n_pages * page_size].reshape(n_pages, page_size).astype("<u4")
    if page_size % 2:
        pages = np.concatenate([pages, np.zeros((n_pages, 1), dtype="<u4")], axis=1)
    low = pages[:, 0::2].astype(np.uint64)
    high = pages[:, 1::2].astype(np.uint64)
    return low | (high << np.uint64(32))


def page_hashes(tokens: TokenInput, seed: int = 0, page_size: int = DEFAULT_PAGE_SIZE) -> HashArray:
    """Chained hashes of the full pages of ``tokens``.

    Args:
        tokens: token ids (see :func:`as_tokens`).
        seed: 64-bit cache identity seed.
        page_size: tokens per page.

    Returns:
        ``len(tokens) // page_size`` uint64 hashes; entry ``k`` covers pages ``0..k`` and the seed.

    Raises:
        ValueError: bad tokens, seed or page size.
    """
    page_size = check_page_size(page_size)
    array = as_tokens(tokens)
    state = initial_state(check_seed(seed), page_size)
    n_pages = array.shape[0] // page_size
    out = np.zeros(n_pages, dtype=np.uint64)
    if n_pages == 0:
        return out
    words = _page_words(array, n_pages, page_size)
    for page in range(n_pages):
        for word in words[page].tolist():
            state ^= word
            state ^= state >> 30
            state = (state * _MUL1) & MASK64
            state ^= state >> 27
            state = (state * _MUL2) & MASK64
            state ^= state >> 31
        out[page] = state
    return out
