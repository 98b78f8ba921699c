"""``rayllm bench gpu``: the one-GPU run, kept from rotting by running its code on CPU in tiny mode
(gloo, fp32) under real torchrun, exactly as the GPU machine launches it."""

import json
import subprocess
import sys

import pytest
from helpers import free_port


def _bench(tmp_path, nproc: int) -> tuple[dict, str]:
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "rayllm.bench.gpu", "--tiny"]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _check_step(result: dict, world: int) -> None:
    step = result["step"]
    assert result["mode"] == "tiny" and result["backend"] == "gloo" and result["world_size"] == world
    assert step["tokens_per_s"] > 0 and 0 < step["mfu"]["measured"] <= 1
    assert step["mfu"]["measured_causal"] < step["mfu"]["measured"]  # attention counted twice as much
    assert step["memory"]["peak_allocated_bytes"] > 0 and step["memory"]["peak_reserved_bytes"] > 0
    assert "total_bytes" in step["memory"]["planner"] or "planner" in step["memory"]["planner"]["unavailable"]
    assert all(m["status"] == "ok" for m in result["mesh_smoke"].values()), result["mesh_smoke"]


def test_tiny_mode_on_one_rank_exercises_every_mesh_code_path(tmp_path):
    result, stdout = _bench(tmp_path, 1)
    _check_step(result, 1)
    assert "MFU per rank" in stdout and "mesh smoke" in stdout and "causal-halved" in stdout
    smoke = result["mesh_smoke"]
    assert set(smoke) == {"fsdp", "hsdp", "tp+fsdp"}
    # Same initial weights and batch on every path (TP's untied head starts from the same values).
    for name in ("hsdp", "tp+fsdp"):
        assert smoke[name]["losses"] == pytest.approx(smoke["fsdp"]["losses"], rel=1e-5)


def test_tiny_mode_on_two_ranks_runs_the_real_layouts(tmp_path):
    result, _ = _bench(tmp_path, 2)
    _check_step(result, 2)
    assert result["step"]["layout"] == "FSDP 2"
    smoke = result["mesh_smoke"]
    assert {name: m["what"] for name, m in smoke.items()} == {"fsdp2": "FSDP 2", "tp2": "TP 2", "hsdp2x1": "HSDP 2x1"}


def test_rayllm_bench_gpu_runs_it_in_process_without_torchrun(tmp_path):
    """The CLI runs the same main in its own process, which then sets up a 1-rank group itself."""
    out = tmp_path / "cli.json"
    cmd = [sys.executable, "-m", "rayllm.cli", "bench", "gpu", "--tiny", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_step(json.loads(out.read_text()), 1)


def test_the_prepared_gpu_check_runs_its_cpu_mode_with_every_item_named(tmp_path):
    """``rayllm bench gpu --check --tiny``: the GPU check's code on CPU; what a CPU can judge passes
    (the RoPE dtypes, bf16 against fp32, the meshes), the GPU-only items read n/a."""
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "rayllm.cli", "bench", "gpu", "--check", "--tiny", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = {v["name"]: v["status"] for v in json.loads(out.read_text())["verdicts"]}
    assert verdicts["RoPE tables reach the blocks in fp32"] == "PASS"
    assert verdicts["bf16 loss within 2% of fp32"] == "PASS" and verdicts["every mesh's steps"] == "PASS"
    assert verdicts["context parallelism's ring takes the bf16 GQA attention kernel"] == "PASS"  # the CPU kernel
    assert verdicts["compile and FSDP on NCCL"] == "n/a" and verdicts["MFU, 1B preset"] == "n/a"
    assert "[rayllm bench gpu --check]" in proc.stdout
