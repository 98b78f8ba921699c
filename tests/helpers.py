"""Plain helpers both tiers import (``from helpers import ...``; pyproject puts tests/ on the path):
commands for torchrun, the CLI and `ray start`, a moto S3 client, a stand-in Hugging Face folder,
and the reader of a run's metrics.jsonl (rayllm.bench.common's). Fixtures live in conftest.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from rayllm.bench.common import read_records  # noqa: F401  (the tests take it from here)

REPO = Path(__file__).resolve().parents[1]  # the repository root: configs/, cluster/, jobs/ are under it

TEST_MODEL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=1024",
    "data.seq_len=64",
    "data.tokenizer_sample_docs=200",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.warmup_steps=2",
    "train.val_batches=2",
    "train.lr=3e-3",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a run's records (read_records: rayllm.bench.common's) ----------------------------------------
def quiet_run(overrides: list[str]) -> list[str]:
    """The session's test-model overrides, less their run dir, for a run whose losses are compared:
    a loss every step, no validation, checkpoint, samples or tracking, on CPU."""
    return [o for o in overrides if not o.startswith("run.dir=")] + [
        "train.log_every=1",
        "train.val_every=100",
        "train.checkpoint_every=100",
        "train.sample_tokens=0",
        "tracking.enabled=false",
        "cluster.use_gpu=false",
    ]


def losses(records: list[dict]) -> dict[int, float]:
    """Each logged training step's loss."""
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def val_losses(records: list[dict]) -> dict[int, float]:
    """Each validation's loss, by step."""
    return {r["step"]: r["val_loss"] for r in records if r["kind"] == "val"}


def assert_close(a: dict[int, float], b: dict[int, float], steps) -> None:
    """Losses of two runs within the parity bound (relative 1e-4) at each of ``steps``."""
    for step in steps:
        assert abs(a[step] - b[step]) / b[step] <= 1e-4, (step, a[step], b[step])


def walk_layouts(run: list[str], legs: list[str], table: dict, leg_steps: int, run_dir, one: list[dict]) -> None:
    """One training run through ``legs`` under torchrun, ``leg_steps`` steps each, each leg resuming
    the previous one's checkpoint in ``run_dir``; ``table``: name -> (ranks, overrides, the layout
    the run reports). Every step's loss is the 1-process run's (``one``: its records), and so is
    each leg's last validation loss when the 1-process run validated there."""
    one_val = val_losses(one)
    for i, name in enumerate(legs):
        nproc, layout, described = table[name]
        stop = leg_steps * (i + 1)
        records = torchrun_records(nproc, [*run, *layout, f"run.dir={run_dir}", f"train.stop_at_step={stop}"])
        start = [r for r in records if r["kind"] == "start"][-1]
        assert (start["step"], start["world_size"], start["layout"]) == (stop - leg_steps, nproc, described)
        trained = records[records.index(start) :]
        assert sorted(losses(trained)) == list(range(stop - leg_steps + 1, stop + 1)), name
        assert_close(losses(trained), losses(one), losses(trained))
        if stop in one_val:
            assert stop in val_losses(trained), name
            assert_close(val_losses(trained), one_val, [stop])


def checkpoint_registered(run_dir) -> bool:
    """Whether Ray Train has registered a checkpoint of the run yet (so a failure now resumes from one)."""
    try:
        with open(os.path.join(run_dir, "checkpoint_manager_snapshot.json")) as f:
            return bool(json.load(f).get("checkpoint_results"))
    except (OSError, ValueError):
        return False


# -- commands ----------------------------------------------------------------------------------------
def torchrun_cmd(nproc: int, overrides: list[str], config: str = "configs/tiny.yaml") -> list[str]:
    """The command for rayllm's loop under real torchrun: nproc gloo ranks on 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "rayllm.runtime.torchrun",
        config,
        *overrides,
    ]


def torchrun_probe(script: Path, nproc: int, out: Path, *args: str) -> list[dict]:
    """A probe script (beside its test) on ``nproc`` torchrun ranks on loopback, each writing
    ``rank<r>.json`` under ``out`` (its ``PROBE_OUT``): the records, by rank."""
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PROBE_OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def torchrun_records(
    nproc: int, overrides: list[str], env: dict[str, str] | None = None, fails: bool = False
) -> list[dict]:
    """Run ``torchrun_cmd``; its run dir's records, then one of kind "output" with its stdout and stderr."""
    cmd = torchrun_cmd(nproc, overrides)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert (proc.returncode != 0) == fails, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run.dir="))
    return [*read_records(run_dir), {"kind": "output", "stdout": proc.stdout, "stderr": proc.stderr}]


