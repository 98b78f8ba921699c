"""Published figures of the GPUs ``rayllm plan`` knows: memory, dense bf16 matmul peak, links."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIB = 2**20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int  # what the driver reports as total (nvidia-smi), before the CUDA context
    bf16_dense_flops: float  # datasheet tensor-core peak, without sparsity
    intra_node_bytes_per_s: float  # GPU to GPU inside a node, per GPU, one direction (NVLink; PCIe on L40S)
    inter_node_bytes_per_s: float  # per GPU, one direction, on a typical cluster of such nodes


GPUS: dict[str, GpuSpec] = {
    # H100 SXM5 80GB: 989 TFLOP/s dense bf16, NVLink 4 at 900 GB/s both ways; 8x400 Gb/s per node
    # (p5.48xlarge's 3,200 Gb/s EFA, DGX H100's ConnectX-7): 50 GB/s per GPU.
    "h100-80gb": GpuSpec("h100-80gb", 81559 * MIB, 989e12, 450e9, 50e9),
    # The same H100 on GCP's a3-highgpu-8g: GPUDirect-TCPX over 4x200 Gb/s NICs per node, 12.5 GB/s per GPU.
    "h100-80gb-tcpx": GpuSpec("h100-80gb-tcpx", 81559 * MIB, 989e12, 450e9, 12.5e9),
    # H200 SXM 141GB: the H100's compute and NVLink with 141 GB of HBM3e.
    "h200": GpuSpec("h200", 143771 * MIB, 989e12, 450e9, 50e9),
    # A100 SXM4 80GB: 312 TFLOP/s dense bf16, NVLink 3 at 600 GB/s both ways; DGX A100: 8x200 Gb/s HDR.
    "a100-80gb": GpuSpec("a100-80gb", 81920 * MIB, 312e12, 300e9, 25e9),
    # L40S 48GB: 362 TFLOP/s dense bf16, no NVLink (PCIe 4.0 x16, 32 GB/s one way); 100 Gb/s per GPU.
    "l40s": GpuSpec("l40s", 46068 * MIB, 362e12, 32e9, 12.5e9),
}


def for_device(name: str | None) -> GpuSpec | None:
    """The entry for a CUDA device name (``torch.cuda.get_device_name``); None for a CPU or a GPU
    without one (PCIe and NVL H100s, GH200 and 40 GB A100s differ from the SXM parts above)."""
    n = (name or "").lower()
    if any(part in n for part in ("gh200", "nvl", "pcie")):
        return None
    for part, key in (("h200", "h200"), ("h100", "h100-80gb"), ("l40s", "l40s")):
        if part in n:
            return GPUS[key]
    return GPUS["a100-80gb"] if "a100" in n and "80gb" in n else None


def published_peak_flops(device_name: str | None, dtype: torch.dtype) -> float | None:
    """The GPU's datasheet dense bf16 peak, MFU's conventional denominator; None on a CPU, on a
    GPU without an entry, or for fp32 training (not what the figure counts)."""
    spec = for_device(device_name) if device_name and dtype == torch.bfloat16 else None
    return spec.bf16_dense_flops if spec else None
