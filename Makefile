# Two entry points for a fresh machine (see README "Quick start"):
#   make demo       set up .venv and run the whole recipe at tiny scale (CPT, 256K, MTP, SFT, async RL)
#   make demo-cpt   set up .venv and run only the tiny 32K-stage CPT on the embedded code corpus
#   make test       set up .venv and run the test suite
#   make vllm-env   build vLLM's own venv (the vLLM rollout backend; tools/vllm_env.sh)
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: setup compressed-tensors bubblewrap demo demo-cpt test test-gpu doctor bench bench-gpu clean vllm-env

setup: bubblewrap $(STAMP)

# The RL sandbox (rl/sandbox.py) runs the policy's commands under bubblewrap; the
# demo's RL stage and the sandbox tests need it. As root a missing bwrap is
# installed; otherwise the set-up stops here and names the command.
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || { \
	    if [ "$$(id -u)" != 0 ]; then \
	        echo "bubblewrap (bwrap) is missing; the RL sandbox needs it. Run: sudo apt-get install -y bubblewrap" >&2; exit 1; \
	    elif ! command -v apt-get >/dev/null 2>&1; then \
	        echo "bubblewrap (bwrap) is missing and apt-get is not here; install the bubblewrap package with this system's package manager" >&2; exit 1; \
	    else \
	        echo "installing bubblewrap (the RL sandbox): apt-get install -y bubblewrap"; \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	    fi; }

# The CPU build of torch is pinned when no NVIDIA driver is present; a CUDA
# machine keeps (or installs) its own CUDA build.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet torch==2.13.0; fi
	$(PY) -m pip install --quiet -e '.[test,rl]'
	$(MAKE) --no-print-directory compressed-tensors
	touch $(STAMP)

# Kimi K2.5's INT4 experts (convert/int4.py): without its dependencies, which setup.py's [test]
# extra lists, so its `torch>=2.10` never replaces the torch installed above. It needs Python 3.11.
compressed-tensors:
	@if $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	    $(PY) -m pip install --quiet --no-deps 'compressed-tensors>=0.20'; \
	else echo "compressed-tensors needs Python >= 3.11: Kimi K2.5 INT4 conversion and its tests are skipped"; fi

# about 10 minutes on 2 CPU cores; the report is runs/demo/report.md
demo: bubblewrap $(STAMP)
	bash examples/tiny/recipe.sh

demo-cpt: $(STAMP)
	bash examples/tiny/cpt_32k.sh

# The CPU suite stays on CPU (gloo) on a GPU machine too; `make test-gpu` is the device suite.
# TEST_WORKERS pytest-xdist workers; tests/scheduling.py splits the cores between them and groups the tests.
TEST_WORKERS ?= 2
test: bubblewrap $(STAMP)
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q --durations=25 -m "not gpu" -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test-gpu: $(STAMP)
	$(PY) -m pytest -q -rs -m gpu --continue-on-collection-errors

# vLLM in a venv of its own (default ~/.cache/megatron-composer/vllm-env, VLLM_ENV=... elsewhere), built
# once: train_rl.py --rollout-backend vllm --vllm-python <it>/bin/python, and the `vllm` tests.
vllm-env:
	bash tools/vllm_env.sh

doctor: $(STAMP)
	$(PY) -m megatron_composer.platform.doctor

bench: $(STAMP)
	$(PY) benchmarks/cpt_throughput.py

bench-gpu: $(STAMP)
	$(PY) benchmarks/gpu_step.py

clean:
	rm -rf runs data checkpoints
