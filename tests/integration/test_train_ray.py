"""The main job through Ray Train on a real local Ray (127.0.0.1): the Python API end to end."""

import json

import numpy as np
import pytest
from helpers import REPO, TEST_MODEL, read_records

from rayllm import RayllmError, TrainConfig, train
from rayllm.runtime.monitor import CUDA_ONLY_METRICS, TRAIN_METRICS

pytestmark = pytest.mark.slow

SHORT = ["train.log_every=1", "train.val_every=3", "train.checkpoint_every=3", "cluster.num_workers=2"]


def run(overrides, *extra):
    return train(TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*overrides, *extra]), quiet=True)


def losses(result):
    return {r["step"]: r["loss"] for r in result.history if r["kind"] == "train"}


def test_loss_falls_checkpoints_and_aim_reads_back(ray_local, overrides, tmp_path):
    result = run(
        overrides,
        "train.max_steps=30",
        "train.log_every=5",
        "train.val_every=15",
        "train.checkpoint_every=5",
        "train.keep_checkpoint_every=10",
        "train.warmup_steps=5",
    )
    assert result.step == 30
    assert result.tokens == 30 * 8 * 64
    assert result.val_loss < 0.9 * result.initial_val_loss
    assert result.loss < losses(result)[5]
    assert result.checkpoint and result.checkpoint.endswith("checkpoint_00000030")
    with open(f"{result.checkpoint}/train_state.json") as f:
        assert json.load(f)["step"] == 30
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in run_dir.glob("checkpoint_0*")) == ["checkpoint_00000025", "checkpoint_00000030"]
    kept = sorted(run_dir.glob("kept/*"))  # every 10th, complete, beside the last 2
    assert [p.name for p in kept] == [f"checkpoint_{s:08d}" for s in (10, 20, 30)]
    assert result.kept_checkpoints == [str(p) for p in kept]
    for path, step in zip(kept, (10, 20, 30), strict=True):
        assert json.loads((path / "train_state.json").read_text())["step"] == step
        assert (path / ".metadata").exists()
    assert TrainConfig.from_yaml(run_dir / "config.yaml").train.max_steps == 30  # resolved config saved

    import aim

    repo = aim.Repo(result.aim_repo)
    runs = {r.hash: r for r in repo.iter_runs()}
    assert result.aim_run_hash in runs
    assert runs[result.aim_run_hash]["train"]["max_steps"] == 30  # hyperparameters: the resolved config
    query = repo.query_metrics("metric.name in ['loss', 'val_loss', 'lr', 'grad_norm', 'tokens_per_s']")
    tracked = {
        (m.name, m.context.to_dict()["subset"]): m.dataframe()
        for run_metrics in query.iter_runs()
        if run_metrics.run.hash == result.aim_run_hash
        for m in run_metrics
    }
    assert list(tracked[("loss", "train")]["step"]) == [5, 10, 15, 20, 25, 30]
    assert list(tracked[("val_loss", "val")]["step"]) == [0, 15, 30]
    for name in ("lr", "grad_norm", "tokens_per_s"):
        assert list(tracked[(name, "train")]["step"]) == [5, 10, 15, 20, 25, 30]
    assert tracked[("loss", "train")]["value"].iloc[-1] == pytest.approx(result.loss)

    aim_run = repo.get_run(result.aim_run_hash)
    series = {(m.name, m.context.to_dict().get("subset")): m.dataframe() for m in aim_run.metrics()}
    for name in TRAIN_METRICS:  # loss, perplexity, mfu, memory, world size, restarts, ...
        if name in CUDA_ONLY_METRICS:  # the allocator's figures: a CPU run has none to track
            assert (name, "train") not in series, name
            continue
        assert list(series[(name, "train")]["step"]) == [5, 10, 15, 20, 25, 30], name
    train_loss = series[("loss", "train")]["value"]
    assert series[("perplexity", "train")]["value"].tolist() == pytest.approx(np.exp(train_loss).tolist())
    assert 0 < series[("mfu", "train")]["value"].iloc[-1] < 1  # against this machine's measured matmul peak
    assert set(series[("world_size", "train")]["value"]) == {2}
    per_worker = series[("tokens_per_s_per_worker", "train")]["value"]
    assert per_worker.tolist() == pytest.approx((series[("tokens_per_s", "train")]["value"] / 2).tolist())
    assert list(series[("val_perplexity", "val")]["step"]) == [0, 15, 30]
    assert series[("checkpoint_stall_s", "train")]["value"].min() >= 0
    # Aim's own system metrics (CPU, memory of the driver's machine) beside ours.
    assert any(name.startswith("__system__") for name, _ in series)
    # Hyperparameters beyond the config: sizes, versions, code.
    assert aim_run["num_params"] > 0 and aim_run["flops_per_token"] > 0 and aim_run["world_size"] == 2
    assert aim_run["peak_flops"] > 0
    assert aim_run["versions"]["torch"] and aim_run["versions"]["ray"]
    if (REPO / ".git").exists():  # run from a git checkout
        assert len(aim_run["git_commit"]) >= 40
    # Greedy samples of the default prompts at every validation, as Aim text.
    from aim.storage.context import Context

    texts = aim_run.get_text_sequence("samples", Context({"prompt": "0"}))
    samples = dict(texts.data.items())
    assert sorted(samples) == [15, 30]
    assert all(value[0].data.startswith("The ") for value in samples.values())


