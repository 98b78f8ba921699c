"""Object storage edge cases against real servers on 127.0.0.1: moto's S3 (anonymous reads of a
public bucket, bad credentials with moto's IAM auth on, a nonexistent bucket, a shard deleted
after the run listed it) and plain HTTP through fsspec (any scheme fsspec has a package for)."""

from __future__ import annotations

import functools
import http.server
import json
import subprocess
import sys
import threading
import time

import boto3
import numpy as np
import pytest
from helpers import TEST_MODEL, free_port, s3_client

from rayllm import DataError, TrainConfig
from rayllm.data.discover import prepare_data
from rayllm.data.order import DataState, local_stream, open_stream

pytestmark = pytest.mark.slow


def upload_corpus(s3, bucket: str, corpus, prefix: str = "corpus", public: bool = False) -> None:
    s3.create_bucket(Bucket=bucket, **({"ACL": "public-read"} if public else {}))
    extra = {"ACL": "public-read"} if public else None
    for path in sorted((corpus / "train").glob("part-*")):
        s3.upload_file(str(path), bucket, f"{prefix}/{path.name}", ExtraArgs=extra)


def config(tmp_path, *overrides: str) -> TrainConfig:
    return TrainConfig.from_yaml(
        "configs/tiny.yaml",
        overrides=[*TEST_MODEL, "data.val=null", "data.demo_corpus=false", f"run.dir={tmp_path / 'run'}", *overrides],
    )


def cli_train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rayllm.cli", "train", "configs/tiny.yaml", *overrides],
        capture_output=True,
        text=True,
        timeout=120,  # a hang is a failure too
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def auth_s3(tmp_path_factory):
    """moto with IAM authentication on: only the access key created here may read."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**__import__("os").environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},  # the 3 IAM calls below
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    iam = boto3.client(
        "iam", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
    )
    for _ in range(100):
        try:
            iam.create_user(UserName="reader")
            break
        except Exception:
            time.sleep(0.2)
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="reader", PolicyName="all", PolicyDocument=json.dumps(policy))
    yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    proc.terminate()
    proc.wait(timeout=10)


def test_bad_credentials_are_a_clear_error(auth_s3, corpus, tmp_path):
    endpoint, key, secret = auth_s3
    upload_corpus(s3_client(endpoint, key, secret), "private", corpus)
    common = ["data.train=s3://private/corpus", f"storage.endpoint_url={endpoint}", f"run.dir={tmp_path / 'r'}"]
    # The right key reads the shards (the same server, so the failures below are the credentials').
    assert (
        len(
            prepare_data(
                config(tmp_path, *common, f"storage.key={key}", f"storage.secret={secret}"),
                log=lambda *_: None,
            )
            .train.sources[0]
            .shards
        )
        == 3
    )
    for creds in (
        ["storage.key=AKIANOSUCHKEY", "storage.secret=x"],
        [f"storage.key={key}", "storage.secret=wrong"],
    ):
        message = error_line(cli_train(*common, *creds))
        assert "s3://private/corpus" in message and "access denied" in message and "storage" in message, message
        assert "wrong" not in message  # the secret is not echoed


def test_nonexistent_bucket_is_named(s3_server, tmp_path):
    message = error_line(
        cli_train(
            "data.train=s3://no-such-bucket/corpus",
            f"storage.endpoint_url={s3_server}",
            "storage.key=testing",
            "storage.secret=testing",
            f"run.dir={tmp_path / 'r'}",
        )
    )
    assert "bucket 'no-such-bucket'" in message and "does not exist" in message, message


def test_anonymous_reads_of_a_public_bucket(s3_server, corpus, tokenizer_file, tmp_path):
    upload_corpus(s3_client(s3_server), "public-corpus", corpus, public=True)
    anon = config(
        tmp_path,
        "data.train=s3://public-corpus/corpus",
        f"storage.endpoint_url={s3_server}",
        "storage.anon=true",
        f"data.tokenizer={tokenizer_file}",
    )
    local = config(tmp_path, f"data.train={corpus / 'train'}", f"data.tokenizer={tokenizer_file}")
    a, b = (next(local_stream(prepare_data(c, log=lambda *_: None).train, global_batch=8))[0] for c in (anon, local))
    assert np.array_equal(a["tokens"], b["tokens"])  # unsigned requests read the same sequences


def test_any_fsspec_scheme_here_plain_http(corpus, tokenizer_file, tmp_path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(corpus / "train"))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        names = sorted(p.name for p in (corpus / "train").glob("part-*"))
        urls = "[" + ",".join(f"{base}/{n}" for n in names) + "]"
        over_http = config(tmp_path, f"data.train={urls}", f"data.tokenizer={tokenizer_file}")
        local = config(tmp_path, f"data.train={corpus / 'train'}", f"data.tokenizer={tokenizer_file}")
        a, b = (
            next(local_stream(prepare_data(c, log=lambda *_: None).train, global_batch=8))[0]
            for c in (over_http, local)
        )
        assert np.array_equal(a["tokens"], b["tokens"])
    finally:
        server.shutdown()


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_shard_deleted_after_listing_on_s3_through_ray_data(
    ray_local, s3_server, corpus, tokenizer_file, tmp_path, mode
):
    from rayllm.data.stream.pipeline import configure_ray_data, ray_chunks

    s3 = s3_client(s3_server)
    bucket = f"deleted-{mode}"
    upload_corpus(s3, bucket, corpus)
    cfg = config(
        tmp_path,
        f"data.train=s3://{bucket}/corpus",
        f"storage.endpoint_url={s3_server}",
        "storage.key=testing",
        "storage.secret=testing",
        f"data.tokenizer={tokenizer_file}",
        f"data.on_bad_shard={mode}",
    )
    # Ray Data tasks get sealed settings: the credentials travel as a Ray object (rayllm.io.credentials).
    plan = prepare_data(cfg, log=lambda *_: None).with_storage(cfg.storage.sealed()).train
    gone = plan.sources[0].shards[1]
    s3.delete_object(Bucket=bucket, Key=gone.removeprefix(f"s3://{bucket}/"))
    configure_ray_data()
    stream = open_stream(plan, DataState(), consumed=0, global_batch=8, chunks=ray_chunks(tokenize_tasks=2))
    if mode == "error":
        with pytest.raises(DataError, match=rf"shard {gone} disappeared"):
            for _ in stream:
                pass
        return
    skipped, epochs = [], set()
    for rows, state in stream:
        skipped = state.skipped
        epochs.update(int(e) for e in rows["epoch"])
        assert not (rows["shard"] == 1).any()
        if 1 in epochs:
            break
    assert [s["shard"] for s in skipped][:1] == [1] and "disappeared" in skipped[0]["error"], skipped


def test_s3_opens_in_a_process_whose_aiohttp_import_was_cut_short():
    """The state CI met in a reused Ray Data worker: aiohttp re-imported with its submodules still
    cached, so s3fs's import fails on aiohttp.http_exceptions. rayllm re-imports and goes on."""
    code = (
        "import sys, aiohttp, aiohttp.http_exceptions\n"
        "del sys.modules['aiohttp']\n"
        "import aiohttp\n"
        "assert not hasattr(aiohttp, 'http_exceptions')\n"
        "from rayllm.io.settings import StorageSettings\n"
        "from rayllm.io.storage import filesystem\n"
        "fs, _ = filesystem('s3://bucket/x', StorageSettings(endpoint_url='http://127.0.0.1:9', anon=True))\n"
        "print(repr(fs))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "S3FileSystem" in proc.stdout  # s3fs's (inside rayllm's retrying wrapper)
