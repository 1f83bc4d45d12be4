"""llama-cpp-python as the unsplit reference of the tests, running on skippy's own libllama.

Strategy: llama-cpp-python is installed without its native build; it loads whichever
``libllama`` the ``LLAMA_CPP_LIB_PATH`` directory holds, read once at its first import.  We point
it at the package's patched library (``skippy/lib``), so the reference and the stages execute the
same kernels, and check that the library it bound really is ours (it exports the layer-range
symbols; a stock library would silently ignore a layer range).  It comes with the ``test`` extra;
the runtime never imports it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

LIB_DIR = Path(__file__).resolve().parent / "lib"


class ReferenceUnavailable(ImportError):
    """llama-cpp-python is missing or bound to a library other than skippy's."""


def import_llama_cpp() -> ModuleType:
    """Import ``llama_cpp`` bound to skippy's patched libllama and return the module."""
    import skippy.runtime.ffi  # noqa: F401 - registers the backends of a variants build first
    if "llama_cpp" not in sys.modules:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    try:
        import llama_cpp
    except Exception as exc:  # it raises OSError/RuntimeError when no library can be loaded
        raise ReferenceUnavailable(f"cannot import llama_cpp with LLAMA_CPP_LIB_PATH={LIB_DIR}: {exc}") from exc
    low_level = llama_cpp.llama_cpp
    bound = getattr(low_level, "_lib", None)
    if bound is None or not hasattr(bound, "llama_model_stage_layer_start"):
        raise ReferenceUnavailable(
            "llama_cpp is bound to a library without skippy's layer-range patch "
            f"(was it imported before skippy.reference set LLAMA_CPP_LIB_PATH={LIB_DIR}?)"
        )
    return llama_cpp


def load_reference(path: str | os.PathLike[str], *, n_ctx: int = 512, n_batch: int = 512, seed: int = 0,
                   threads: int | None = None) -> object:
    """The whole model as a ``llama_cpp.Llama`` (logits for every row, quiet)."""
    llama_cpp = import_llama_cpp()
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, seed=seed,
        logits_all=True, verbose=False, n_threads=threads or os.cpu_count(),
    )
