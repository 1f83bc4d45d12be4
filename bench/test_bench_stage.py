"""Stage-boundary overhead with the null runtime (no compute), on loopback.

Run: ``PYTHONPATH=. .venv/bin/python -m pytest bench/test_bench_stage.py --benchmark-only
--benchmark-group-by=group`` (CI: ``--benchmark-disable``).  Each round decodes ``STEPS`` tokens
through a chain of real stage processes; ``extra_info["us_per_token"]`` is the figure, and the
difference between the 3-stage and 1-stage groups, halved, is the cost of one stage boundary
(target <= 150 us).  The ``stage-null-decode-one-process`` groups run the same chains as stage
servers inside the benchmark's trio run (real loopback sockets, one thread doing every hop): the
software cost of a boundary without four processes sharing this host's cores.  Split-vs-unsplit
and batching figures are in ``bench/stage_chain.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_chain import boundary_overhead_in_process_us, chain, decode_seconds_per_token  # noqa: E402

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


def test_null_boundary_in_one_process(benchmark: Any) -> None:
    benchmark.group = "stage-null-decode-one-process"
    figures = benchmark.pedantic(lambda: boundary_overhead_in_process_us(STEPS), rounds=3, iterations=1)
    one, three, boundary = figures
    benchmark.extra_info.update(us_per_token_1_stage=one, us_per_token_3_stages=three, us_per_boundary=boundary)
    assert three > one > 0  # the chains ran and answered (the figure itself is not asserted)
