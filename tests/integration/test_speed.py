"""Speed and memory options: activation checkpointing, compile and CPU offload change how a
step runs, never what it computes; and ``rayllm bench speed`` runs with no Ray installed."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import TEST_MODEL

from rayllm import TrainConfig
from rayllm.bench.speed import run_ranks


def _config(*overrides: str) -> TrainConfig:
    return TrainConfig.from_dict({}, overrides=[*TEST_MODEL, "train.lr=1e-2", "train.compile=false", *overrides])


def test_activation_checkpointing_gives_the_same_losses_as_the_plain_run_on_two_ranks():
    plain = run_ranks(_config(), world_size=2, steps=4, threads=1)
    checkpointed = run_ranks(_config("train.activation_checkpointing=true"), world_size=2, steps=4, threads=1)
    assert plain["losses"][-1] < plain["losses"][0] - 0.05  # it trains, so equal losses mean something
    assert checkpointed["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def test_compiled_blocks_give_the_same_losses_as_eager_on_two_ranks():
    eager = run_ranks(_config(), world_size=2, steps=3, threads=1)
    compiled = run_ranks(_config("train.compile=true", "train.activation_checkpointing=true"), 2, steps=3, threads=1)
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"]], ids=["tp2", "pp2"])
def test_the_benchmarks_feed_tp_peers_and_pipeline_stages_one_data_slice(layout):
    """The benchmarks' ranks take their layout's data slice (DataSlicing): TP 2 and PP 2 on two
    ranks train like one process, which they would not with a slice each."""
    one = run_ranks(_config(), world_size=1, steps=3, threads=1)
    two = run_ranks(_config(*layout), world_size=2, steps=3, threads=1)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP's CPU offload moves GPU state: needs a GPU")
def test_cpu_offload_gives_the_same_losses_as_the_plain_run():
    gpu = ["cluster.use_gpu=true", "train.precision=fp32"]
    plain = run_ranks(_config(*gpu), world_size=1, steps=4)
    offloaded = run_ranks(_config(*gpu, "train.cpu_offload=true"), world_size=1, steps=4)
    assert plain["losses"][-1] < plain["losses"][0] - 0.05
    assert offloaded["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def test_bench_speed_runs_without_ray_and_reports_ratio_mfu_workers_and_memory(tmp_path):
    out = tmp_path / "speed.json"
    blocked = "import sys\nfor m in ('ray', 'aim', 'pyarrow', 's3fs'): sys.modules[m] = None\n"
    # Small weights, long sequences: activations dominate, so checkpointing them shows.
    shape = [*TEST_MODEL, "model.dim=128", "model.n_layers=4", "data.seq_len=256", "train.micro_batch_size=4"]
    runs = ["--rounds", "2", "--steps", "1", "--memory-steps", "2"]
    args = ["configs/tiny.yaml", *shape, *runs, "--json", str(out)]
    code = blocked + f"from rayllm.bench.speed import main\nsys.exit(main({args!r}))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "speed ratio rayllm / bare" in proc.stdout and "MFU: rayllm" in proc.stdout
    result = json.loads(out.read_text())
    step = result["step"]
    assert step["ratio"] > 0 and 0 < step["mfu"] < 1.5
    assert set(result["workers"]["tokens_per_s"]) == {"1", "2"}
    memory = result["memory"]
    full, selective, plain = (
        memory[k]["peak_bytes"] for k in ("activation checkpointing", "selective checkpointing", "plain")
    )
    assert full < selective < plain  # selective keeps the matmuls' outputs, full only each block's input
    for variant in ("activation checkpointing", "selective checkpointing"):
        assert memory[variant]["losses"] == pytest.approx(memory["plain"]["losses"], rel=1e-5)
    assert "needs a GPU" in memory["cpu offload"]["skipped"]
