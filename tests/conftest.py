"""Shared fixtures: a real local Ray on 127.0.0.1, a real moto S3 server, small real data."""

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

# Ray reads this at import: every node it starts then advertises 127.0.0.1 (see shared NOTES).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # tests send nothing beyond loopback

import pytest  # noqa: E402

from rayllm.data.demo_corpus import stdlib_modules  # noqa: E402

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


def kill_actor_after(run_dir, step: int, class_name: str, killed: list) -> threading.Thread:
    """SIGKILL the process of an alive Ray actor of ``class_name`` once the run has logged ``step``."""
    from ray.util.state import list_actors

    def watch():
        deadline = time.time() + 300
        log = os.path.join(run_dir, "metrics.jsonl")
        while time.time() < deadline and not killed:
            if os.path.exists(log):
                with open(log) as f:
                    records = [json.loads(line) for line in f if line.strip()]
                if any(r.get("kind") == "train" and r["step"] >= step for r in records):
                    actors = list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])
                    if actors:
                        os.kill(actors[0].pid, signal.SIGKILL)
                        killed.append(actors[0].pid)
                        return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def s3_client(endpoint: str, key: str = "testing", secret: str = "testing"):
    """A boto3 S3 client for the moto server (which takes any credentials unless IAM is on)."""
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
    )


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


def checkpoint_registered(run_dir) -> bool:
    """Whether Ray Train has registered a checkpoint of the run yet (so a failure now resumes from one)."""
    try:
        with open(os.path.join(run_dir, "checkpoint_manager_snapshot.json")) as f:
            return bool(json.load(f).get("checkpoint_results"))
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small real corpus (standard-library modules) as 3 jsonl train shards and a parquet val shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    (root / "train").mkdir()
    (root / "val").mkdir()
    modules = stdlib_modules()[:240]
    shards = [open(root / "train" / f"part-{i}.jsonl", "w") for i in range(3)]
    val = []
    for i, path in enumerate(modules):
        text = path.read_text(encoding="utf-8", errors="replace")
        if i % 10 == 9:
            val.append({"text": text})
        else:
            shards[i % 3].write(json.dumps({"text": text}) + "\n")
    for f in shards:
        f.close()
    pq.write_table(pa.Table.from_pylist(val), root / "val" / "part-0.parquet")
    return root


@pytest.fixture(scope="session")
def tokenizer_file(corpus, tmp_path_factory) -> Path:
    from rayllm.data import tokenizer as tok
    from rayllm.data.shards import iter_documents
    from rayllm.io.settings import StorageSettings

    docs = list(iter_documents(str(corpus / "train" / "part-0.jsonl"), "text", StorageSettings()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.train_bpe(docs, 1024).save(str(path))
    return path


@pytest.fixture
def overrides(corpus, tokenizer_file, tmp_path) -> list[str]:
    """Overrides for a small, fast run on the test corpus in a fresh run dir."""
    return [
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        f"data.val={corpus / 'val'}",
        f"data.tokenizer={tokenizer_file}",
        f"run.dir={tmp_path / 'run'}",
        "data.demo_corpus=false",
    ]


@pytest.fixture(scope="session")
def ray_local():
    """One real local Ray instance on 127.0.0.1 for the whole session."""
    import ray

    ray.init(
        num_cpus=4,
        _node_ip_address="127.0.0.1",
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        logging_level="WARNING",
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server in server mode on 127.0.0.1 over HTTP; yields its endpoint URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("moto server did not start")
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)
