"""Shared fixtures: generated models (cached by spec) and their loads (shared by the session), the real model,
and the prompt used across tests."""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pytest
from shared_loads import SharedLoads

from skippy.models.cache import ensure_model
from skippy.models.real import RealModelUnavailable, ensure_real_model
from skippy.models.spec import tiny

#: Token ids of a short English prompt in the llama-spm vocabulary ("Hello world, how are you doing").
PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354]

#: Where a crash of this pytest process (SIGSEGV, SIGABRT...) leaves every thread's Python stack
#: (``SKIPPY_CRASH_DIR``, default build/crash): one file per process, kept when not empty.  .ci/run
#: prints them after a failed run.  The Python processes the tests start inherit PYTHONFAULTHANDLER
#: (their stacks go to their own stderr: a stage's log).
CRASH_DIR = Path(os.environ.get("SKIPPY_CRASH_DIR") or Path(__file__).resolve().parent.parent / "build" / "crash")
_crash_file: TextIO | None = None


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Dump a crash's stacks to a file (after pytest's own faulthandler set-up, which writes to stderr)."""
    global _crash_file
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    CRASH_DIR.mkdir(parents=True, exist_ok=True)
    for old in CRASH_DIR.glob("pytest-*.txt"):  # earlier runs' files that stayed empty
        if old.stat().st_size == 0 and not Path(f"/proc/{old.stem.removeprefix('pytest-')}").exists():
            old.unlink(missing_ok=True)
    _crash_file = (CRASH_DIR / f"pytest-{os.getpid()}.txt").open("w")
    faulthandler.enable(_crash_file, all_threads=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Keep dumping to the file until the process exits (pytest's unconfigure disabled it): a crash
    while the interpreter and llama.cpp tear down is a crash of the run too."""
    if _crash_file is not None:
        faulthandler.enable(_crash_file, all_threads=True)


def pytest_report_header(config: pytest.Config) -> str:
    return f"crash dumps (faulthandler): {CRASH_DIR}/pytest-{os.getpid()}.txt"


@pytest.fixture(scope="session", autouse=True)
def _shared_loads() -> Iterator[SharedLoads]:
    """Weights loaded once per session (tests/shared_loads.py)."""
    shared = SharedLoads()
    shared.install()
    try:
        yield shared
    finally:
        shared.uninstall()


@pytest.fixture(autouse=True)
def _own_loads(request: pytest.FixtureRequest, _shared_loads: SharedLoads) -> Iterator[None]:
    """A test marked ``own_loads`` loads its models afresh."""
    if request.node.get_closest_marker("own_loads") is None:
        yield
        return
    _shared_loads.enabled = False
    try:
        yield
    finally:
        _shared_loads.enabled = True


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return ensure_model(tiny("llama"))


def model_path(arch: str = "llama", dtype: str = "F32", tied: bool = False, **kw: object) -> Path:
    return ensure_model(tiny(arch, dtype=dtype, tied=tied, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The real Gemma 3 270M GGUF (assembled into the model cache once, sha256-verified).

    Skips only when the ``skippy-llm[real-model]`` package is not installed; a damaged package
    (wrong hash) fails the test instead.
    """
    try:
        return ensure_real_model()
    except RealModelUnavailable as exc:  # the optional extra is absent: nothing to test against
        pytest.skip(f"real model unavailable: {exc}")
