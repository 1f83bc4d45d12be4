"""Large CPU buffers on transparent huge pages (native/patches/0004-cpu-buffers-on-huge-pages.patch).

Each case loads a model in a fresh process (the switch is read once per process) and reads the
process's AnonHugePages from /proc/self/smaps_rollup before and after: with the patch's default
the weights and KV land on 2 MiB pages, with SKIPPY_HUGE_PAGES=0 none do, and the logits are
bitwise the same either way.  The speed this buys is measured in bench/real_model.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import model_path

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

PROBE = r"""
import json, sys
import numpy as np
from skippy.runtime import Model, StageContext, huge_page_bytes

def huge_kib():
    return huge_page_bytes() // 1024

before = huge_kib()
with Model(sys.argv[1], use_mmap=sys.argv[2] == "mmap") as model, \
        StageContext(model, n_ctx=256, n_batch=16, threads=1) as context:
    context.decode(tokens=[1, 2, 3, 4], positions=range(4), seq_ids=[0] * 4, outputs=[True] * 4)
    logits = np.stack([context.logits(row) for row in range(4)])
    weights = context.memory().weights
    print(json.dumps({"huge_kib": huge_kib() - before, "weights": weights, "logits": logits.tobytes().hex()}))
"""


def thp_available() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def probe(path: Path, *, huge_pages: bool, load: str = "read") -> dict[str, object]:
    env = dict(os.environ)
    env.pop("SKIPPY_HUGE_PAGES", None)
    if not huge_pages:
        env["SKIPPY_HUGE_PAGES"] = "0"
    result = subprocess.run([sys.executable, "-c", PROBE, str(path), load], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not thp_available(), reason=f"transparent huge pages are off in this kernel ({THP})")
def test_read_weights_land_on_huge_pages_and_compute_the_same() -> None:
    path = model_path()  # tiny llama, F32: ~17 MB of weights, several 2 MiB pages
    on = probe(path, huge_pages=True)
    off = probe(path, huge_pages=False)
    assert int(off["huge_kib"]) == 0  # type: ignore[arg-type]
    # most of the weights' bytes are on 2 MiB pages (the buffer's last partial page may not be)
    assert int(on["huge_kib"]) * 1024 >= int(on["weights"]) // 2, on["huge_kib"]  # type: ignore[arg-type]
    assert on["logits"] == off["logits"]


def test_mapped_weights_are_page_cache_and_compute_the_same() -> None:
    """A mapped file stays where the page cache put it; only the KV and compute buffers may be
    huge, far below the weights' size."""
    path = model_path()
    mapped = probe(path, huge_pages=True, load="mmap")
    read = probe(path, huge_pages=True)
    assert int(mapped["huge_kib"]) * 1024 < int(mapped["weights"]) // 2  # type: ignore[arg-type]
    assert mapped["logits"] == read["logits"]
