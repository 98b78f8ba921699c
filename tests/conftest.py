"""Shared fixtures, for both tiers: small real data, a real local Ray on 127.0.0.1, a real moto S3 server.
Plain helper functions are in helpers.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Ray reads this at import: every node it starts then advertises 127.0.0.1 (see shared NOTES).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # tests send nothing beyond loopback

import pytest  # noqa: E402

pytest.register_assert_rewrite("helpers")  # its asserts explain themselves as a test's do

from helpers import TEST_MODEL  # noqa: E402

from rayllm.data.demo_corpus import stdlib_modules  # noqa: E402


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
    from rayllm.bench.local_s3 import moto_server

    with moto_server() as endpoint:
        yield endpoint
