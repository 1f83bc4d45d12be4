"""Shared fixtures of the benchmark suites.

``benchmarks_disabled`` is True under ``--benchmark-disable`` (what ``make test`` / CI runs: every
benchmark once, so none rots, without the timing rounds); suites then use their smallest model,
since the run checks that the code path works, not how fast it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ helpers (stage_chain, ...)


@pytest.fixture(scope="session")
def benchmarks_disabled(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("benchmark_disable"))
