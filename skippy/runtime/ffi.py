"""Import point for the compiled binding: checks it is the build this code expects.

Strategy: ``skippy._llama`` is a cffi API-mode module linked against our patched ``libllama``.
Importing it proves the patched symbols exist (the loader resolves them).  Two stamps must then
agree: the layer-range ABI revision reported by the library, and the binding stamp compiled into the
module against the one the build wrote next to it.  Any mismatch is an ImportError naming both
values.  The llama.cpp backend is initialised and its logging routed to Python once, here; in a
wheel built with every CPU variant the best variant for this CPU (and any GPU backend) is loaded
first (:mod:`skippy.runtime.backends`).
"""

from __future__ import annotations

from pathlib import Path

from skippy.runtime import backends as _backends
from skippy.runtime.errors import BindingMismatch

_LIB_DIR = Path(__file__).resolve().parent.parent / "lib"
_backends.preload(_LIB_DIR)  # a CUDA build's runtime libraries, from NVIDIA's wheels

#: Revision of the layer-range C API this Python code is written against.
STAGE_ABI_VERSION = 3

try:
    from skippy._llama import ffi, lib  # type: ignore[import-not-found]  # cffi-compiled, no stub
except ImportError as exc:  # the extension is missing or libllama lacks our symbols
    raise BindingMismatch(
        f"cannot load skippy._llama ({exc}); build it with `pip install -e .` or `make build`"
    ) from exc

from skippy import _native_stamp  # noqa: E402 - written by the same build as skippy._llama

_compiled = ffi.string(lib.skippy_binding_stamp).decode()
if _compiled != _native_stamp.BINDING_STAMP:
    raise BindingMismatch(
        f"skippy._llama was built with binding stamp {_compiled}, but the package expects "
        f"{_native_stamp.BINDING_STAMP}; rebuild (pip install -e . / make build)"
    )
if lib.llama_stage_abi_version() != STAGE_ABI_VERSION or lib.LLAMA_STAGE_ABI_VERSION != STAGE_ABI_VERSION:
    raise BindingMismatch(
        f"libllama layer-range ABI {lib.llama_stage_abi_version()} (compiled against "
        f"{lib.LLAMA_STAGE_ABI_VERSION}), this code needs {STAGE_ABI_VERSION}"
    )

from skippy.runtime import _callbacks  # noqa: E402,F401 - registers the extern "Python" callbacks

_callbacks.install_log_handler()

#: The backend modules loaded for a variants build (skippy.runtime.backends); None when linked in.
BACKENDS = _backends.load_backends(lib, ffi, _LIB_DIR)
lib.llama_backend_init()

__all__ = ["ffi", "lib", "BACKENDS", "STAGE_ABI_VERSION"]
