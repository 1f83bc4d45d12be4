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


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_stage_resident_memory_is_its_share(tied: bool) -> None:
    path = ensure_model(preset("llama-16x1024", tied=tied))
    full = probe(path, "0:16")
    full_resident = int(full["resident_delta"])  # type: ignore[arg-type]
    print(f"\n{'tied' if tied else 'untied'} full: resident {full_resident / MIB:.0f} MiB, "
          f"weights {int(full['weights']) / MIB:.0f} MiB, KV {int(full['kv_capacity']) / MIB:.0f} MiB")  # type: ignore[arg-type]
    for layers in ("0:8", "4:12", "8:16", "12:16"):
        stage = probe(path, layers)
        start, end = map(int, layers.split(":"))
        share = (end - start) / 16
        resident = int(stage["resident_delta"])  # type: ignore[arg-type]
        weights = int(stage["weights"])  # type: ignore[arg-type]
        print(f"  stage {layers}: resident {resident / MIB:.0f} MiB, weights {weights / MIB:.0f} MiB, "
              f"KV {int(stage['kv_capacity']) / MIB:.0f} MiB, mmap={stage['mmap']}")  # type: ignore[arg-type]
        # the stage holds its layers plus (first/last) embeddings or head; never close to the full model
        assert weights < int(full["weights"]) * (share + 0.25)  # type: ignore[arg-type]
        assert resident < full_resident * (share + 0.25) + 64 * MIB
        assert int(stage["kv_capacity"]) == int(full["kv_capacity"]) * (end - start) // 16  # type: ignore[arg-type]


@pytest.mark.slow
def test_moe_stage_resident_memory_is_its_share() -> None:
    """A real-shape MoE (Qwen3-30B-A3B blocks, 8 experts, Q8_0): the expert tensors dominate the
    file, and each stage maps only its own layers' experts."""
    path = ensure_model(preset("qwen3moe-30b-a3b-8e"))
    full = probe(path, "0:12")
    full_resident = int(full["resident_delta"])  # type: ignore[arg-type]
    print(f"\nqwen3moe 8e full: file {path.stat().st_size / MIB:.0f} MiB, resident {full_resident / MIB:.0f} MiB, "
          f"weights {int(full['weights']) / MIB:.0f} MiB, KV {int(full['kv_capacity']) / MIB:.0f} MiB")  # type: ignore[arg-type]
    for layers in ("0:6", "6:12", "0:4", "4:8", "8:12"):
        stage = probe(path, layers)
        start, end = map(int, layers.split(":"))
        share = (end - start) / 12
        resident = int(stage["resident_delta"])  # type: ignore[arg-type]
        weights = int(stage["weights"])  # type: ignore[arg-type]
        print(f"  stage {layers}: resident {resident / MIB:.0f} MiB ({resident / full_resident:.0%} of full, "
              f"layer share {share:.0%}), weights {weights / MIB:.0f} MiB, KV {int(stage['kv_capacity']) / MIB:.0f} MiB")  # type: ignore[arg-type]
        assert weights < int(full["weights"]) * (share + 0.15)  # type: ignore[arg-type]
        assert resident < full_resident * (share + 0.15) + 64 * MIB
        assert int(stage["kv_capacity"]) == int(full["kv_capacity"]) * (end - start) // 12  # type: ignore[arg-type]
