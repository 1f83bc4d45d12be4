"""Load ggml's backend modules of a wheel build: the best CPU variant this CPU runs, and GPU backends.

Strategy: a build with ``SKIPPY_CPU_VARIANTS=all`` (native/build.py; the wheels) ships the CPU
backend as one module per instruction-set level (``libggml-cpu-<variant>.so``: x64, sse42, ...,
haswell, skylakex, icelake, zen4, sapphirerapids) and other backends (``libggml-cuda.so``) as
modules too; nothing is registered until they are loaded.  Each CPU module exports
``ggml_backend_score``: 0 when this CPU lacks an instruction it needs, else higher for a richer
level.  :func:`load_backends` scores every module (a plain ``dlopen``, nothing registered), loads
the best one with ``ggml_backend_load`` and then any GPU backend; a GPU backend whose runtime
libraries or driver are missing is skipped with a warning, so a CUDA wheel on a CPU-only host runs
on the CPU.  A build with the CPU backend linked in (``make build``) has no modules: nothing to do.

Variants can be wrong on a host, as much as slow: stock llama-cpp-python 0.3.36 built natively on
an AMX/AVX-512 host segfaults in ``llama_decode`` on Gemma 3 270M for any multi-token batch (issue
15).  :data:`UNTRUSTED` variants are therefore never chosen by score; ``SKIPPY_CPU_VARIANT=<name>``
picks one explicitly (any variant, for measuring), and ``python -m skippy.runtime.backends``
lists the variants with their scores and the one chosen.  ``bench/cpu_variants.py`` measures
each variant this host runs and checks split = unsplit on it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any, Final

__all__ = ["UNTRUSTED", "BackendChoice", "CpuVariant", "cpu_variants", "load_backends", "preload"]

log = logging.getLogger("skippy.runtime.backends")

#: Variants never chosen by score, with the reason (SKIPPY_CPU_VARIANT still selects them).
UNTRUSTED: Final[dict[str, str]] = {
    "sapphirerapids": "AMX: the native AMX/AVX-512 build segfaults in llama_decode on Gemma 3 270M "
                      "multi-token batches (issue 15); not verified",
}

#: Environment variable naming the CPU variant to load.
VARIANT_ENV: Final = "SKIPPY_CPU_VARIANT"
_PREFIX: Final = "libggml-cpu-"


@dataclasses.dataclass(frozen=True, slots=True)
class CpuVariant:
    name: str
    path: Path
    #: ggml_backend_score: 0 = this CPU cannot run it.
    score: int


@dataclasses.dataclass(frozen=True, slots=True)
class BackendChoice:
    """What :func:`load_backends` loaded."""

    cpu: CpuVariant
    #: GPU backend modules loaded (file names), and those skipped with the reason.
    loaded: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()


def cpu_variants(lib_dir: Path) -> list[CpuVariant]:
    """The CPU variant modules in ``lib_dir`` with their scores on this CPU (empty: not a variants build)."""
    found = []
    for path in sorted(lib_dir.glob(f"{_PREFIX}*.so")):
        module = ctypes.CDLL(str(path))
        score_function = getattr(module, "ggml_backend_score", None)
        score = 0
        if score_function is not None:
            score_function.restype = ctypes.c_int
            score = int(score_function())
        found.append(CpuVariant(path.name[len(_PREFIX):-len(".so")], path, score))
    return found


def _choose(variants: list[CpuVariant], wanted: str | None) -> CpuVariant:
    if wanted:
        named = {variant.name: variant for variant in variants}
        if wanted not in named:
            raise ImportError(f"{VARIANT_ENV}={wanted}: no such CPU variant (have: {', '.join(named)})")
        if named[wanted].score == 0:
            raise ImportError(f"{VARIANT_ENV}={wanted}: this CPU lacks instructions that variant needs "
                              f"(runnable: {', '.join(v.name for v in variants if v.score)})")
        return named[wanted]
    usable = [variant for variant in variants if variant.score > 0 and variant.name not in UNTRUSTED]
    if not usable:
        raise ImportError(f"no CPU variant in {variants[0].path.parent} runs on this CPU")
    return max(usable, key=lambda variant: variant.score)


#: The CUDA libraries libggml-cuda.so links, in load order; the CUDA wheel takes them from NVIDIA's
#: PyPI wheels (nvidia-cuda-runtime, nvidia-cublas), which install them under site-packages/nvidia/.
CUDA_LIBRARIES: Final = ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13")


def _preload_cuda_runtime() -> list[str]:
    """Load the CUDA runtime libraries from NVIDIA's wheels (RTLD_GLOBAL), so libggml-cuda.so finds
    them by soname; returns the paths loaded.  A CUDA host's own libraries (ld.so's search path) serve
    when the wheels are absent."""
    loaded = []
    for name in CUDA_LIBRARIES:
        for entry in sys.path:
            candidates = sorted(Path(entry or ".").glob(f"nvidia/*/lib/{name}")) if entry else []
            for candidate in candidates:
                try:
                    ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
                loaded.append(str(candidate))
                break
            else:
                continue
            break
    return loaded


def preload(lib_dir: Path) -> list[str]:
    """Before ``skippy._llama`` loads: a CUDA build's libggml-cuda.so (linked in, or a module) needs the
    CUDA runtime libraries, which the CUDA wheel takes from NVIDIA's wheels; load them (returns the
    paths; none for a CPU build)."""
    return _preload_cuda_runtime() if (lib_dir / "libggml-cuda.so").exists() else []


def load_backends(lib: Any, ffi: Any, lib_dir: Path) -> BackendChoice | None:
    """Register the backends of a variants build (None: the CPU backend is linked in, nothing to do).

    Raises:
        ImportError: no CPU variant runs here, or ``SKIPPY_CPU_VARIANT`` names a bad one.
    """
    variants = cpu_variants(lib_dir)
    if not variants:
        return None
    chosen = _choose(variants, os.environ.get(VARIANT_ENV) or None)
    if lib.ggml_backend_load(str(chosen.path).encode()) == ffi.NULL:
        raise ImportError(f"ggml could not load the CPU backend {chosen.path}")
    loaded, skipped = [], []
    others = [path for path in sorted(lib_dir.glob("libggml-*.so"))
              if not path.name.startswith(_PREFIX) and path.name not in ("libggml-base.so",)]
    for path in others:
        try:
            ctypes.CDLL(str(path))  # a missing runtime library shows up here with its name
        except OSError as exc:
            skipped.append((path.name, str(exc)))
            log.warning("%s not loaded (%s): running without it", path.name, exc)
            continue
        if lib.ggml_backend_load(str(path).encode()) == ffi.NULL:
            skipped.append((path.name, "ggml_backend_load failed"))
            log.warning("%s not loaded (ggml_backend_load failed): running without it", path.name)
        else:
            loaded.append(path.name)
    return BackendChoice(chosen, tuple(loaded), tuple(skipped))


def main() -> int:
    """``python -m skippy.runtime.backends``: the variants, their scores here, and the choice."""
    from skippy.runtime import ffi as binding
    from skippy.runtime.offload import devices

    lib_dir = Path(binding.__file__).resolve().parent.parent / "lib"
    for variant in cpu_variants(lib_dir):
        note = f"  (not chosen by score: {UNTRUSTED[variant.name]})" if variant.name in UNTRUSTED else ""
        print(f"{variant.name:16} score {variant.score:4}{note}")
    choice = binding.BACKENDS
    print("chosen CPU variant:", choice.cpu.name if choice else "none (CPU backend linked in)")
    for name, reason in (choice.skipped if choice else ()):
        print(f"skipped {name}: {reason}")
    for device in devices():
        print(f"device {device.name}: {device.description} ({device.kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
