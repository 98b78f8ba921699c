"""The bundled demo corpus: the Python standard library's own source, present on every machine.

Real text with real structure (code, comments, docstrings), so the loss curve shows
learning, and nothing is downloaded. Written once as jsonl training shards and a parquet
validation shard, exercising both readers.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

DEMO_ROOT = os.path.join("data", "demo")
TRAIN_SHARDS = 8
VAL_EVERY = 25  # one module in VAL_EVERY goes to validation
_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def stdlib_modules() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py")) if not _SKIP_PARTS.intersection(p.relative_to(root).parts)]


def is_demo_path(spec) -> bool:
    """True when every path in ``spec`` (a path, a list of paths or of sources) is inside the demo corpus."""
    items = [spec] if isinstance(spec, str) else list(spec or [])
    paths = [item if isinstance(item, str) else getattr(item, "path", "") for item in items]
    root = os.path.normpath(DEMO_ROOT)
    return bool(paths) and all(
        os.path.normpath(p) == root or os.path.normpath(p).startswith(root + os.sep) for p in paths
    )


def ensure_demo_corpus(root: str = DEMO_ROOT) -> bool:
    """Write the corpus under ``root`` unless it is already there; True when written now."""
    train_dir, val_dir = os.path.join(root, "train"), os.path.join(root, "val")
    done = os.path.join(root, "_SUCCESS")
    if os.path.exists(done):
        return False
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(train_dir, exist_ok=True)
    os.makedirs(val_dir, exist_ok=True)
    modules = stdlib_modules()
    train_files = [open(os.path.join(train_dir, f"part-{i:03d}.jsonl"), "w") for i in range(TRAIN_SHARDS)]
    val_rows: list[dict[str, str]] = []
    try:
        for i, path in enumerate(modules):
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            record = {"text": text, "source": path.name}
            if i % VAL_EVERY == VAL_EVERY - 1:
                val_rows.append(record)
            else:
                train_files[i % TRAIN_SHARDS].write(json.dumps(record) + "\n")
    finally:
        for f in train_files:
            f.close()
    pq.write_table(pa.Table.from_pylist(val_rows), os.path.join(val_dir, "part-000.parquet"))
    with open(done, "w") as f:
        f.write(f"{len(modules)} modules\n")
    return True
