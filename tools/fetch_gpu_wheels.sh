#!/usr/bin/env bash
# Download the wheels `tools/gpu_check.sh` installs on a GPU machine that has
# PyTorch but no network: megatron-core 0.16.1 and the pure-Python (or small
# binary) packages our code and tests import, for the GPU machine's Python.
#
#   tools/fetch_gpu_wheels.sh [DIR] [PYTHON_VERSION]    (default: wheels 3.12)
#
# Transformer Engine is not among them (its wheels are hundreds of MB); on a
# cluster install it with `pip install -e '.[gpu]'` or use an NGC container.
set -euo pipefail
dir=${1:-wheels}
py=${2:-3.12}
mkdir -p "$dir"
pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp -d "$dir" \
    megatron-core==0.16.1 einops sentencepiece safetensors xxhash tqdm numpy packaging \
    pytest pluggy iniconfig pygments
du -sh "$dir"
ls "$dir"
