#!/usr/bin/env bash
# The GPU check, in one go, on a fresh single-GPU machine that has PyTorch
# (with CUDA) but none of our other dependencies and no network:
#
#   tools/fetch_gpu_wheels.sh wheels 3.12     # where there is network: ~22 MB of wheels
#   tools/gpu_check.sh [WHEEL_DIR]            # on the GPU machine (default: wheels)
#
# 1. installs, from the wheels it is handed, the packages of tools/gpu_wheels.txt
#    this Python cannot import (into a private directory put on PYTHONPATH; the
#    machine's torch stays);
# 2. prints the platform doctor (versions, GPU generation, FP8/FP4 recipes);
# 3. runs `pytest -m gpu` (the `te` tests skip where Transformer Engine is
#    absent; test modules whose optional dependencies are missing hold no GPU
#    test and are listed as not collected);
# 4. counts the host syncs of one training step (tests/test_host_syncs.py);
# 5. runs the GPU benchmarks: the small-preset CPT step at seq 4096 (ours, local
#    and TE, against megatron-core's GPTModel: tokens/s, step time, MFU, peak
#    memory) and the expert-GEMM / quantizer kernels;
# 6. ends with one summary line: the tests passed / failed / skipped, the host
#    syncs per step and the benchmark lines. Exit status 0 only if every step
#    passed and some GPU test passed.
#
# Budget: 470 s in all (GPU_CHECK_BUDGET_S), under 8 minutes on an H200; each
# step gets at most what is left. Logs and the JUnit report go to $OUT when it
# is set (else ./gpu_check_out). PYTHON picks the interpreter (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-wheels}
out=${OUT:-gpu_check_out}
mkdir -p "$out"
site=$(mktemp -d /tmp/mc-site.XXXXXX)
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MC_DIST_TEST_TIMEOUT=${MC_DIST_TEST_TIMEOUT:-300}
PY=${PYTHON:-python3}
start=$SECONDS
deadline=$((start + ${GPU_CHECK_BUDGET_S:-470}))
status=()

step() {  # step NAME LIMIT_S CMD...: run within the budget, tee the log, remember the result
    local name=$1 limit=$2 rc; shift 2
    local left=$((deadline - SECONDS))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
        status+=("$name: not run (budget spent)")
        return 1
    fi
    echo; echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    if declare -F "$1" >/dev/null; then "$@"; else timeout -k 10 "$limit" "$@"; fi 2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status+=("$name: ok") ;;
        124|137) status+=("$name: FAILED (timed out after ${limit}s)") ;;
        *) status+=("$name: FAILED (exit $rc)") ;;
    esac
    return "$rc"
}

install_missing() {  # the packages of tools/gpu_wheels.txt this Python cannot import
    local need=() module dist
    while read -r module dist; do
        "$PY" -c "import $module" 2>/dev/null || need+=("$dist")
    done < <(grep -v '^#' tools/gpu_wheels.txt | awk 'NF')
    if [ ${#need[@]} -eq 0 ]; then echo "all dependencies present"; return 0; fi
    if [ ! -d "$wheels" ]; then
        echo "missing ${need[*]} and no wheel directory '$wheels'; run tools/fetch_gpu_wheels.sh first"
        return 1
    fi
    echo "installing from $wheels: ${need[*]}"
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$wheels" --target "$site" "${need[@]}"
}

host_syncs() {  # run by `step`, whose `limit` it sees (bash locals are dynamically scoped)
    if [ ! -f tests/test_host_syncs.py ]; then echo "tests/test_host_syncs.py: not in this checkout"; return 1; fi
    timeout -k 10 "$limit" "$PY" -m pytest -q -s -p no:cacheprovider tests/test_host_syncs.py
}

pytest_counts() {  # "40 passed, 3 failed, 12 skipped[, 2 errors]" from pytest's last line in log $1
    local result kind n counts=""
    result=$(grep -hE "[0-9]+ (passed|failed|skipped|errors?|deselected).* in [0-9.]+s" "$1" 2>/dev/null | tail -1)
    [ -n "$result" ] || return 1
    for kind in passed failed skipped; do
        n=$(grep -oE "[0-9]+ $kind" <<<"$result" | cut -d' ' -f1)
        counts+="${n:-0} $kind, "
    done
    n=$(grep -oE "[0-9]+ errors?" <<<"$result")
    [ -n "$n" ] && counts+="$n, "
    echo "${counts%, }"
}

summary() {  # the one closing line, from the step results and the logs
    local tests syncs bench verdict failed=()
    tests=$(pytest_counts "$out/pytest-gpu.log") || tests="no pytest result"
    syncs=$(grep -hoE "host syncs per step: .*" "$out/host-syncs.log" 2>/dev/null | head -1)
    bench=$(grep -h "^gpu_step: " "$out/bench-gpu-step.log" 2>/dev/null | sed 's/^gpu_step: //' | paste -sd';' - \
            | sed 's/;/; /g')
    for s in "${status[@]}"; do [[ $s == *": ok" ]] || failed+=("${s%%:*}"); done
    [[ $tests == "0 passed"* || $tests == "no pytest result" ]] && failed+=("no gpu test passed")
    verdict="ok"
    ((${#failed[@]})) && verdict="FAILED ($(printf '%s, ' "${failed[@]}" | sed 's/, $//'))"
    echo "gpu check $verdict in $((SECONDS - start)) s | tests: $tests | ${syncs:-host syncs per step: not measured}" \
         "| ${bench:-no benchmark result}"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
if step install 60 install_missing; then
    step cuda 30 "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible: the gpu tests would all skip'; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'CUDA', torch.version.cuda)"
    step doctor 30 "$PY" -m megatron_composer.platform.doctor
    step pytest-gpu 210 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors \
        --junitxml "$out/gpu-tests.xml"
    step host-syncs 45 host_syncs
    step bench-gpu-step 150 "$PY" benchmarks/gpu_step.py --steps 8
    step bench-quant 40 "$PY" benchmarks/quant.py --device cuda
fi

echo; echo "=== steps"
printf '  %s\n' "${status[@]}"
grep -hE "^SKIPPED .*not collected" "$out/pytest-gpu.log" 2>/dev/null | sed 's/^/  /'
line=$(summary)
echo "$line"
[[ $line == "gpu check ok "* ]]
