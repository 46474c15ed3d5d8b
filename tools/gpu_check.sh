#!/usr/bin/env bash
# The GPU check, in one go, on a fresh single-GPU machine that has PyTorch
# (with CUDA) but none of our other dependencies and no network:
#
#   tools/fetch_gpu_wheels.sh wheels 3.12     # where there is network: ~22 MB of wheels
#   tools/gpu_check.sh [WHEEL_DIR]            # on the GPU machine (default: wheels)
#
# 1. installs the wheels it is handed for the packages this Python lacks
#    (into a private directory put on PYTHONPATH; the machine's torch stays);
# 2. prints the platform doctor (versions, GPU generation, FP8/FP4 recipes);
# 3. runs `pytest -m gpu` (the `te` tests skip where Transformer Engine is absent);
# 4. runs the GPU benchmarks: the small-preset CPT step (ours vs plain
#    megatron-core, tokens/s, memory, MFU) and the expert-GEMM / quantizer kernels;
# 5. prints a summary. Exit status 0 only if every step passed.
#
# Budget: under 8 minutes on an H200. Logs and the JUnit report go to $OUT
# when it is set (else ./gpu_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-wheels}
out=${OUT:-gpu_check_out}
mkdir -p "$out"
site=$(mktemp -d /tmp/mc-site.XXXXXX)
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MC_DIST_TEST_TIMEOUT=${MC_DIST_TEST_TIMEOUT:-300}
PY=${PYTHON:-python3}
status=()
start=$SECONDS

step() {  # step NAME TIMEOUT_S CMD...: run, tee the log, remember the result
    local name=$1 limit=$2; shift 2
    echo; echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    if declare -F "$1" >/dev/null; then "$@"; else timeout "$limit" "$@"; fi 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    status+=("$name: $([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)")")
    return "$rc"
}

install_missing() {
    # module:distribution pairs; only what this Python cannot import yet
    local need=()
    for pair in megatron.core:megatron-core==0.16.1 einops:einops sentencepiece:sentencepiece \
                safetensors:safetensors xxhash:xxhash tqdm:tqdm numpy:numpy packaging:packaging \
                pytest:pytest pluggy:pluggy iniconfig:iniconfig pygments:pygments; do
        "$PY" -c "import ${pair%%:*}" 2>/dev/null || need+=("${pair#*:}")
    done
    if [ ${#need[@]} -eq 0 ]; then echo "all dependencies present"; return 0; fi
    if [ ! -d "$wheels" ]; then
        echo "missing ${need[*]} and no wheel directory '$wheels'; run tools/fetch_gpu_wheels.sh first"
        return 1
    fi
    echo "installing from $wheels: ${need[*]}"
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$wheels" --target "$site" "${need[@]}"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
step install 120 install_missing || { printf '%s\n' "${status[@]}"; exit 1; }
step cuda 60 "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible: the gpu tests would all skip'; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'CUDA', torch.version.cuda)"
step doctor 60 "$PY" -m megatron_composer.platform.doctor
step pytest-gpu 330 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml "$out/gpu-tests.xml"
step bench-gpu-step 150 "$PY" benchmarks/gpu_step.py --steps 8
step bench-quant 90 "$PY" benchmarks/quant.py --device cuda

echo; echo "=== summary ($((SECONDS - start)) s)"
printf '  %s\n' "${status[@]}"
grep -E "passed|failed|error" "$out/pytest-gpu.log" | tail -1 | sed 's/^/  pytest: /'
grep -E "^SKIPPED" "$out/pytest-gpu.log" | sed 's/^/  /'
grep -hE "^(ratio|MFU|gpu|GPU)" "$out/bench-gpu-step.log" "$out/bench-quant.log" 2>/dev/null | sed 's/^/  /'
grep -qE "[0-9]+ passed" "$out/pytest-gpu.log" || { echo "  no gpu test passed"; exit 1; }
for s in "${status[@]}"; do [[ $s == *FAILED* ]] && exit 1; done
exit 0
