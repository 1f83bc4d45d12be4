#!/usr/bin/env bash
# Check a CPU wheel the way a user installs it: a fresh virtualenv of the given Python, no compiler
# (CC=false CXX=false: every dependency must come as a wheel), no pip cache (--no-cache-dir), then
# scripts/check_wheel.py from outside the source tree (`python -m skippy.stage --help`, the `skippy`
# command, a 2-stage split decode bitwise equal to the unsplit one).
# usage: scripts/check_wheel.sh dist/skippy_llm-*-cp312-*.whl [python3.12]
# With INDEX=<url or dir> the wheel is instead installed by name (`pip install skippy-llm`) from that
# index, as the README documents for the CUDA wheels' index.
set -euo pipefail
wheel=$(readlink -f "$1")
python=${2:-${PYTHON:-python3}}
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
py="$work/venv/bin/python"
start=$(date +%s)
if [ -n "${INDEX:-}" ]; then
    case "$INDEX" in /*) INDEX="file://$INDEX" ;; esac
    target=(--extra-index-url "$INDEX" "skippy-llm==$(basename "$wheel" | cut -d- -f2)")
else
    target=("$wheel")
fi
env -u PYTHONPATH CC=false CXX=false PIP_NO_CACHE_DIR=1 "$py" -m pip install --quiet --no-cache-dir "${target[@]}"
echo "installed $(basename "$wheel") into a fresh $("$py" -c 'import sys; print(sys.version.split()[0])') venv in $(( $(date +%s) - start )) s (no compiler, no pip cache)"
cd "$work"   # never import the source tree
env -u PYTHONPATH SKIPPY_MODEL_CACHE="$work/models" "$py" "$src/scripts/check_wheel.py"
