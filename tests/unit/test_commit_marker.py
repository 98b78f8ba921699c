"""The commit marker lists every part with its size, and every reader checks them (store.py);
a re-save unmarks first; the in-memory store keeps the step just written; milestone copies cut
off are finished, never nested. Real DCP checkpoints of a small model in one process."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from rayllm import checkpoint, events
from rayllm.checkpoint.checkpointer import Checkpointer
from rayllm.checkpoint.memory import check_memory_budget, memory_checkpoint_bytes_per_node
from rayllm.checkpoint.state import TrainState
from rayllm.config import TrainConfig
from rayllm.errors import CheckpointError, ConfigError
from rayllm.io.settings import StorageSettings

STORAGE = StorageSettings()


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()  # the moments exist: the checkpoint holds them
    return model, optimizer


def _commit(store: checkpoint.CheckpointStore, step: int, model, optimizer, owner: str = "run-a") -> str:
    """What the checkpointer does for one rank: shards, rank 0's state, the marker."""
    checkpoint.save(store.uri(step), STORAGE, model, optimizer)
    store.write_state(step, TrainState(step=step, consumed=8 * step), '{"tokenizer": 1}')
    store.mark_complete(step, world_size=1, owner=owner)
    return store.uri(step)


def _shard(folder: str) -> Path:
    return next(Path(folder).glob("*.distcp"))


@pytest.fixture
def run(tmp_path):
    store = checkpoint.CheckpointStore(str(tmp_path / "run"), STORAGE)
    model, optimizer = _model()
    return store, model, optimizer


def test_the_marker_lists_every_part_with_its_size_and_the_owner(run):
    store, model, optimizer = run
    folder = _commit(store, 10, model, optimizer)
    marker = json.loads((Path(folder) / checkpoint.COMMIT_FILE).read_text())
    on_disk = {p.name: p.stat().st_size for p in Path(folder).iterdir() if p.name != checkpoint.COMMIT_FILE}
    assert marker["parts"] == on_disk and ".metadata" in on_disk and checkpoint.STATE_FILE in on_disk
    assert marker["owner"] == "run-a"
    assert not [p for p in Path(folder).iterdir() if ".tmp" in p.name]  # small files renamed into place


def test_a_truncated_part_is_refused_by_name_and_resume_falls_back(run):
    store, model, optimizer = run
    _commit(store, 5, model, optimizer)
    folder = _commit(store, 10, model, optimizer)
    shard = _shard(folder)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])  # an upload cut short, a disk that filled
    expected = f"checkpoint_00000010 is incomplete: {shard.name} is {size // 2} bytes, the marker says {size}"
    for read in (
        lambda: checkpoint.find_checkpoint(folder, STORAGE),
        lambda: checkpoint.read_state(folder, STORAGE),
        lambda: checkpoint.require_complete(folder, STORAGE),
        lambda: checkpoint.load(folder, STORAGE, *_model()),
        lambda: checkpoint.load_whole_model(folder, STORAGE, _model()[0], what="the model"),
    ):
        with pytest.raises(CheckpointError, match=expected):
            read()
    said: list[str] = []
    assert store.latest(on_incomplete=said.append) == store.uri(5)  # resume picks the one before
    assert len(said) == 1 and expected in said[0]
    assert checkpoint.find_checkpoint(store.run_dir, STORAGE) == store.uri(5)


def test_a_missing_part_is_refused_by_name(run):
    store, model, optimizer = run
    folder = _commit(store, 10, model, optimizer)
    (Path(folder) / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="checkpoint_00000010 is incomplete: .metadata is missing"):
        checkpoint.find_checkpoint(folder, STORAGE)
    assert store.latest(on_incomplete=lambda _: None) is None


def test_an_older_marker_without_a_list_still_loads(run):
    store, model, optimizer = run
    folder = _commit(store, 10, model, optimizer)
    marker = Path(folder) / checkpoint.COMMIT_FILE
    marker.write_text(json.dumps({"step": 10, "world_size": 1, "committed_at": 0.0}))
    assert checkpoint.find_checkpoint(folder, STORAGE) == folder
    checkpoint.load(folder, STORAGE, *_model())
    assert checkpoint.read_state(folder, STORAGE).step == 10


class _Rank0:
    """The Session's part the checkpointer uses, for one rank without Ray or a process group."""

    rank, world_size, prunes_checkpoints = 0, 1, True

    def __init__(self, memory_root: str | None = None):
        self.memory_root = memory_root
        self.events: list[events.RunEvent] = []

    def emit(self, event: events.RunEvent) -> None:
        self.events.append(event)

    def register(self, step, metrics, uri) -> None:
        pass


