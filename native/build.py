"""Build the patched llama.cpp shared libraries that skippy drives.

Strategy: the llama.cpp source is the tree vendored in the pinned llama-cpp-python sdist on PyPI
(downloaded once into ``build/downloads`` and checked against its sha256), or a local tree named by
``SKIPPY_LLAMA_SRC``.  It is copied to ``build/llama-src-<pin>-<patch digest>``, our patch series from
``native/patches`` is applied with ``git apply`` (or ``patch``), and CMake configures an out-of-tree
Ninja build in ``build/native-<platform>`` (ccache when present, extra flags from
``SKIPPY_CMAKE_ARGS``).  Only the ``llama`` target is built.  The resulting ``libllama`` and
``libggml*`` libraries are copied into the package (``skippy/lib``) with an ``$ORIGIN`` rpath so a
wheel is self-contained.

CPU kernels: by default one portable ``libggml-cpu`` (AVX2 level, linked in), which is what
``make build`` / ``make test`` use.  ``SKIPPY_CPU_VARIANTS=all`` (the wheel builds) turns on
ggml's dynamic backends (``GGML_BACKEND_DL``) with every x86 CPU variant
(``GGML_CPU_ALL_VARIANTS``): ``libggml-cpu-<variant>.so`` modules from plain x86-64 up to AMX, of
which ``skippy.runtime.backends`` loads the best one this CPU runs at import time.  That build
compiles the CPU backend 14 times (several minutes more on 2 cores), hence only for wheels.  In
that mode other backends (CUDA) are modules too, loaded when their runtime libraries are there.  Every step is skipped when its inputs have not changed, so an unchanged
rebuild is a Ninja no-op plus a few file comparisons.

Run directly with ``python native/build.py`` (setup.py calls :func:`build_native`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
PATCHES = NATIVE / "patches"
BUILD = ROOT / "build"
PACKAGE_LIB = ROOT / "skippy" / "lib"

#: The pinned llama-cpp-python release whose vendored llama.cpp we patch.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/ec/e9/"
    "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/" + SDIST_NAME
)
#: sha256 published by PyPI for the sdist above.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

#: Vocab-only GGUFs copied into the package for generated test/demo models (real tokenizers).
VOCAB_FILES = ("ggml-vocab-llama-spm.gguf", "ggml-vocab-llama-bpe.gguf", "ggml-vocab-qwen2.gguf")

BASE_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_BLAS=OFF",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    # Unversioned sonames: the package ships exactly one file per library, found by name.
    "-DCMAKE_PLATFORM_NO_VERSIONED_SONAME=ON",
]


class NativeBuildError(RuntimeError):
    """The native build could not be completed; the message says which step failed."""


def _log(message: str) -> None:
    print(f"[skippy native] {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def patch_series() -> list[Path]:
    """The patch files, in application order (sorted by name)."""
    return sorted(PATCHES.glob("*.patch"))


def patch_digest() -> str:
    digest = hashlib.sha256()
    for patch in patch_series():
        digest.update(patch.name.encode())
        digest.update(patch.read_bytes())
    return digest.hexdigest()[:12]


def fetch_sdist() -> Path:
    """Download the pinned sdist (once) and verify its sha256."""
    downloads = BUILD / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    target = downloads / SDIST_NAME
    if not target.exists():
        _log(f"downloading {SDIST_URL}")
        partial = target.with_suffix(".part")
        with urllib.request.urlopen(SDIST_URL, timeout=120) as response, partial.open("wb") as out:
            shutil.copyfileobj(response, out)
        partial.rename(target)
    actual = _sha256(target)
    if actual != SDIST_SHA256:
        target.unlink()
        raise NativeBuildError(
            f"{SDIST_NAME}: sha256 {actual} does not match the pinned {SDIST_SHA256}; "
            "the download was removed, run the build again"
        )
    return target


def _pristine_source() -> Path:
    """A pristine llama.cpp tree: SKIPPY_LLAMA_SRC or the sdist's vendored copy."""
    local = os.environ.get("SKIPPY_LLAMA_SRC")
    if local:
        path = Path(local).resolve()
        if not (path / "include" / "llama.h").exists():
            raise NativeBuildError(f"SKIPPY_LLAMA_SRC={local} does not look like a llama.cpp tree (no include/llama.h)")
        return path
    extracted = BUILD / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
    vendored = extracted / "vendor" / "llama.cpp"
    if not (vendored / "include" / "llama.h").exists():
        sdist = fetch_sdist()
        _log(f"extracting {sdist.name}")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        tmp = extracted.with_name(extracted.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = "vendor/llama.cpp/" + member.name[len(prefix):]
            archive.extractall(tmp, members=members, filter="data")
        shutil.rmtree(extracted, ignore_errors=True)
        tmp.rename(extracted)
    return vendored


def patched_source() -> Path:
    """Copy the pristine tree and apply our patch series; reused while the patches are unchanged."""
    pristine = _pristine_source()
    target = BUILD / "llama-src"
    stamp = target / ".skippy-patched"
    wanted = f"{pristine.resolve()}\n{patch_digest()}\n"  # resolved: worktrees sharing a tree agree
    if stamp.exists() and stamp.read_text() == wanted:
        return target
    _log(f"preparing patched source in {target}")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(pristine, target, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    for patch in patch_series():
        _log(f"applying {patch.name}")
        result = subprocess.run(
            ["patch", "-p1", "--forward", "--batch", "-i", str(patch)],
            cwd=target, capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise NativeBuildError(f"patch {patch.name} does not apply:\n{result.stdout}{result.stderr}")
    stamp.write_text(wanted)
    return target


def cpu_variants() -> bool:
    """Whether this build makes every CPU variant as a loadable module (``SKIPPY_CPU_VARIANTS=all``)."""
    value = os.environ.get("SKIPPY_CPU_VARIANTS", "").strip().lower()
    if value not in ("", "all", "off"):
        raise NativeBuildError(f"SKIPPY_CPU_VARIANTS={value!r}: use 'all' (every variant) or leave it unset")
    return value == "all"


def build_dir() -> Path:
    tag = f"{platform.system().lower()}-{platform.machine().lower()}"
    extra = os.environ.get("SKIPPY_CMAKE_ARGS", "")
    if extra:
        tag += "-" + hashlib.sha256(extra.encode()).hexdigest()[:8]
    if cpu_variants():
        tag += "-cpu-variants"
    return Path(os.environ.get("SKIPPY_BUILD_DIR") or BUILD / f"native-{tag}")


def _library_names() -> list[str]:
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    names = ("llama", "ggml", "ggml-base") if cpu_variants() else ("llama", "ggml", "ggml-base", "ggml-cpu")
    return [f"lib{name}{suffix}" for name in names]


def build_native(dest: Path = PACKAGE_LIB, jobs: int | None = None) -> Path:
    """Build the patched libraries and copy them to ``dest``; returns ``dest``."""
    source = patched_source()
    out = build_dir()
    cmake = shutil.which("cmake")
    if cmake is None:
        raise NativeBuildError("cmake not found on PATH (pip install cmake, or apt-get install cmake)")
    args = list(BASE_CMAKE_ARGS)
    if cpu_variants():
        args = [a for a in args if not a.startswith("-DGGML_BACKEND_DL=")]
        args += ["-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if shutil.which("ccache"):
        args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    extra = shlex.split(os.environ.get("SKIPPY_CMAKE_ARGS", ""))
    if not any(a.startswith("-DGGML_CUDA") for a in extra):
        args.append("-DGGML_CUDA=OFF")
    args += extra
    ninja = shutil.which("ninja")
    if ninja:
        args += ["-DCMAKE_MAKE_PROGRAM=" + ninja]
    configured = out / ".skippy-configure"
    wanted = "\n".join([str(source), cmake] + args)
    if not (configured.exists() and configured.read_text() == wanted):
        _log("configuring: cmake " + " ".join(args))
        # Tools may live in a pip build environment that is gone by the next build: a cache that
        # names other tool paths is dropped (object files stay, so nothing is recompiled needlessly).
        (out / "CMakeCache.txt").unlink(missing_ok=True)
        shutil.rmtree(out / "CMakeFiles", ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        _run([cmake, "-S", str(source), "-B", str(out), *args], "cmake configure")
        configured.write_text(wanted)
    jobs = jobs or int(os.environ.get("SKIPPY_BUILD_JOBS", "0")) or (os.cpu_count() or 2)
    _log(f"building target llama with {jobs} jobs")
    _run([cmake, "--build", str(out), "--target", "llama", "-j", str(jobs)], "cmake build")
    install_libraries(out / "bin", dest)
    install_vocab(source)
    (dest / "SOURCE").write_text(f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} vendored llama.cpp + patches {patch_digest()}\n")
    return dest


def install_vocab(source: Path) -> Path:
    """Copy the vocab-only GGUFs from a llama.cpp tree into skippy/models/vocab (once); returns it."""
    vocab_dest = ROOT / "skippy" / "models" / "vocab"
    vocab_dest.mkdir(parents=True, exist_ok=True)
    for name in VOCAB_FILES:
        source_vocab = source / "models" / name
        target_vocab = vocab_dest / name
        if source_vocab.exists() and not target_vocab.exists():
            shutil.copyfile(source_vocab, target_vocab)
    return vocab_dest


def install_libraries(libdir: Path, dest: Path) -> list[str]:
    """Copy the built libraries from ``libdir`` into ``dest`` and remove any other ``lib*.so`` there;
    returns the names installed."""
    dest.mkdir(parents=True, exist_ok=True)
    installed = set()
    for name in _library_names():
        built = libdir / name
        if not built.exists():
            raise NativeBuildError(f"the build did not produce {built}")
        # Copy the real file under the plain name (no version symlinks) so wheels carry one copy.
        _install(built.resolve(), dest / name)
        installed.add(name)
    # Extra backends (CUDA, ...; every CPU variant in SKIPPY_CPU_VARIANTS=all) are linked from
    # libggml or loaded as modules; copy any that were built.
    for extra_lib in sorted(libdir.glob("libggml-*.so")):
        if extra_lib.name not in _library_names() and not extra_lib.is_symlink():
            _install(extra_lib.resolve(), dest / extra_lib.name)
            installed.add(extra_lib.name)
    if cpu_variants() and not any(name.startswith("libggml-cpu-") for name in installed):
        raise NativeBuildError(f"SKIPPY_CPU_VARIANTS=all, but the build made no libggml-cpu-*.so in {libdir}")
    # A library from another kind of build (the linked-in libggml-cpu, a variant) must not ship.
    for stale in dest.glob("lib*.so"):
        if stale.name not in installed:
            stale.unlink()
    return sorted(installed)


def _install(source: Path, target: Path) -> None:
    """Copy a library into place unless identical.  The copy gets a new inode (written aside,
    then renamed over the target): a process that has the old file mapped keeps running on it,
    where overwriting in place would change code under its feet."""
    if target.exists() and target.read_bytes() == source.read_bytes():
        return
    partial = target.with_name(target.name + ".part")
    shutil.copyfile(source, partial)
    os.replace(partial, target)


def _run(command: list[str], step: str) -> None:
    env = dict(os.environ)
    # Relative paths in compile lines let ccache share hits between checkouts and build dirs.
    env.setdefault("CCACHE_BASEDIR", str(BUILD))
    result = subprocess.run(command, env=env)
    if result.returncode != 0:
        raise NativeBuildError(f"{step} failed (exit {result.returncode}): {' '.join(command)}")


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build the patched llama.cpp libraries.")
    parser.add_argument("--dest", type=Path, default=PACKAGE_LIB, help="where the libraries go (default skippy/lib)")
    args = parser.parse_args()
    try:
        dest = build_native(args.dest)
    except NativeBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _log(f"libraries installed in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
