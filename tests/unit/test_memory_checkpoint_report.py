"""In-memory checkpoints as the driver reports them (rayllm/runtime/monitor.py), without Ray (the keepers'
files on a real local Ray: tests/integration/test_memory_checkpoint.py)."""

from __future__ import annotations


def test_the_driver_reports_in_memory_checkpoints_and_resumes_from_them(tmp_path):
    """What the keepers hold goes on the progress line and to Aim; a resume says where it came from."""
    import io

    from rayllm import TrainConfig
    from rayllm.runtime.monitor import RunMonitor

    config = TrainConfig.from_yaml(
        "configs/tiny.yaml", overrides=[f"run.dir={tmp_path}", "tracking.enabled=false", "train.max_steps=10"]
    )
    out = io.StringIO()
    monitor = RunMonitor(config, out=out)
    start = {"kind": "start", "step": 4, "world_size": 2, "params": 5e6, "flops_per_token": 1, "accum_steps": 1}
    monitor.handle({**start, "resumed_from": "memory"})
    monitor.handle({"kind": "memory_checkpoint", "step": 5, "stall_s": 0.01, "bytes": 3 * 2**20 // 2})
    train = {"kind": "train", "step": 5, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e4}
    monitor.handle({**train, "step_time_s": 0.1, "mfu": 0.1})
    monitor.close()
    lines = out.getvalue().splitlines()
    assert "resuming at step 4 (from the in-memory checkpoint) on 2 worker(s)" in lines[0], lines
    assert lines[1].endswith("| in memory 1.5 MiB"), lines