@pytest.fixture(scope="module")
def uninterrupted(request, tmp_path_factory, corpus, tokenizer_file):
    """A 6-step run on 2 workers, shared by the parity and resume tests."""
    request.getfixturevalue("ray_local")
    base = [
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        f"data.val={corpus / 'val'}",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        *SHORT,
        "train.max_steps=6",
        "data.record_ids=true",
        "data.shuffle_window=16",
        "train.keep_checkpoints=10",
    ]
    result = run([*base, f"run.dir={tmp_path_factory.mktemp('full') / 'run'}"])
    return base, result


def global_order(run_dir) -> list[tuple[int, ...]]:
    """The sequence ids trained on, in global order: per checkpoint and step, rank 0's rows then rank 1's."""
    import glob

    import numpy as np

    order = []
    for ckpt in sorted(glob.glob(f"{run_dir}/checkpoint_[0-9]*/rayllm_commit.json")):  # committed ones
        ckpt = ckpt.rsplit("/", 1)[0]
        per_rank = [np.load(p) for p in sorted(glob.glob(f"{ckpt}/consumed-rank*.npy"))]
        per_step = 8 // len(per_rank)
        for step in range(len(per_rank[0]) // per_step):
            for rows in per_rank:
                order.extend(tuple(int(v) for v in r) for r in rows[step * per_step : (step + 1) * per_step])
    return order


def test_one_worker_stopped_and_rerun_equals_two_fsdp_workers(uninterrupted, tmp_path):
    """1 worker, stopped at step 3 and run again, against 2 workers uninterrupted: the rerun resumes
    from the latest checkpoint, in the same Aim run, with the same losses and sequences."""
    base, two = uninterrupted
    first = run([*base, f"run.dir={tmp_path / 'one'}", "cluster.num_workers=1", "train.stop_at_step=3"])
    assert first.step == 3
    second = run([*base, f"run.dir={tmp_path / 'one'}", "cluster.num_workers=1"])
    assert [r["step"] for r in second.history if r["kind"] == "start"][0] == 3
    assert second.aim_run_hash == first.aim_run_hash  # one Aim run for the whole training run
    one = {**losses(first), **losses(second)}
    assert sorted(losses(second)) == [4, 5, 6]
    assert sorted(one) == sorted(losses(two)) == list(range(1, 7))
    # The same seed gives the same sequences in the same order on 1 and on 2 workers.
    order = global_order(tmp_path / "one")
    assert len(order) == 6 * 8 == len(set(order))
    assert order == global_order(two.run_dir)
    assert order != sorted(order)  # and that order is shuffled, not the shards' own
    for step, loss in one.items():
        assert abs(loss - losses(two)[step]) / loss <= 1e-4, (step, loss, losses(two)[step])


# FSDP 2 as in the uninterrupted run, and a pipeline of 2 stages over FSDP 2: its rank module's
# state goes to the keepers and comes back into the stages.
@pytest.mark.parametrize(
    "layout",
    [[], ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.pp=2", "parallel.dp_shard=2"]],
    ids=["fsdp2", "pp2xfsdp2"],
)
def test_a_killed_worker_resumes_from_the_in_memory_checkpoint_of_the_step_before(
    uninterrupted, tmp_path, monkeypatch, layout
):
    """In-memory checkpoints every step: a worker SIGKILLed in step 5 (the run held before it)
    costs no stored checkpoint's worth of steps: the run resumes from step 4 out of the keepers,
    with the uninterrupted run's losses and sequences."""
    import os
    import signal
    import threading
    import time

    from ray.util.state import list_actors

    base, two = uninterrupted
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv("RAYLLM_FAULT_PAUSE_AT", f"5:{hold}")
    box: dict = {}
    config = [*base, f"run.dir={run_dir}", "train.memory_checkpoint_every=1", *layout]
    thread = threading.Thread(target=lambda: box.update(result=run(config)), daemon=True)
    thread.start()

    deadline = time.time() + 300
    while time.time() < deadline and not any(r["step"] == 4 for r in read_records(run_dir, "memory_checkpoint")):
        time.sleep(0.2)
    workers = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    os.kill(workers[-1].pid, signal.SIGKILL)
    hold.unlink()
    thread.join(timeout=300)
    result = box["result"]
    starts = [(r["step"], r["resumed_from"]) for r in result.history if r["kind"] == "start"]
    assert starts == [(0, None), (4, "memory")], starts  # the stored checkpoint is step 3's
    memory = [r for r in result.history if r["kind"] == "memory_checkpoint"]
    assert memory and all(r["bytes"] > 0 for r in memory)
    steps = losses(result)
    assert sorted(steps) == list(range(1, 7))
    for step, loss in steps.items():
        assert abs(loss - losses(two)[step]) / loss <= 1e-4, (step, loss, losses(two)[step])
    assert global_order(run_dir) == global_order(two.run_dir)  # every sequence once, in order


# Every mesh axis at once (replicate 2 x shard 2 x tp 2) as Ray Train workers, with activation
# checkpointing; each layout alone is walked under torchrun (tests/test_parallel.py). One run of
# 8 workers instead of one per layout keeps CI within its half hour.
@pytest.mark.parametrize(
    "layout",
    [["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2", "train.activation_checkpointing=true"]],
    ids=["hsdp2x2xtp2-ac"],
)
def test_every_layout_under_ray_train_gives_the_same_losses_and_sequences(uninterrupted, tmp_path, layout):
    """As under torchrun (tests/test_parallel.py), now as Ray Train workers fed by the stream
    server: TP peers get the same rows, and the global order is the 2-worker run's."""
    base, two = uninterrupted
    workers = ["cluster.num_workers=8", "cluster.cpus_per_worker=0.25"]
    result = run([*base, f"run.dir={tmp_path / 'run'}", *workers, *layout])
    assert sorted(losses(result)) == list(range(1, 7))
    for step, loss in losses(result).items():
        assert abs(loss - losses(two)[step]) / loss <= 1e-4, (step, loss, losses(two)[step])
    assert global_order(tmp_path / "run") == global_order(two.run_dir)


@pytest.mark.parametrize(
    "tail, message",
    [
        ('{"text": broken\n', r"shard .*shard.jsonl line 301 is not valid JSON"),
        # A line without its end, past data.max_document_bytes: stopped there and named, not read whole.
        ('{"text": "' + "x" * (2 << 20), r"shard .*shard.jsonl line 301 is longer than data.max_document_bytes"),
    ],
    ids=["bad json", "newline-less"],
)
def test_bad_shard_found_by_a_worker_is_reported_by_name(ray_local, overrides, tmp_path, tail, message):
    data = tmp_path / "data"
    data.mkdir()
    good = "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 20}) + "\n" for i in range(300))
    (data / "shard.jsonl").write_text(good + tail)
    with pytest.raises(RayllmError, match=message):
        run(
            overrides,
            f"data.train={data}",
            "train.max_steps=200",
            "train.val_every=1000",
            "data.max_document_bytes=1048576",
        )
