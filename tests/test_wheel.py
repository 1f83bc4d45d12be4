"""The wheel is self-contained: it installs into a fresh virtualenv and runs a split exactly.

Builds the wheel from this tree (reusing the native build directory), installs it with its
dependencies into a new virtualenv, and runs a smoke script from outside the source tree: load a
generated model split in two and compare its logits with the unsplit model's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SMOKE = r"""
import numpy as np, skippy, sys
assert "site-packages" in skippy.__file__, skippy.__file__
from skippy.models.spec import tiny
from skippy.models.cache import ensure_model
from skippy.local import LocalChain
path = ensure_model(tiny("qwen3"))
prompt = [1, 15043, 3186, 29892, 920]
def run(split):
    with LocalChain(path, split, n_ctx=128, max_sessions=1, n_batch=16, threads=2) as chain:
        chain.decode(prompt, list(range(5)), [0] * 5, [True] * 5)
        return np.stack(chain.logits())
assert np.array_equal(run([(0, 2), (2, 4)]), run([(0, 4)]))
print("wheel smoke ok")
"""


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_tree(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # no PYTHONPATH: a source tree on it would make pip think skippy is already installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SKIPPY_VOCAB_DIR")}
    env["CMAKE_ARGS"] = "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(ROOT)],
                   check=True, env=env, timeout=1800)
    (wheel,) = dist.glob("skippy-*.whl")
    target = tmp_path / "venv"
    venv.create(target, with_pip=True)
    python = target / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], check=True, env=env, timeout=1800)
    clean_env = dict(env, SKIPPY_MODEL_CACHE=str(tmp_path / "models"))
    result = subprocess.run([str(python), "-c", SMOKE], cwd=tmp_path, env=clean_env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "wheel smoke ok" in result.stdout
