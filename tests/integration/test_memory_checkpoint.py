"""In-memory checkpoint files (rayllm/checkpoint/memory.py) on a real local Ray: the keepers'
filesystem behaves as fsspec for what the checkpoint code uses, DCP saves and loads through it,
and the files outlive the process that wrote them."""

from __future__ import annotations

import uuid

import pytest
import torch


@pytest.fixture
def mem_root(ray_local):
    from rayllm.checkpoint import memory

    memory.register()
    name = f"rayllm-keepers-{uuid.uuid4().hex[:8]}"
    registry = memory.start_registry(name)
    yield memory.memory_uri(name, "run")
    ray_local.kill(registry)


def test_keeper_files_behave_as_a_filesystem(mem_root):
    import fsspec

    fs, root = fsspec.core.url_to_fs(mem_root)
    fs.makedirs(f"{root}/checkpoint_00000002", exist_ok=True)
    fs.pipe_file(f"{root}/checkpoint_00000002/state.json", b'{"step": 2}')
    with fs.open(f"{root}/checkpoint_00000002/shard.bin", "wb") as f:
        f.write(b"x" * 1000)
    fs.pipe_file(f"{root}/checkpoint_00000004/state.json", b"{}")
    assert fs.cat_file(f"{root}/checkpoint_00000002/state.json") == b'{"step": 2}'
    assert fs.ls(root, detail=False) == [f"{root}/checkpoint_00000002", f"{root}/checkpoint_00000004"]
    assert fs.info(f"{root}/checkpoint_00000002/shard.bin")["size"] == 1000
    assert fs.isdir(f"{root}/checkpoint_00000002") and fs.exists(f"{root}/checkpoint_00000004/state.json")
    assert not fs.exists(f"{root}/checkpoint_00000004/missing")
    fs.mv(f"{root}/checkpoint_00000004", f"{root}/checkpoint_00000006")
    fs.rm(f"{root}/checkpoint_00000002", recursive=True)
    assert fs.ls(root, detail=False) == [f"{root}/checkpoint_00000006"]
    assert fs.usage(root) == 2
    # Full URIs too (DCP's writer removes a stale .metadata by its URI when a step is saved again).
    fs.pipe_file(f"{mem_root}/checkpoint_00000006/.metadata", b"old")
    assert fs.exists(f"{mem_root}/checkpoint_00000006/.metadata")
    fs.rm_file(f"{mem_root}/checkpoint_00000006/.metadata")
    assert not fs.exists(f"{mem_root}/checkpoint_00000006/.metadata")
    assert fs.usage(mem_root) == 2


def test_dcp_saves_and_loads_through_the_keepers_from_another_process(mem_root, ray_local):
    import ray
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    uri = f"{mem_root}/checkpoint_00000001"
    state = {"w": torch.randn(64, 32), "b": torch.arange(10.0)}

    @ray.remote(num_cpus=0)
    def save_elsewhere(uri, state):  # a process that ends: the keepers still hold its files
        from rayllm.checkpoint import memory

        memory.register()
        dcp.save(state, storage_writer=FsspecWriter(uri), no_dist=True)
        return True

    assert ray.get(save_elsewhere.remote(uri, state), timeout=120)
    loaded = {"w": torch.zeros(64, 32), "b": torch.zeros(10)}
    dcp.load(loaded, storage_reader=FsspecReader(uri), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])


def test_bench_keepers_times_both_sides_on_two_nodes(tmp_path):
    """python -m rayllm.bench.keepers on a two-node cluster of this machine: both sides timed and
    their ratio reported."""
    import json
    import subprocess
    import sys

    out = tmp_path / "keepers.json"
    cmd = [sys.executable, "-m", "rayllm.bench.keepers", "--writers=2", "--mb=4", "--rounds=1", f"--json={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["writers"], result["mb_per_writer"]) == (2, 4)
    assert result["seconds"]["keepers"] > 0 and result["seconds"]["floor"] > 0
    assert result["ratio_keepers_over_floor"] == result["seconds"]["keepers"] / result["seconds"]["floor"]
