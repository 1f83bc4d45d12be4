"""The lane's sans-IO rules package (skippy.lane): its parts, without sockets, and its imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from skippy.lane.timings import DirectTimings
from skippy.protocol_ext import TimingRecord


def test_direct_timings_sum_per_session_and_are_taken_once() -> None:
    totals = DirectTimings()
    totals.add(7, compute_us=10, write_us=2, queue_us=1, batch_size=1)
    totals.add(7, compute_us=30, write_us=3, queue_us=-5, batch_size=4, messages=3)  # a relay run's 3
    totals.add(8, compute_us=1, write_us=1)
    assert totals.take(7, stage_index=1, layer_start=2, layer_end=4) == TimingRecord(1, 2, 4, 4, 40, 5, 0, 1)
    assert totals.take(7, stage_index=1, layer_start=2, layer_end=4) is None  # taken: the next Stop has none
    totals.add(9, compute_us=0, write_us=0, messages=0)  # a relay run that carried nothing
    assert totals.take(9, stage_index=0, layer_start=0, layer_end=2) is None
    totals.discard(8)
    assert len(totals) == 0
    assert totals.take(5, stage_index=-1, layer_start=0, layer_end=1) is None


def test_the_lane_package_imports_nothing_heavy() -> None:
    """lane ↛ trio / net / runtime: the rules load in a fresh interpreter without them."""
    package = Path(__file__).resolve().parent.parent / "skippy" / "lane"
    names = sorted(f"skippy.lane.{path.stem}" for path in package.glob("*.py") if path.stem != "__init__")
    assert {"skippy.lane.protocol", "skippy.lane.messages", "skippy.lane.errors"} <= set(names)
    code = f"import sys, json; import {', '.join(names)}; print(json.dumps(sorted(sys.modules)))"
    modules = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                        text=True).stdout)
    heavy = [name for name in modules if name.split(".")[0] in ("trio", "socket", "ssl", "cffi", "_cffi_backend")
             or name.startswith(("skippy.stage", "skippy.runtime", "skippy.net", "skippy.driver", "skippy._llama"))]
    assert heavy == []
