"""``rayllm bench serve`` runs end to end at a small size, and every simulated rank gets its
whole slice of every timed step from both designs (the bench checks the token count itself)."""

import subprocess
import sys


def test_bench_serve_serves_every_rank_its_slices_from_memory_and_shards():
    cmd = [sys.executable, "-m", "rayllm.cli", "bench", "serve", "--ranks", "1,4", "--seq-len", "64"]
    proc = subprocess.run(
        [*cmd, "--steps", "3", "--consumers", "2", "--cpus", "2"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if " ranks  " in line]
    assert len(lines) == 12, proc.stdout  # {memory, shards} x {1, 4} ranks x 3 designs
    for source in ("memory", "shards"):
        for design in ("per-rank queues", "object store", "node relays"):
            assert sum(line.startswith(source) and design in line for line in lines) == 2, proc.stdout
