"""Join a CUDA toolkit (nvcc, cudart) and NVIDIA's cuBLAS wheel into one CUDA root for CMake.

Strategy: a build host may have nvcc and the CUDA runtime but no cuBLAS (this project's CPU-only
build machines: docs/native-facts §8).  The ``nvidia-cublas`` PyPI wheel carries ``cublas_v2.h``
and ``libcublas.so.13`` / ``libcublasLt.so.13``; CMake's FindCUDAToolkit finds ``CUDA::cublas``
when they sit in the toolkit's ``targets/<arch>/{include,lib}`` with unversioned ``.so`` links.
This script builds such a root out of symlinks (nothing is copied): ``bin`` and ``nvvm`` point at
the toolkit, the include and lib directories hold links to the toolkit's entries and the wheel's.
Point ``CUDACXX`` at ``<out>/bin/nvcc`` and ``CUDAToolkit_ROOT`` at ``<out>``.  The built
``libggml-cuda.so`` links ``libcudart.so.13`` and ``libcublas.so.13`` by soname; at run time they
come from the CUDA host or the NVIDIA wheels the CUDA wheel depends on.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
from pathlib import Path


def _cublas_dir() -> Path:
    """The installed nvidia-cublas wheel's directory (holding include/cublas_v2.h)."""
    for entry in sys.path:
        if not entry:
            continue
        for header in sorted(Path(entry).glob("nvidia/*/include/cublas_v2.h")):
            return header.parent.parent
    raise SystemExit("error: no nvidia-cublas wheel found (pip install 'nvidia-cublas>=13.0,<14')")


def build_root(toolkit: Path, out: Path) -> Path:
    arch = f"{platform.machine()}-linux"
    toolkit_target = toolkit / "targets" / arch
    if not (toolkit / "bin" / "nvcc").exists() or not toolkit_target.is_dir():
        raise SystemExit(f"error: {toolkit} is not a CUDA toolkit (no bin/nvcc or targets/{arch})")
    cublas = _cublas_dir()
    shutil.rmtree(out, ignore_errors=True)
    target = out / "targets" / arch
    for kind in ("include", "lib"):
        (target / kind).mkdir(parents=True)
        for source_dir in (toolkit_target / kind, cublas / kind):
            for entry in sorted(source_dir.iterdir()) if source_dir.is_dir() else []:
                link = target / kind / entry.name
                if not link.exists() and not link.is_symlink():
                    link.symlink_to(entry.resolve())
    for versioned in sorted((target / "lib").glob("lib*.so.*")):
        plain = versioned.with_name(versioned.name.split(".so.")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(versioned.name)
    for name in ("bin", "nvvm"):
        if (toolkit / name).exists():
            (out / name).symlink_to((toolkit / name).resolve())
    (out / "include").symlink_to(Path("targets") / arch / "include")
    (out / "lib64").symlink_to(Path("targets") / arch / "lib")
    if not (target / "lib" / "libcublas.so").exists() or not (target / "include" / "cublas_v2.h").exists():
        raise SystemExit(f"error: {out} lacks libcublas.so or cublas_v2.h (from {cublas})")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="Join a CUDA toolkit and the nvidia-cublas wheel into one root.")
    parser.add_argument("--toolkit", type=Path, default=Path("/usr/local/cuda"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(build_root(args.toolkit.resolve(), args.out.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