def cli_train_cmd(corpus, tokenizer_file, run_dir, *extra: str) -> list[str]:
    """``rayllm train`` as a subprocess on the small test model and corpus, with ``extra`` overrides."""
    return [
        sys.executable,
        "-m",
        "rayllm.cli",
        "train",
        "configs/tiny.yaml",
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        "data.val=null",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        f"run.dir={run_dir}",
        *extra,
    ]


def run_cli_train(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m rayllm.cli train *args`, finished, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rayllm.cli", "train", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def assert_clear_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A refusal of bad input: exit code 2, no traceback, a last line naming every needle, no worker started."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("rayllm: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in message, message
    assert "starting at step" not in proc.stdout  # failed before any worker started


def hf_folder(path, max_positions: int = 128, **changes) -> str:
    """A transformers-style Llama folder holding only its config.json (and a stand-in tokenizer.json)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
        **changes,
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def s3_client(endpoint: str, key: str = "testing", secret: str = "testing"):
    """A boto3 S3 client for the moto server (which takes any credentials unless IAM is on)."""
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
    )


# -- Ray ---------------------------------------------------------------------------------------------
def kill_actor_after(run_dir, step: int, class_name: str, killed: list) -> threading.Thread:
    """SIGKILL the process of an alive Ray actor of ``class_name`` once the run has logged ``step``."""
    from ray.util.state import list_actors

    def watch():
        deadline = time.time() + 300
        while time.time() < deadline and not killed:
            if any(r["step"] >= step for r in read_records(run_dir, "train")):
                actors = list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])
                if actors:
                    os.kill(actors[0].pid, signal.SIGKILL)
                    killed.append(actors[0].pid)
                    return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def ray_head_command(temp_dir, gcs_address: str, dashboard_port: int, *extra: str) -> list[str]:
    """`ray start --head` on 127.0.0.1 with a temp dir and ports of its own: the test session's
    local Ray holds the defaults. Stop it with ``kill_ray_head`` (`ray stop` ends every Ray)."""
    return [
        "ray",
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs_address.rsplit(':', 1)[1]}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *extra,
    ]


@contextlib.contextmanager
def ray_head(temp_dir, *extra: str, env: dict[str, str] | None = None, port: int | None = None):
    """A `ray start --head` of its own (``ray_head_command``), without auth; yields (gcs address, env)."""
    gcs = f"127.0.0.1:{port or free_port()}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))},
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        **(env or {}),
    }
    started = subprocess.run(
        ray_head_command(temp_dir, gcs, free_port(), *extra), env=env, capture_output=True, text=True, timeout=180
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield gcs, env
    finally:
        kill_ray_head(temp_dir, gcs)


def kill_ray_head(temp_dir, gcs_address: str) -> None:
    """SIGKILL the processes of the head started by ``ray_head_command`` and their children."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(temp_dir) in cmdline or gcs_address in cmdline:
            found.append(proc)
            try:
                found.extend(proc.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    for proc in found:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def run_cluster_scenarios(args: dict, timeout_s: float) -> tuple[dict, str]:
    """Run ray_cluster_scenarios.py in a session of its own (its simulated cluster never meets this
    test session's Ray); (each scenario's records, its output). Past ``timeout_s``: SIGTERM first,
    so the script shuts its cluster down, whose processes would otherwise outlive it and be found
    by the next ray.init on this machine; then SIGKILL."""
    import pytest

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    script = REPO / "tests" / "integration" / "ray_cluster_scenarios.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"the cluster scenarios ran past {timeout_s:,.0f} s:\n" + stdout[-3000:] + stderr[-5000:])
    lines = [line for line in stdout.splitlines() if line.startswith("SCENARIOS ")]
    assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-5000:]
    return json.loads(lines[-1].removeprefix("SCENARIOS ")), stdout + stderr
