"""Build script: Cython extensions, the cffi binding to llama.cpp, and the native build step.

Strategy: ``build_ext`` first builds the patched llama.cpp (``native/build.py``) into ``skippy/lib``
unless ``SKIPPY_LLAMA_LIB_DIR`` names a prebuilt one (the release builds one per flavour for every
Python: scripts/release.py), then compiles the Cython modules and the cffi
API-mode module ``skippy._llama``, which links ``libllama`` with an ``$ORIGIN/lib`` rpath.
``SKIPPY_DEBUG=1`` builds the Cython modules with line tracing; ``--cython-always`` and
``--annotate`` are passed through to ``cythonize``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "native"))

CYTHON_VERSION = "3.2.4"
CYTHON_MODULES = ["skippy.codec._wire", "skippy.cache._radix", "skippy.stage._relay"]


def _cython_extensions(debug: bool) -> list[Extension]:
    import numpy

    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    if debug:
        macros += [("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1"), ("SKIPPY_DEBUG", "1")]
    extensions = []
    for module in CYTHON_MODULES:
        source = ROOT / (module.replace(".", "/") + ".pyx")
        if not source.exists():
            continue
        extensions.append(
            Extension(
                module,
                [str(source.relative_to(ROOT))],
                include_dirs=[numpy.get_include(), "skippy/codec", "native/cdef"],
                define_macros=macros,
                extra_compile_args=["-O3"] if not debug else ["-O0", "-g"],
            )
        )
    return extensions


class SkippyBuildExt(build_ext):
    user_options = build_ext.user_options + [
        ("cython-always", None, "always re-run cythonize"),
        ("annotate", None, "write Cython annotation HTML next to the sources"),
    ]
    boolean_options = build_ext.boolean_options + ["cython-always", "annotate"]

    def initialize_options(self) -> None:
        super().initialize_options()
        self.cython_always = False
        self.annotate = False

    def finalize_options(self) -> None:
        # Cythonize first: setuptools' finalize_options annotates the extension objects it finds.
        import Cython

        if Cython.__version__ != CYTHON_VERSION:
            raise RuntimeError(f"skippy pins Cython {CYTHON_VERSION}, found {Cython.__version__}")
        from Cython.Build import cythonize

        debug = os.environ.get("SKIPPY_DEBUG") == "1"
        directives = {"language_level": "3", "embedsignature": True}
        if debug:
            directives.update(linetrace=True, profile=True)
        current = self.distribution.ext_modules or []
        if any(ext.name in CYTHON_MODULES and ext.sources == ["<cython>"] for ext in current):
            cython_exts = cythonize(
                _cython_extensions(debug),
                compiler_directives=directives,
                include_path=["skippy/codec"],  # the frame layout's .pxi, which the relay includes too
                force=bool(self.cython_always),
                annotate=bool(self.annotate),
                quiet=True,
            )
            others = [e for e in current if e.name not in CYTHON_MODULES]
            self.distribution.ext_modules = cython_exts + others
        super().finalize_options()

    def run(self) -> None:
        lib_dir = self._native_lib_dir()
        for ext in self.extensions:
            if ext.name == "skippy._llama":
                from build import install_vocab, patched_source
                from build_ffi import emit_source

                emit_source()
                source = patched_source()
                install_vocab(source)  # a prebuilt SKIPPY_LLAMA_LIB_DIR skipped the native build that copies them
                ext.include_dirs = [str(source / "include"), str(source / "ggml" / "include"), str(ROOT / "native" / "cdef")]
                ext.library_dirs = [str(lib_dir)]
        super().run()
        if not self.inplace:
            # build_py ran before the native build produced these: ship them in the package too.
            package = Path(self.build_lib) / "skippy"
            (package / "lib").mkdir(parents=True, exist_ok=True)
            (package / "models" / "vocab").mkdir(parents=True, exist_ok=True)
            _ship_libraries(self, lib_dir, package / "lib")
            for vocab in (ROOT / "skippy" / "models" / "vocab").glob("*.gguf"):
                self.copy_file(str(vocab), str(package / "models" / "vocab" / vocab.name))
            self.copy_file(str(ROOT / "skippy" / "_native_stamp.py"), str(package / "_native_stamp.py"))

    def _native_lib_dir(self) -> Path:
        prebuilt = os.environ.get("SKIPPY_LLAMA_LIB_DIR")
        if prebuilt:
            return Path(prebuilt).resolve()
        from build import build_native  # native/build.py

        return build_native(ROOT / "skippy" / "lib")


def _ship_libraries(command: build_ext, lib_dir: Path, target: Path) -> None:
    """Make ``target`` (the package's lib/ in the build tree) hold exactly the native build's
    libraries: build_py copied whatever the source tree's skippy/lib held (the developer's
    linked-in build), and a build tree reused across Pythons and flavours keeps older copies.
    A prebuilt SKIPPY_LLAMA_LIB_DIR (scripts/release.py: one native build for every Python)
    also brings its SOURCE line."""
    built = {lib.name for lib in lib_dir.glob("lib*")}
    for stale in target.glob("lib*"):
        if stale.name not in built:
            stale.unlink()
    for name in sorted(built) + (["SOURCE"] if (lib_dir / "SOURCE").exists() else []):
        # copy_file skips a target newer than its source: a library of another flavour copied
        # there earlier (a prebuilt set is often older than the last build) would stay
        (target / name).unlink(missing_ok=True)
        command.copy_file(str(lib_dir / name), str(target / name))


def _ffi_extension() -> Extension:
    from build_ffi import make_extension  # native/build_ffi.py

    return make_extension()


def _all_extensions() -> list[Extension]:
    return [Extension(name, ["<cython>"]) for name in CYTHON_MODULES] + [_ffi_extension()]


setup(
    ext_modules=_all_extensions(),
    cmdclass={"build_ext": SkippyBuildExt},
    zip_safe=False,
)
