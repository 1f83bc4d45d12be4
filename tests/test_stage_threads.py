"""A stage process's OpenMP helpers sleep while they wait (skippy.stage.threads), unless the
environment chooses otherwise; other processes that import the stage package keep libgomp's
defaults.  Read from libgomp itself (``OMP_DISPLAY_ENV=VERBOSE`` prints its settings as it loads)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from skippy.stage.threads import apply_wait_default, is_stage_process

ROOT = Path(__file__).resolve().parent.parent


def _libgomp_spincount(arguments: list[str], **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    environ.update(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=environ,
                            timeout=120, check=True)
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", result.stderr)
    if found is None:
        pytest.skip("the runtime is not built with libgomp (no OpenMP settings printed)")
    return found.group(1)


def test_the_stage_process_waits_passively_unless_told() -> None:
    assert _libgomp_spincount(["-m", "skippy.stage", "--help"]) == "0"  # PASSIVE: sleep at once
    assert _libgomp_spincount(["-m", "skippy.stage", "--help"], OMP_WAIT_POLICY="ACTIVE") == "30000000000"
    assert _libgomp_spincount(["-m", "skippy.stage", "--help"], GOMP_SPINCOUNT="1000") == "1000"
    # any other process importing the package (a test, a launcher) keeps libgomp's default
    assert _libgomp_spincount(["-c", "import skippy.stage"]) == "300000"


def test_only_the_stage_entry_point_is_recognised() -> None:
    python = "python"
    assert is_stage_process([python, "-m", "skippy.stage", "--model", "m"])
    assert is_stage_process([python, "-X", "dev", "-u", "-m", "skippy.stage"])
    assert is_stage_process([python, "-mskippy.stage"])
    for argv in ([python, "-m", "skippy", "up"], [python, "script.py", "-m", "skippy.stage"],
                 [python, "-c", "pass", "-m", "skippy.stage"], [python, "-m", "pytest"], [python]):
        assert not is_stage_process(argv), argv
    environ: dict[str, str] = {}
    assert apply_wait_default(environ, [python, "-m", "skippy.stage"]) == "PASSIVE"
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ = {"GOMP_SPINCOUNT": "1000"}
    assert apply_wait_default(environ, [python, "-m", "skippy.stage"]) is None
    assert environ == {"GOMP_SPINCOUNT": "1000"}
