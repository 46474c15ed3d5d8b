#!/usr/bin/env bash
# Download the wheels `tools/gpu_check.sh` installs on a GPU machine that has
# PyTorch but no network: the distributions in tools/gpu_wheels.txt
# (megatron-core and the small packages our code and tests import), built for
# the GPU machine's Python.
#
#   tools/fetch_gpu_wheels.sh [DIR] [PYTHON_VERSION]    (default: wheels 3.12)
#
# Transformer Engine is not among them (its wheels are hundreds of MB); on a
# cluster install it with `pip install -e '.[gpu]'` or use an NGC container.
set -euo pipefail
here=$(dirname "$0")
dir=${1:-wheels}
py=${2:-3.12}
mkdir -p "$dir"
mapfile -t dists < <(grep -v '^#' "$here/gpu_wheels.txt" | awk 'NF { print $2 }')
pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp -d "$dir" "${dists[@]}"
du -sh "$dir"
ls "$dir"
