#!/usr/bin/env bash
# Check a CUDA wheel the way a release does: install it into a fresh virtualenv with no compiler
# (CC=false CXX=false: its dependencies, NVIDIA's cudart/cuBLAS wheels included, must be wheels),
# import it, report the backends it was built with and the devices it sees, then
#   - without a GPU (a CPU-only host): a stage refuses GPU-only settings with a clear error, and
#     the defaults fall back to the CPU (a split decode equal to the unsplit one);
#   - with a GPU: run `pytest -m gpu` (tests/test_gpu.py: split = unsplit on the GPU, a two-stage
#     chain, memory per stage, the decode benchmark) from this source tree against the installed
#     wheel, and write the benchmark figures to $OUT/gpu-report.json (OUT defaults to ./gpu-check).
# usage: scripts/check_cuda_wheel.sh dist/skippy_llm-*+cu130-*.whl
set -euo pipefail
wheel=$(readlink -f "$1")
src=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$PWD/gpu-check}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=${PYTHON:-python3}
"$python" -m venv "$work/venv"
py="$work/venv/bin/python"
start=$(date +%s)
CC=false CXX=false "$py" -m pip install --quiet --no-cache-dir "$wheel"
echo "installed $(basename "$wheel") in $(( $(date +%s) - start )) s (no compiler allowed)"
cd "$work"   # never import the source tree
"$py" - <<'EOF'
import pathlib, skippy
from skippy.runtime import ffi
from skippy.runtime.offload import devices
lib = pathlib.Path(skippy.__file__).parent / "lib"
built = sorted(p.name for p in lib.glob("libggml-*.so"))
print("package:", skippy.__file__)
print("built backends:", ", ".join(built))
assert "libggml-cuda.so" in built, "not a CUDA build"
print("cpu variant:", ffi.BACKENDS.cpu.name if ffi.BACKENDS else "linked in")
for device in devices():
    print(f"device {device.name}: {device.description} ({device.kind}, {device.memory_total >> 20} MiB)")
print("backend: cuda" if any(d.is_gpu for d in devices()) else "backend: cpu (no GPU visible: CUDA built, falling back)")
EOF
if "$py" -c "import sys; from skippy.runtime.offload import devices; sys.exit(0 if any(d.is_gpu for d in devices()) else 1)"; then
    "$py" -m pip install --quiet "pytest>=8" "pytest-trio>=0.8" "pytest-timeout>=2.3" hypothesis
    SKIPPY_GPU_REPORT="$out/gpu-report.json" "$py" -m pytest -c "$src/pyproject.toml" --rootdir "$src" \
        -m gpu -p no:cacheprovider -s -q "$src/tests/test_gpu.py" 2>&1 | tee "$out/pytest-gpu.log"
    cat "$out/gpu-report.json"
else
    "$py" - <<'EOF'
import subprocess, sys
import numpy as np
from skippy.models.cache import ensure_model
from skippy.models.spec import tiny
from skippy.runtime.local import LocalChain
path = ensure_model(tiny("llama", n_embd=128))
refused = subprocess.run([sys.executable, "-m", "skippy.stage", "--model", str(path), "--layers", "0:2",
                          "--downstream", "127.0.0.1:1", "--n-gpu-layers", "2"], capture_output=True, text=True)
assert refused.returncode != 0 and "needs a GPU" in refused.stderr, refused.stderr[-2000:]
print("a GPU-only setting is refused:", refused.stderr.strip().splitlines()[-1].split(": ", 2)[-1])
prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599]
def run(split):
    with LocalChain(path, split, n_ctx=64, max_sessions=1, n_batch=16) as chain:
        chain.decode(prompt, list(range(8)), [0] * 8, [True] * 8)
        return np.stack(chain.logits())
assert np.array_equal(run([(0, 2), (2, 4)]), run([(0, 4)]))
print("defaults fall back to the CPU: split = unsplit")
EOF
fi
echo "cuda wheel check ok"