def _checkpointer(tmp_path, session: _Rank0, async_checkpoint: bool = False, **kwargs) -> Checkpointer:
    config = TrainConfig()
    config.run.dir = str(tmp_path / "run")
    config.train.async_checkpoint = async_checkpoint
    return Checkpointer(config, session, torch.device("cpu"), tokenizer_json=None, **kwargs)


def test_a_resave_that_dies_before_its_commit_leaves_no_checkpoint(tmp_path):
    model, optimizer = _model()

    def crash(step, rank, world):
        raise RuntimeError("killed between the write and the commit")

    first = _checkpointer(tmp_path, _Rank0())
    first.save_step(TrainState(step=10, consumed=80), {}, None, model, optimizer, final=True)
    first.close()
    assert first.store.complete_steps() == [10]
    again = _checkpointer(tmp_path, _Rank0(), before_commit=crash)  # resumed from an earlier one, at step 10 again
    with pytest.raises(RuntimeError, match="killed"):
        again.save_step(TrainState(step=10, consumed=80), {}, None, model, optimizer, final=True)
    assert again.store.complete_steps() == []  # the old marker went before the new shards came


def test_the_in_memory_store_keeps_the_step_just_written_not_a_stale_later_one(tmp_path):
    """As the loop does it: the restore drops the earlier attempt's stale folder, the save's marker
    the earlier ones (never a later one: another rank may be writing it)."""
    model, optimizer = _model()
    root = f"memory://rayllm-test-{uuid.uuid4().hex[:8]}/run"
    stale = checkpoint.CheckpointStore(root, STORAGE)  # an earlier attempt's, at a later step
    stale.write_state(20, TrainState(step=20, consumed=160), None)
    stale.mark_complete(20, world_size=1)
    session = _Rank0(memory_root=root)
    ckpt = _checkpointer(tmp_path, session)
    earlier = checkpoint.CheckpointStore(root, STORAGE)
    _commit(earlier, 10, model, optimizer)
    assert ckpt.newest() == earlier.uri(10)  # the stale one is not whole: no shards
    assert stale.complete_steps() == [10]
    ckpt.save_step(TrainState(step=15, consumed=120), {}, None, model, optimizer, final=False, in_memory=True)
    ckpt.close()
    assert stale.complete_steps() == [15]
    assert any(isinstance(e, events.MemoryCheckpoint) and e.step == 15 for e in session.events)


def test_a_milestone_copy_cut_off_is_cleared_and_finished_never_nested(run):
    store, model, optimizer = run
    folder = _commit(store, 10, model, optimizer)
    kept = Path(store.root) / checkpoint.KEPT_DIR
    leftover = kept / "checkpoint_00000010.tmp"
    leftover.mkdir(parents=True)
    (leftover / ".metadata").write_bytes(b"cut")  # a copy killed at the end of the run
    assert store.finish_milestones(every=10) == [str(kept / "checkpoint_00000010")]
    copy = kept / "checkpoint_00000010"
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in Path(folder).iterdir())
    assert not leftover.exists()
    assert checkpoint.find_checkpoint(str(copy), STORAGE) == str(copy)  # whole, its marker's parts checked
    leftover.mkdir()  # and a copy started over a leftover does not nest inside it
    (copy / checkpoint.COMMIT_FILE).unlink()
    import shutil

    shutil.rmtree(copy)
    store.keep_milestone(10)
    assert not (copy / "checkpoint_00000010").exists() and (copy / ".metadata").exists()


def test_the_end_of_the_run_runs_inside_the_watchdogs_long_phase(tmp_path):
    model, optimizer = _model()
    phases: list[tuple[float, str]] = []

    class Recorded:
        def __init__(self, seconds, phase):
            self.entry = (seconds, phase)

        def __enter__(self):
            phases.append(self.entry)

        def __exit__(self, *exc):
            return False

    ckpt = _checkpointer(tmp_path, _Rank0(), slow=Recorded)
    ckpt.config.train.keep_checkpoint_every = 10
    ckpt.save_step(TrainState(step=10, consumed=80), {}, None, model, optimizer, final=True)
    ckpt.close()
    assert phases == [(3600.0, "the end of the run (last commit, milestone copy)")]
    assert (Path(ckpt.store.root) / "kept" / "checkpoint_00000010").exists()


