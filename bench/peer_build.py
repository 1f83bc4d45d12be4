"""Build the stock (unpatched) llama.cpp peer: ``llama-bench``, ``ggml-rpc-server`` and ``llama-server``.

Strategy: the peer is the pristine llama.cpp tree of the same pinned llama-cpp-python sdist that
our patch series applies to (found, downloaded and sha256-checked by ``native/build.py``'s helpers,
imported, not duplicated).  It is configured out of tree in ``build/peer-<platform>`` with
``-DGGML_RPC=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON`` and the same portable CPU level as our build
(``-DGGML_NATIVE=OFF``: AVX2/FMA/F16C/BMI2, no AVX-512 or AMX — a natively built stock tree
segfaults on this host's CPU for Gemma 3 multi-token batches, and different kernels would not be a
fair comparison anyway), shared libraries like ours, ccache when present.  Only the named targets
are built: :data:`TARGETS` by default (``llama-server`` is asked for only by the benchmarks that
serve, ``bench/concurrency.py``, since it pulls in the multimodal and web-UI libraries).  The configure step is skipped while its arguments are unchanged and Ninja makes an
unchanged rebuild a no-op, so calling :func:`build_peer` before every benchmark is cheap.  Nothing
is written to ``skippy/lib``, the patched tree or the pip cache.

Run directly: ``.venv/bin/python bench/peer_build.py [--server]`` prints the binaries' paths.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "native"))

import build as native_build  # noqa: E402  (native/build.py: the pinned sdist's helpers)

#: The peer targets (in this tree the RPC server target is ``ggml-rpc-server``).
TARGETS = ("llama-bench", "ggml-rpc-server")
#: The OpenAI-compatible server, built with ``build_peer(server=True)``.
SERVER_TARGET = "llama-server"

PEER_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_RPC=ON",
    "-DLLAMA_BUILD_COMMON=ON",  # the tools need llama-common
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BACKEND_DL=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_BLAS=OFF",
]


class PeerBuildError(RuntimeError):
    """The peer build failed; the message names the step."""


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    """Paths of the built stock binaries."""

    llama_bench: Path
    rpc_server: Path
    build_dir: Path
    #: ``llama-server`` (built only when asked for)
    llama_server: Path | None = None


def peer_build_dir() -> Path:
    return native_build.BUILD / f"peer-{platform.system().lower()}-{platform.machine().lower()}"


def _log(message: str) -> None:
    print(f"[skippy peer] {message}", file=sys.stderr, flush=True)


def build_peer(jobs: int | None = None, *, quiet: bool = True, server: bool = False) -> Peer:
    """Configure (when needed) and build the stock targets (with ``server``, ``llama-server`` too);
    returns their paths."""
    try:
        source = native_build._pristine_source()  # noqa: SLF001  (download + sha256 + extract)
    except native_build.NativeBuildError as exc:
        raise PeerBuildError(str(exc)) from exc
    cmake = shutil.which("cmake")
    if cmake is None:
        raise PeerBuildError("cmake not found on PATH")
    out = peer_build_dir()
    args = list(PEER_CMAKE_ARGS)
    ninja = shutil.which("ninja")
    if ninja:
        args += ["-G", "Ninja", "-DCMAKE_MAKE_PROGRAM=" + ninja]
    if shutil.which("ccache"):
        args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    stamp = out / ".skippy-peer-configure"
    wanted = "\n".join([str(source), cmake, *args])
    if not (stamp.exists() and stamp.read_text() == wanted):
        _log(f"configuring stock llama.cpp from {source} in {out}")
        (out / "CMakeCache.txt").unlink(missing_ok=True)
        shutil.rmtree(out / "CMakeFiles", ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        _run([cmake, "-S", str(source), "-B", str(out), *args], "cmake configure", quiet)
        stamp.write_text(wanted)
    jobs = jobs or os.cpu_count() or 2
    command = [cmake, "--build", str(out), "-j", str(jobs)]
    for target in (*TARGETS, *([SERVER_TARGET] if server else [])):
        command += ["--target", target]
    _run(command, "cmake build", quiet)
    peer = Peer(out / "bin" / "llama-bench", out / "bin" / "ggml-rpc-server", out,
                out / "bin" / SERVER_TARGET if server else None)
    for binary in (peer.llama_bench, peer.rpc_server, *([peer.llama_server] if peer.llama_server else [])):
        if not binary.exists():
            raise PeerBuildError(f"the build did not produce {binary}")
    return peer


def _run(command: list[str], step: str, quiet: bool) -> None:
    env = dict(os.environ)
    env.setdefault("CCACHE_BASEDIR", str(native_build.BUILD))
    result = subprocess.run(command, env=env, capture_output=quiet, text=True)
    if result.returncode != 0:
        tail = "" if not quiet else "\n" + (result.stdout + result.stderr)[-4000:]
        raise PeerBuildError(f"{step} failed (exit {result.returncode}): {' '.join(command)}{tail}")


def main() -> int:
    try:
        peer = build_peer(quiet=False, server="--server" in sys.argv[1:])
    except PeerBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(peer.llama_bench)
    print(peer.rpc_server)
    if peer.llama_server is not None:
        print(peer.llama_server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
