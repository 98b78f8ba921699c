"""``rayllm bench gpu`` without running it: it imports no Ray, its full mode trains the one-GPU config's
shape, and device names map to published peaks and planner keys (its tiny runs on CPU:
tests/integration/test_bench_gpu.py)."""

import subprocess
import sys

import torch

from rayllm.bench.gpu import bench_config, planner_gpu
from rayllm.config import TrainConfig
from rayllm.parallel.gpus import published_peak_flops

BF16 = torch.bfloat16


def test_importing_the_gpu_bench_imports_no_ray():
    code = "import sys, rayllm.bench.gpu; assert 'ray' not in sys.modules, sorted(m for m in sys.modules if 'ray' in m)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_full_mode_trains_the_one_gpu_config_shape():
    ours, shipped = bench_config(tiny=False, world=1), TrainConfig.from_yaml("configs/llama-1b-1gpu.yaml")
    assert ours.model == shipped.model
    assert ours.data.seq_len == shipped.data.seq_len == 4096
    assert (ours.train.global_batch_size, ours.train.micro_batch_size) == (32, shipped.train.micro_batch_size)
    assert ours.cluster.use_gpu and ours.train.precision == "auto" and ours.train.compile == "auto"


def test_published_peaks_and_planner_keys_by_device_name():
    assert published_peak_flops("NVIDIA H100 80GB HBM3", BF16) == published_peak_flops("NVIDIA H200", BF16) == 989e12
    assert published_peak_flops("NVIDIA H100 PCIe", BF16) is None
    assert published_peak_flops("NVIDIA A100-SXM4-80GB", BF16) == 312e12
    assert published_peak_flops("Tesla T4", BF16) is None and published_peak_flops(None, BF16) is None
    assert planner_gpu("NVIDIA H100 80GB HBM3") == "h100-80gb" and planner_gpu("NVIDIA H200") == "h200"
    assert planner_gpu("NVIDIA A100-SXM4-80GB") == "a100-80gb" and planner_gpu("NVIDIA A100-SXM4-40GB") is None
    assert planner_gpu("NVIDIA L40S") == "l40s" and planner_gpu("NVIDIA GH200 480GB") is None