def test_in_memory_checkpoints_larger_than_the_object_store_are_refused_naming_the_figures():
    train = TrainConfig().train
    train.memory_checkpoint_every = 10
    n_params = 8_000_000_000
    need = memory_checkpoint_bytes_per_node(n_params, 4)
    assert need == 12 * n_params // 4 * 2 * 2  # its share and a neighbour's, twice while writing
    assert check_memory_budget(n_params, train, 4, nodes_and_store=(4, need))
    # An autoscaling cluster that starts empty: nothing to check against yet (rank 0 checks at attempt 1).
    assert not check_memory_budget(n_params, train, 4, nodes_and_store=(0, 0))
    with pytest.raises(ConfigError) as refused:
        check_memory_budget(n_params, train, 4, nodes_and_store=(4, 64 * 2**30))
    line = str(refused.value)
    for needle in ("need 89.41 GiB", "8,000,000,000 parameters", "64.00 GiB", "train.memory_checkpoint_every=null"):
        assert needle in line, line


class _HeldStore(MemoryFileSystem):
    """An in-memory store whose shard writes wait until released: a slow object store."""

    protocol = "rayllm-held"
    release = threading.Event()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.replace("rayllm-held://", "memory://"))

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode and path.endswith(".distcp"):
            assert self.release.wait(60), "the test never released the store"
        return super()._open(path, mode, **kwargs)


def test_an_in_memory_save_is_written_and_marked_while_the_loop_goes_on(tmp_path):
    """The loop waits only for the copy to CPU memory: the save returns while the store still
    holds the shards back, and the marker comes once they are written, without the loop."""
    fsspec.register_implementation(_HeldStore.protocol, _HeldStore, clobber=True)
    _HeldStore.release.clear()
    model, optimizer = _model()
    root = f"rayllm-held://rayllm-test-{uuid.uuid4().hex[:8]}/run"
    session = _Rank0(memory_root=root)
    ckpt = _checkpointer(tmp_path, session, async_checkpoint=True)
    saving = threading.Thread(
        target=ckpt.save_step,
        args=(TrainState(step=15, consumed=120), {}, None, model, optimizer),
        kwargs={"final": False, "in_memory": True},
    )
    saving.start()
    saving.join(timeout=30)
    assert not saving.is_alive()  # returned while the shards are held back
    ckpt.wait_copied()  # what the loop waits for before the optimizer step
    assert ckpt.memory.complete_steps() == [] and not session.events
    time.sleep(0.5)
    _HeldStore.release.set()
    deadline = time.time() + 30
    while time.time() < deadline and not ckpt.memory.complete_steps():
        time.sleep(0.05)  # the loop does nothing: rank 0's marker thread marks it
    assert ckpt.memory.complete_steps() == [15]
    ckpt.close()
    (done,) = [e for e in session.events if isinstance(e, events.MemoryCheckpoint)]
    assert done.step == 15 and done.write_s >= 0.5 > done.stall_s, done


def test_a_restore_keeps_only_the_in_memory_checkpoint_it_resumes_from(tmp_path):
    """No later save rewrites an in-memory folder: a restore drops every other one (older, stale
    from an earlier attempt, or not whole)."""
    model, optimizer = _model()
    root = f"memory://rayllm-test-{uuid.uuid4().hex[:8]}/run"
    store = checkpoint.CheckpointStore(root, STORAGE)
    _commit(store, 10, model, optimizer)
    _commit(store, 20, model, optimizer)
    store.write_state(30, TrainState(step=30, consumed=240), None)  # written, never marked
    ckpt = _checkpointer(tmp_path, _Rank0(memory_root=root))
    assert ckpt.newest() == store.uri(20)
    assert [step for step, _ in store._folders()] == [20]
    ckpt.close()


def test_an_in_memory_marker_never_drops_a_later_folder_another_rank_is_writing(tmp_path):
    """Rank 0 marks step 15 off the loop; a rank ahead of it has begun step 16's folder (its ids)."""
    model, optimizer = _model()
    root = f"memory://rayllm-test-{uuid.uuid4().hex[:8]}/run"
    store = checkpoint.CheckpointStore(root, STORAGE)
    _commit(store, 10, model, optimizer)
    store.fs.pipe_file(f"{store.path(16)}/consumed-rank00001.npy", b"ids")
    ckpt = _checkpointer(tmp_path, _Rank0(memory_root=root), async_checkpoint=True)
    ckpt.save_step(TrainState(step=15, consumed=120), {}, None, model, optimizer, final=False, in_memory=True)
    ckpt.close()
    assert [step for step, _ in store._folders()] == [15, 16]
