"""Installing skippy leaves the user's pip cache alone (issue 15, item 1).

The scenario: the Makefile installs llama-cpp-python 0.3.36 (the tests' unsplit reference) without
its own native build.  pip caches a wheel it builds from an sdist under the sdist's name, so when
that library-less wheel lands in the user's cache, every other environment of the user that asks
for ``llama-cpp-python==0.3.36`` installs it and ``import llama_cpp`` fails ("Shared library with
base name 'llama' not found").

The test plays it offline: a "user" with their own pip cache (``XDG_CACHE_HOME``), the pinned sdist
that the native build downloaded as the only index, and virtualenvs that see the shared venv's
packages (a ``.pth`` to a filtered copy of its site-packages, without llama_cpp and skippy) so pip
needs nothing from the network and builds with ``--no-build-isolation``.  Environment A runs the
Makefile's ``reference`` target; environment B then installs llama-cpp-python==0.3.36 the ordinary
way with ``CC=false CXX=false``: a poisoned cache hands it the library-less wheel at once (and
its import fails), a clean one makes pip try a real build, which the false compiler stops.  The
old recipe (``CMAKE_ARGS`` exported around a plain ``pip install``) runs too and must be caught,
so the check is known to see the scenario.

The user's environment never carries ``LLAMA_CPP_LIB_PATH``: `skippy.reference` sets it in the test
process (to bind the reference to skippy's libllama) once a test has loaded the reference, and
llama-cpp-python loads ``libllama`` from that directory instead of its own ``lib``.  Inherited, it
let environment B's library-less package import skippy's library, so the old recipe went unseen in
a full run and was caught when the file ran alone.  The tests set it themselves, so every run meets
the full run's condition, and each checks from pip's own log where B's package came from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skippy.reference import LIB_DIR

ROOT = Path(__file__).resolve().parent.parent
SDIST = ROOT / "build" / "downloads" / "llama_cpp_python-0.3.36.tar.gz"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SDIST.exists(), reason=f"needs the pinned sdist the native build downloads ({SDIST})"),
]


@pytest.fixture(autouse=True)
def _reference_library_in_the_test_process() -> Iterator[None]:
    """The test process as a full run leaves it: `skippy.reference` has pointed llama-cpp-python at skippy's library."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLAMA_CPP_LIB_PATH", str(LIB_DIR))
        yield


def _user_env(home: Path) -> dict[str, str]:
    """A user's environment: their own home and pip cache, no pip configuration, no build flags, and no
    ``LLAMA_CPP_LIB_PATH`` (the test process's, which would hand a library-less package skippy's library)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "LLAMA_CPP_")) and k not in ("CMAKE_ARGS", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PIP_CONFIG_FILE=os.devnull,
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _environment(target: Path, deps: Path) -> Path:
    """A virtualenv that sees ``deps`` (the shared packages, pip among them) after its own site-packages."""
    venv.create(target, with_pip=False, symlinks=True)
    python = target / "bin" / "python"
    pip = target / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{python}" -m pip "$@"\n')
    pip.chmod(0o755)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_shared_deps.pth").write_text(f"{deps}\n")
    return python


@pytest.fixture(scope="module")
def shared_deps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test venv's site-packages as symlinks, without llama_cpp and skippy."""
    source = Path(sysconfig.get_paths()["purelib"])
    deps = tmp_path_factory.mktemp("shared-deps")
    for entry in source.iterdir():
        name = entry.name.lower()
        if name.startswith(("llama_cpp", "skippy", "__editable__", "_skippy")) or name.endswith(".pth"):
            continue
        (deps / entry.name).symlink_to(entry)
    return deps


OFFLINE = f"--no-index --find-links={SDIST.parent} --no-deps --no-build-isolation"


def _cached_reference_wheels(home: Path) -> list[Path]:
    return sorted((home / ".cache" / "pip").glob("**/llama_cpp_python-*.whl"))


@dataclass(frozen=True)
class OtherProject:
    """What environment B got when it asked for llama-cpp-python==0.3.36 (``--no-index``, the sdist only)."""

    #: pip took a wheel from the user's cache (its log says "Using cached llama_cpp_python-...whl")
    cached: bool
    #: pip started a build of the sdist (which the false compiler stops)
    built: bool
    installed: bool
    #: the error of ``import llama_cpp`` in B; None when it imported (or nothing was installed)
    import_error: str | None
    log: str


def _other_project_installs(home: Path, deps: Path, tmp: Path) -> OtherProject:
    """Environment B asks for llama-cpp-python==0.3.36 the ordinary way, with no compiler."""
    python = _environment(tmp / "other-project", deps)
    env = dict(_user_env(home), CC="false", CXX="false")
    install = subprocess.run([str(python), "-m", "pip", "install", *OFFLINE.split(), "llama-cpp-python==0.3.36"],
                             env=env, capture_output=True, text=True, timeout=600)
    log = install.stdout + install.stderr
    cached = "Using cached llama_cpp_python-0.3.36-" in log
    built = "Building wheel for llama-cpp-python" in log
    if install.returncode != 0:
        return OtherProject(cached, built, False, None, log[-4000:])
    imported = subprocess.run([str(python), "-c", "import llama_cpp"], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=120)
    error = None if imported.returncode == 0 else imported.stderr[-2000:]
    return OtherProject(cached, built, True, error, log[-4000:])


def test_the_makefiles_reference_install_leaves_the_user_cache_alone(shared_deps: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env_a = tmp_path / "skippy-venv"
    _environment(env_a, shared_deps)
    result = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "reference", f"VENV={env_a}",
                             f"PIP_OPTIONS={OFFLINE}"], env=_user_env(home), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the reference really is the library-less build, in A, loading nothing of its own
    listed = subprocess.run([str(env_a / "bin" / "python"), "-m", "pip", "show", "-f", "llama-cpp-python"],
                            env=_user_env(home), capture_output=True, text=True, check=True).stdout
    assert "Version: 0.3.36" in listed and "libllama" not in listed
    assert _cached_reference_wheels(home) == []
    other = _other_project_installs(home, shared_deps, tmp_path)
    assert not other.cached, f"another environment got llama-cpp-python from the user's cache:\n{other}"
    # nothing cached: pip went for a real build, which the false compiler stopped
    assert other.built and not other.installed, other


def test_the_old_recipe_is_caught(shared_deps: Path, tmp_path: Path) -> None:
    """Today's main exported CMAKE_ARGS around a plain pip install: the check must see the damage."""
    home = tmp_path / "home"
    home.mkdir()
    python = _environment(tmp_path / "old-venv", shared_deps)
    env = dict(_user_env(home), CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *OFFLINE.split(), "llama-cpp-python==0.3.36"],
                   env=env, check=True, capture_output=True, timeout=900)
    assert _cached_reference_wheels(home), "pip did not cache the library-less wheel (the scenario changed?)"
    other = _other_project_installs(home, shared_deps, tmp_path)
    assert other.cached and not other.built and other.installed, other
    assert other.import_error is not None, other
    assert "Shared library with base name 'llama' not found" in other.import_error, other
