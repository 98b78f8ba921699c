"""A torch.compile that cannot work on some rank is no end of the run: every rank trains eager,
with one warning that names the rank and the cause, and the losses are eager's.

The fault is delivered as the world does: rank 1's environment names a C++ compiler that does
not work (CXX=/bin/false), so Inductor cannot build its kernels there; or one that hangs, which
the probe's deadline ends. Rank 0's works.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import free_port, losses, quiet_run, read_records, torchrun_records

# Rank 1 only: torchrun gives every rank one environment, so a shell sets CXX by LOCAL_RANK.
ON_RANK_1 = 'if [ "$LOCAL_RANK" = 1 ]; then export CXX={cxx}; fi; exec "$0" -m rayllm.runtime.torchrun "$@"'


@pytest.mark.parametrize("compiler", ["fails", "hangs"])
def test_a_rank_whose_compiler_fails_or_hangs_makes_every_rank_train_eager_with_a_warning(
    overrides, tmp_path, compiler
):
    cxx = "/bin/false"
    if compiler == "hangs":
        cxx = str(tmp_path / "cxx")
        with open(cxx, "w") as f:
            f.write("#!/bin/sh\nexec sleep 120 </dev/null >/dev/null 2>&1\n")
        os.chmod(cxx, 0o755)
    base = [*quiet_run(overrides), "train.max_steps=3"]
    eager = losses(torchrun_records(1, [*base, "train.compile=false", f"run.dir={tmp_path / 'eager'}"]))
    run_dir = tmp_path / "fallback"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--no-python",
        "sh",
        "-c",
        ON_RANK_1.format(cxx=cxx),
        sys.executable,
        "configs/tiny.yaml",
        *base,
        "train.compile=true",
        f"run.dir={run_dir}",
    ]
    env = {**os.environ, "RAYLLM_COMPILE_PROBE_TIMEOUT_S": "30"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_records(run_dir)
    warnings = [r["message"] for r in records if r["kind"] == "warning"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("train.compile: torch.compile does not work here (rank 1: "), warnings
    assert "C++ compiler" in warnings[0] and "set train.compile: false" in warnings[0]
    if compiler == "hangs":
        assert "did not finish in 30 s" in warnings[0], warnings
    fallback = losses(records)
    assert sorted(fallback) == sorted(eager) == [1, 2, 3]
    for step, loss in eager.items():
        assert abs(fallback[step] - loss) / loss <= 1e-4, (step, fallback[step], loss)
