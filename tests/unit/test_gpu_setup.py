"""What a GPU rank's process is set up with, checked without a GPU: the allocator's and NCCL's
environment on both entry points, and Python's garbage collected on the loop's schedule."""

from __future__ import annotations

import gc

import pytest

from rayllm import TrainConfig
from rayllm.loop.gc_schedule import FULL_EVERY_STEPS, YOUNG_EVERY_STEPS, GarbageSchedule
from rayllm.parallel.process_group import gpu_env
from rayllm.runtime.launch import _thread_env


def test_gpu_workers_get_expandable_segments_and_the_flight_recorder_unless_the_user_set_them(monkeypatch):
    config = TrainConfig.from_dict({}, overrides=["cluster.use_gpu=true"])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    env = _thread_env(config)  # Ray's workers: in their runtime env, before Ray Train starts CUDA
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert "OMP_NUM_THREADS" not in env
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert _thread_env(config)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert gpu_env()["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # torchrun's ranks: local_device
    cpu = _thread_env(TrainConfig.from_dict({}, overrides=["cluster.use_gpu=false"]))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in cpu and cpu["OMP_NUM_THREADS"]


class Cycle:
    def __init__(self):
        self.me = self


def test_garbage_is_collected_on_the_loops_schedule_only():
    assert gc.isenabled()
    with GarbageSchedule() as collector:
        assert not gc.isenabled()
        before = gc.get_count()[0]
        for _ in range(5000):  # far past the automatic collector's threshold: it would have run
            Cycle()
        assert gc.get_count()[0] >= before + 5000
        collector.after_step(YOUNG_EVERY_STEPS - 1)
        assert gc.get_count()[0] >= before + 5000
        collector.after_step(YOUNG_EVERY_STEPS)
        assert gc.get_count()[0] < 100  # generations 0 and 1 collected
        collector.after_step(FULL_EVERY_STEPS)
        assert gc.get_count() == (0, 0, 0) or gc.get_count()[2] == 0
    assert gc.isenabled()


def test_mfu_is_against_the_published_peak_where_the_gpu_is_known_and_the_measured_one_beside_it():
    import types

    import numpy as np
    import torch

    from rayllm.loop.metrics import MetricWindow, PeakFlops
    from rayllm.parallel.gpus import published_peak_flops

    assert published_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert published_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert published_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) is None  # not what the figure counts
    assert published_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) is None  # another part: no entry
    assert published_peak_flops(None, torch.bfloat16) is None  # a CPU
    config = TrainConfig.from_yaml("configs/tiny.yaml", overrides=["tracking.enabled=false"])
    session = types.SimpleNamespace(
        world_size=2,
        device=torch.device("cpu"),
        train_spec=types.SimpleNamespace(sources=[types.SimpleNamespace(name="a")]),
    )
    # An H100 pair whose matmuls reach 750 of the published 989 TFLOP/s each.
    window = MetricWindow(config, session, 1e9, PeakFlops(measured=2 * 750e12, published=2 * 989e12), 0, np.zeros(1))
    window.add(3.0, 1.0)
    metrics, _ = window.summary(step=1, lr=1e-3, tokens=64, skipped_shards=0, counts=np.array([1]), collective_frac=0)
    assert metrics["mfu"] == pytest.approx(metrics["flops_per_s"] / (2 * 989e12))
    assert metrics["mfu_measured"] == pytest.approx(metrics["mfu"] * 989 / 750)
    cpu = PeakFlops(measured=1e11)
    assert cpu.basis == 1e11
