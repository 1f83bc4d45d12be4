#!/usr/bin/env bash
# cibuildwheel's before-all in the manylinux_2_28 container (AlmaLinux 8): the tools the native build
# needs, the CUDA 13 toolkit from NVIDIA's RHEL 8 repository for the cu130 flavour, then the ONE
# native build of the flavour (scripts/release.py native) that every CPython's wheel links against.
# usage: scripts/cibw_before_all.sh cpu|cu130
set -euo pipefail
flavour=$1
python=/opt/python/cp312-cp312/bin/python
dnf install -y -q patch
if [ "$flavour" = cu130 ]; then
    dnf install -y -q dnf-plugins-core
    dnf config-manager --add-repo https://developer.download.nvidia.com/compute/cuda/repos/rhel8/x86_64/cuda-rhel8.repo
    dnf install -y -q cuda-nvcc-13-0 cuda-cudart-devel-13-0 libcublas-devel-13-0
    export CUDA_HOME=/usr/local/cuda-13.0
fi
"$python" -m pip install --quiet cmake ninja
PATH="$(dirname "$python"):$PATH" "$python" scripts/release.py native "$flavour"
