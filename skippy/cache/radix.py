"""Chained page hashes of token sequences, the hot path of prefix-cache lookup and record.

Strategy
--------
Two implementations with one API: ``skippy.cache._radix`` (Cython, the default) and ``skippy.cache._radix_py``
(the typed pure-Python twin, which also documents the hash). This module picks one at import
time; ``SKIPPY_NO_EXTENSIONS=1`` forces the twin, and so does a missing extension, in which case
:data:`EXTENSION_IMPORT_ERROR` says why. :data:`IMPLEMENTATION` names the one in use. Type
checkers always see the twin.

Usage::

    hashes = page_hashes(prompt_tokens, identity.seed, page_size=64)   # uint64[len // 64]
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

#: Why the Cython extension was not used (None when it is, or when the twin was forced).
EXTENSION_IMPORT_ERROR: ImportError | None = None

if TYPE_CHECKING or os.environ.get("SKIPPY_NO_EXTENSIONS") == "1":
    from skippy.cache import _radix_py as _implementation
else:
    try:
        from skippy.cache import _radix as _implementation  # type: ignore[no-redef]
    except ImportError as error:  # extension not built in this checkout: the twin still works
        EXTENSION_IMPORT_ERROR = error
        from skippy.cache import _radix_py as _implementation  # type: ignore[no-redef]

#: ``"cython"`` or ``"python"``: which implementation this process uses.
IMPLEMENTATION: str = _implementation.IMPLEMENTATION
DEFAULT_PAGE_SIZE: int = _implementation.DEFAULT_PAGE_SIZE
MAX_PAGE_SIZE: int = _implementation.MAX_PAGE_SIZE

page_hashes = _implementation.page_hashes
as_tokens = _implementation.as_tokens
mix64 = _implementation.mix64

__all__ = [
    "DEFAULT_PAGE_SIZE", "EXTENSION_IMPORT_ERROR", "IMPLEMENTATION", "MAX_PAGE_SIZE", "as_tokens",
    "mix64", "page_hashes",
]
