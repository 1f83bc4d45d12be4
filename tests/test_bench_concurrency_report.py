"""bench/concurrency.py's accounting: figures per N, never mixed, and CPU per token per process.

Strategy: pure (no process started): a :class:`concurrency.Tally` is fed as a measurement
would feed it, and :func:`concurrency.report` must print each N's rows per batch, busy share
and CPU per generated token apart (mixed, N = 1's relay-carried single rows read as a low
figure for N = 8: issue 31's misreading).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import concurrency  # noqa: E402


def _metrics(rows: float, batches: float, busy: float, cpu: float) -> dict[str, float]:
    return {"compute": 0.0, "busy": busy, "cpu": cpu, "rows": rows, "batches": batches}


def test_a_tally_splits_the_clients_the_api_and_the_stages() -> None:
    tally = concurrency.Tally()
    tally.add(10.0, 800, [0.4, 0.3, 8.0, 8.2], True, [_metrics(200, 50, 8.5, 7.6), _metrics(200, 50, 8.4, 7.7)])
    tally.add(10.0, 800, [0.5, 0.2, 8.1, 8.0], True, [_metrics(196, 50, 8.0, 7.5), _metrics(200, 50, 8.0, 7.5)])
    assert tally.tokens == 1600 and tally.wall_s == 20.0
    assert abs(tally.client_cpu_s - 0.9) < 1e-9 and abs(tally.api_cpu_s - 0.5) < 1e-9
    assert [round(c, 6) for c in tally.stage_cpu_s] == [16.1, 16.2]
    assert tally.stage_metrics[0]["rows"] == 396 and tally.stage_metrics[1]["batches"] == 100
    stock = concurrency.Tally()  # stock: no API pid apart, the server is the one process
    stock.add(5.0, 400, [0.2, 4.8], False, [])
    assert stock.api_cpu_s == 0.0 and stock.stage_cpu_s == [4.8]


def test_the_report_keeps_each_n_apart() -> None:
    one, eight = concurrency.Tally(), concurrency.Tally()
    one.add(10.0, 400, [0.2, 0.3, 4.0, 4.4], True, [_metrics(400, 400, 0.2, 0.2), _metrics(400, 400, 0.2, 0.2)])
    eight.add(10.0, 800, [0.4, 0.3, 8.0, 8.0], True, [_metrics(800, 200, 9.0, 7.6), _metrics(800, 200, 8.0, 7.6)])
    data = {"model": "m.gguf", "results": {"skippy-2x1t": {1: [40.0], 8: [80.0]}},
            "compute_ms": {"skippy-2x1t": {}}, "splits": {"skippy-2x1t": [(0, 9), (9, 16)]},
            "points": {"skippy-2x1t": {1: one.__dict__, 8: eight.__dict__}}}
    args = argparse.Namespace(max_tokens=64, seconds=8.0, rounds=1, concurrency=[1, 8], variants=["skippy-2x1t"])
    text = concurrency.report("llama", data, args)
    lines = {n: next(line for line in text.splitlines() if line.startswith(f"- skippy-2x1t N={n},")) for n in (1, 8)}
    assert "1.00 rows per decode batch" in lines[1] and "4.00 rows per decode batch" in lines[8]
    assert "stage 0 runtime busy 90%" in lines[8] and "stage 0 runtime busy 2%" in lines[1]
    # CPU ms per generated token: stage 0 8.0 s / 800, the API 0.3 s / 800, the clients 0.4 s / 800
    assert "stage 0 10.00, stage 1 10.00, api 0.38, clients 0.50" in lines[8]
    assert "stage 0 10.00, stage 1 11.00, api 0.75, clients 0.50" in lines[1]
    assert "its thread's CPU 9.50 ms per token" in lines[8]
