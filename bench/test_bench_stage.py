"""Stage-boundary overhead with the null runtime (no compute), on loopback.

Run: ``PYTHONPATH=. .venv/bin/python -m pytest bench/test_bench_stage.py --benchmark-only
--benchmark-group-by=group`` (CI: ``--benchmark-disable``).  Each round decodes ``STEPS`` tokens
through a chain of real stage processes; ``extra_info["us_per_token"]`` is the figure, and the
difference between the 3-stage and 1-stage groups, halved, is the cost of one stage boundary
(target <= 150 us).  Split-vs-unsplit and batching figures are in ``bench/stage_chain.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_chain import chain, decode_seconds_per_token  # noqa: E402

STEPS = 100
MODEL = "null:n_embd=4096,n_layer=3,n_vocab=32000"


@pytest.mark.parametrize("splits", [["0:3"], ["0:1", "1:2", "2:3"]], ids=["1-stage", "3-stage"])
def test_null_chain_decode(benchmark: Any, splits: list[str]) -> None:
    benchmark.group = "stage-null-decode"
    with chain(MODEL, splits) as address:
        seconds = benchmark.pedantic(
            lambda: trio.run(decode_seconds_per_token, address, list(range(1, 9)), STEPS),
            rounds=3, iterations=1,
        )
    benchmark.extra_info["us_per_token"] = seconds * 1e6
    benchmark.extra_info["stages"] = len(splits)
