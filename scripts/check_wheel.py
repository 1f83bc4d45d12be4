"""Smoke-check an installed skippy-llm (run by scripts/check_wheel.sh and cibuildwheel's test-command).

From outside any source tree, with the package installed from a wheel: the package comes from
site-packages, ``python -m skippy.stage --help`` and the ``skippy`` command run, the native backends
load, and a generated model split in two decodes exactly as the unsplit model (bitwise logits over a
prefill and greedy decode steps).  Prints one line per check; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    import numpy as np

    import skippy

    package = Path(skippy.__file__).resolve().parent
    assert "site-packages" in package.parts, f"skippy imported from {package}, not an installed wheel"
    print(f"python {sys.version.split()[0]}: skippy from {package}")
    help_text = subprocess.run([sys.executable, "-m", "skippy.stage", "--help"], check=True,
                               capture_output=True, text=True, timeout=120).stdout
    assert "--layers" in help_text, help_text[-2000:]
    print("python -m skippy.stage --help: ok")
    command = shutil.which("skippy", path=str(Path(sys.executable).parent))
    assert command is not None, "the skippy command is not installed next to the interpreter"
    subprocess.run([command, "--help"], check=True, capture_output=True, timeout=120)
    print("skippy --help: ok")

    from skippy.runtime.local import LocalChain
    from skippy.models.cache import ensure_model
    from skippy.models.spec import tiny
    from skippy.runtime import ffi

    libs = sorted(p.name for p in (package / "lib").glob("lib*.so"))
    variant = ffi.BACKENDS.cpu.name if ffi.BACKENDS else "linked in"
    print(f"native libraries: {len(libs)} ({', '.join(libs)}); cpu backend: {variant}")
    os.environ.setdefault("SKIPPY_MODEL_CACHE", tempfile.mkdtemp(prefix="skippy-check-models-"))
    path = ensure_model(tiny("llama", n_embd=64))
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599]

    def run(split: list[tuple[int, int]]) -> np.ndarray:
        with LocalChain(path, split, n_ctx=64, max_sessions=1, n_batch=16, threads=1) as chain:
            chain.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [True] * len(prompt))
            rows = [np.stack(chain.logits())]
            position = len(prompt)
            for _ in range(8):  # greedy decode steps, one token each
                token = int(np.argmax(rows[-1][-1]))
                chain.decode([token], [position], [0], [True])
                rows.append(np.stack(chain.logits()))
                position += 1
            return np.concatenate(rows)

    split, whole = run([(0, 2), (2, 4)]), run([(0, 4)])
    assert split.shape == whole.shape and np.array_equal(split, whole), "2-stage split differs from unsplit"
    assert float(whole.std()) > 0.02, "uninformative logits"
    print(f"2-stage split decode = unsplit: ok ({whole.shape[0]} logit rows, bitwise)")
    print("wheel check ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
