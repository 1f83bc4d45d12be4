"""Every stage of a 16-layer, 1024-wide model is resident at roughly its share of the model.

Each stage runs in its own process (tests/memory_probe.py); figures are printed for the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skippy.models.cache import ensure_model
from skippy.models.spec import preset

PROBE = Path(__file__).with_name("memory_probe.py")
MIB = 1 << 20


def probe(path: Path, layers: str) -> dict[str, object]:
    result = subprocess.run([sys.executable, str(PROBE), str(path), layers], capture_output=True, text=True,
                            timeout=600, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_shares(path: Path, label: str, n_layer: int, ranges: tuple[str, ...], slack: float) -> None:
    """Each stage's weights and resident memory stay within ``slack`` of its layer share, and its
    KV capacity is exactly its share; prints the table for the report."""
    full = probe(path, f"0:{n_layer}")
    full_resident = int(full["resident_delta"])  # type: ignore[arg-type]
    print(f"\n{label} full: file {path.stat().st_size / MIB:.0f} MiB, resident {full_resident / MIB:.0f} MiB, "
          f"weights {int(full['weights']) / MIB:.0f} MiB, KV {int(full['kv_capacity']) / MIB:.0f} MiB")  # type: ignore[arg-type]
    for layers in ranges:
        stage = probe(path, layers)
        start, end = map(int, layers.split(":"))
        share = (end - start) / n_layer
        resident = int(stage["resident_delta"])  # type: ignore[arg-type]
        weights = int(stage["weights"])  # type: ignore[arg-type]
        print(f"  stage {layers}: resident {resident / MIB:.0f} MiB ({resident / full_resident:.0%} of full, "
              f"layer share {share:.0%}), weights {weights / MIB:.0f} MiB, "
              f"KV {int(stage['kv_capacity']) / MIB:.0f} MiB, mmap={stage['mmap']}")  # type: ignore[arg-type]
        # the stage holds its layers plus (first/last) embeddings or head; never close to the full model
        assert weights < int(full["weights"]) * (share + slack)  # type: ignore[arg-type]
        assert resident < full_resident * (share + slack) + 64 * MIB
        assert int(stage["kv_capacity"]) == int(full["kv_capacity"]) * (end - start) // n_layer  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_stage_resident_memory_is_its_share(tied: bool) -> None:
    path = ensure_model(preset("llama-16x1024", tied=tied))
    check_shares(path, "tied" if tied else "untied", 16, ("0:8", "4:12", "8:16", "12:16"), 0.25)


@pytest.mark.slow
def test_moe_stage_resident_memory_is_its_share() -> None:
    """A real-shape MoE (Qwen3-30B-A3B blocks, 8 experts, Q8_0): the expert tensors dominate the
    file, and each stage maps only its own layers' experts."""
    path = ensure_model(preset("qwen3moe-30b-a3b-8e"))
    check_shares(path, "qwen3moe 8e", 12, ("0:6", "6:12", "0:4", "4:8", "8:12"), 0.15)
