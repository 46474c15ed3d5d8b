"""Install megatron-composer.

On a machine without CUDA the CPU build of torch is pinned (`torch==2.13.0`)
and so is megatron-core, to the one release whose internals the CPU backend
(`megatron_composer.platform.cpu`) is checked against. A CUDA machine keeps
the torch and megatron-core it has within the range the code runs with
(`megatron_composer.platform.versions` says why: torch 2.9 for
`torch._grouped_mm`, megatron-core 0.16.1 checked and 0.17 - 0.19 accepted).
"""
import os
import shutil

from setuptools import find_packages, setup


def _has_cuda() -> bool:
    if os.environ.get("MEGATRON_COMPOSER_FORCE_CPU") == "1":
        return False
    return shutil.which("nvidia-smi") is not None or os.path.exists("/proc/driver/nvidia")


CUDA = _has_cuda()
TORCH = "torch>=2.9" if CUDA else "torch==2.13.0"
MEGATRON_CORE = "megatron-core>=0.16.1,<0.20" if CUDA else "megatron-core==0.16.1"

setup(
    name="megatron-composer",
    version="0.1.0",
    description="Megatron-core trainer for the Composer 2 / 2.5 coding-model recipe "
    "(MLA + MoE + MTP, CPT, long-context SFT, async agentic RL)",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_composer", "megatron_composer.*"]),
    py_modules=["pretrain_cpt", "train_rl"],
    # The feature-deletion family's code base: plain files, not packages of ours.
    package_data={"megatron_composer.rl.tasks.coding": ["codebase/*.py", "codebase/*/*.py"],
                  # the hand-written example of --task-file
                  "megatron_composer.rl.tasks": ["examples/*.jsonl", "examples/swe/*.jsonl", "examples/swe/*/*/*.py"]},
    install_requires=[
        TORCH,
        MEGATRON_CORE,
        "packaging",  # platform/versions.py
        "numpy",
        "einops",
        "sentencepiece",
        "safetensors",
        "tensorboard",
        "tqdm",
        "xxhash",  # checkpoint file checksums
        "fastapi",  # inference/server.py
        "uvicorn",
        "matplotlib",  # PNG plots in run directories (RL reward curve)
        "pyflakes",  # rl/agentic_rewards.py: the style reward term
        "rapidfuzz",  # eval/edits.py: character-level edit distance (state tracking)
        "tiktoken",  # data/tiktoken_tokenizer.py: Kimi K2.5's tokenizer, read without remote code
        "pyarrow",  # rl/tasks/task_files.py: --task-file parquet shards
    ],
    extras_require={
        # triton: the quantization kernels' tests run through its CPU interpreter; CUDA builds of
        # torch already ship a triton, which this leaves as it is.
        # pytest-xdist: `make test` runs the suite on two workers
        # loguru, psutil: what compressed-tensors (Kimi K2.5's INT4 experts, convert/int4.py) imports
        # besides torch, transformers and pydantic. compressed-tensors itself is installed by
        # `make setup` with --no-deps: its `torch>=2.10` would otherwise replace the torch here.
        "test": ["pytest", "pytest-xdist", "transformers", "triton>=3.0; platform_system == 'Linux'",
                 "openai", "schemathesis", "hypothesis", "httpx", "ray", "loguru", "psutil"],
        # megatron-core 0.16.1 declares 2.9 - 2.11; newer releases (current NGC containers) are kept,
        # and the doctor notes them. Never the PyPI package named `apex`: it is an unrelated project.
        "gpu": ["transformer-engine[pytorch]>=2.9", "pyyaml"],
        # optional: megatron-core imports wandb whenever it is installed (~1 s per process)
        "wandb": ["wandb"],
        "rl": ["ray"],
    },
    entry_points={"console_scripts": ["megatron-composer-cpt=pretrain_cpt:main"]},
)
