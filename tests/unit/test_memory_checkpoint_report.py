"""In-memory checkpoints as the driver reports them (rayllm/runtime/monitor.py), without Ray (the keepers'
files on a real local Ray: tests/integration/test_memory_checkpoint.py)."""

from __future__ import annotations


def test_the_driver_reports_in_memory_checkpoints_and_resumes_from_them(tmp_path):
    """What the keepers hold goes on the progress line and to Aim; a resume says where it came from."""
    import io

    from rayllm import TrainConfig, events
    from rayllm.runtime.monitor import RunMonitor

    config = TrainConfig.from_yaml(
        "configs/tiny.yaml", overrides=[f"run.dir={tmp_path}", "tracking.enabled=false", "train.max_steps=10"]
    )
    out = io.StringIO()
    monitor = RunMonitor(config, out=out)
    start = dict(step=4, world_size=2, params=5_000_000, flops_per_token=1, peak_flops=1e12, restarts=1, accum_steps=1)
    monitor.handle(events.Start(**start, resumed_from="memory", layout="FSDP 2", nodes=["a", "b"]))
    monitor.handle(events.MemoryCheckpoint(step=5, stall_s=0.01, nbytes=3 * 2**20 // 2))
    train = dict(step=5, loss=5.0, perplexity=148.4, lr=1e-3, grad_norm=1.0, tokens=5120, tokens_per_s=1e4)
    train.update(tokens_per_s_per_worker=5e3, flops_per_s=1e4, mfu=0.1, step_time_s=0.1, data_wait_frac=0.0)
    train.update(data_wait_max_frac=0.0, data_wait_max_rank=0, peak_memory_bytes=2**20, world_size=2, restarts=1)
    per_rank = dict(rank_own_step_s=[0.1, 0.1], rank_data_wait_s=[0.0, 0.0], rank_collective_wait_s=[0.0, 0.0])
    monitor.handle(events.Train(**train, **per_rank, skipped_shards=0, mixture={"demo": 1.0}))
    monitor.close()
    lines = out.getvalue().splitlines()
    assert "resuming at step 4 (from the in-memory checkpoint) on 2 worker(s)" in lines[0], lines
    assert lines[-1].endswith("| in memory 1.5 MiB"), lines
