"""GPU kinds the planner knows, with vendor datasheet figures as defaults.

Every figure is a flag of `tools/plan.py` (`--gpu-memory-gib`,
`--nvlink-gbps`, `--ib-gbps`, `--hbm-gbps`, `--mfu`, `--nvlink-domain-size`), so a cluster
that differs (other NICs, a PCIe part, a measured MFU) plans with its own
numbers. Sources: NVIDIA's H100, H200, HGX B200 and GB200 NVL72 datasheets.

* memory: HBM per GPU in decimal GB (H200 "141 GB");
* bf16: dense (no sparsity) BF16 tensor-core peak, TFLOP/s;
* HBM: memory bandwidth, GB/s (what bounds a decode step of the rollout engine);
* NVLink: per GPU and direction, GB/s (half the datasheet's bidirectional
  900 GB/s for Hopper, 1.8 TB/s for Blackwell);
* InfiniBand: one 400 Gb/s NDR NIC per GPU (ConnectX-7), 50 GB/s per direction;
* NVLink domain: the GPUs one NVLink fabric joins (8 per HGX node; 72 in a
  GB200 NVL72 rack, whose trays hold 4).

MFU (model FLOPs over peak) is not a datasheet figure: 0.40 is a stated
assumption for a tuned MoE run, to be replaced by a measured value.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gb: float  # decimal GB
    bf16_tflops: float  # dense
    nvlink_gbps: float  # GB/s per direction
    ib_gbps: float  # GB/s per direction, per GPU
    hbm_gbps: float = 0.0  # GB/s
    nvlink_domain: Optional[int] = None  # GPUs per NVLink fabric; None: the node
    mfu: float = 0.40

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def replace(self, **changes) -> "GPUSpec":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("h100", memory_gb=80, bf16_tflops=989, nvlink_gbps=450, ib_gbps=50, hbm_gbps=3350),
    "h200": GPUSpec("h200", memory_gb=141, bf16_tflops=989, nvlink_gbps=450, ib_gbps=50, hbm_gbps=4800),
    "b200": GPUSpec("b200", memory_gb=180, bf16_tflops=2250, nvlink_gbps=900, ib_gbps=50, hbm_gbps=8000),
    "gb200": GPUSpec("gb200", memory_gb=186, bf16_tflops=2500, nvlink_gbps=900, ib_gbps=50, hbm_gbps=8000,
                     nvlink_domain=72),
}


def get_gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown --gpu {name!r}; choose one of: {', '.join(GPUS)} "
                         f"(or the closest one and override --gpu-memory-gib, --nvlink-gbps, --ib-gbps)") from None
