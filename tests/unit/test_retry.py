"""Storage errors by cause, with errors raised by the real libraries against real local servers:
a closed port, an S3-style server answering 404 NoSuchKey, 403 AccessDenied and 503 SlowDown, and
a web server that drops a shard's connection half-way (the shard is resumed, each document once)."""

from __future__ import annotations

import asyncio
import gc
import http.server
import json
import logging
import socket
import threading
import time

import pytest
from helpers import free_port

from rayllm.errors import DataError, StorageUnavailable
from rayllm.io.retry import Episode, classify, quiet_loop_noise, resumable, retrying
from rayllm.io.settings import StorageSettings

S3_ERRORS = {"missing": (404, "NoSuchKey"), "denied": (403, "AccessDenied"), "slow": (503, "SlowDown")}
DOCS = [{"text": f"document {i} " + "word " * 200} for i in range(40)]
BODY = "".join(json.dumps(d) + "\n" for d in DOCS).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    gets: list[str] = []  # the paths asked for, in order (shared by the test's server)

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self.gets.append(self.path)
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        if "list-type=2" in self.path:  # s3fs asks whether a missing key is a folder: it is not
            self._xml(200, b"<?xml version='1.0'?><ListBucketResult><KeyCount>0</KeyCount></ListBucketResult>", body)
            return
        name = self.path.rsplit("/", 1)[-1]
        if name in S3_ERRORS:
            status, code = S3_ERRORS[name]
            xml = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
            self._xml(status, xml, body)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        if not body:
            return
        if name == "flaky.jsonl" and self.gets.count(self.path) == 1:  # the first read is cut half-way
            self.wfile.write(BODY[: len(BODY) // 2])
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.connection.close()
            return
        self.wfile.write(BODY)

    def _xml(self, status: int, xml: bytes, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(xml)))
        self.end_headers()
        if body:
            self.wfile.write(xml)


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def s3_error(endpoint: str, name: str) -> Exception:
    import boto3
    from botocore.config import Config

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="k",
        aws_secret_access_key="s",
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}),
    )
    with pytest.raises(Exception) as caught:
        s3.get_object(Bucket="bucket", Key=name)
    return caught.value


def test_network_errors_and_throttling_are_transient_and_the_users_errors_fatal(server):
    with pytest.raises(ConnectionRefusedError) as refused:  # nothing listens on the port
        socket.create_connection(("127.0.0.1", free_port()), timeout=5)
    assert classify(refused.value) == "transient"
    assert classify(s3_error(f"http://127.0.0.1:{free_port()}", "x")) == "transient"  # EndpointConnectionError
    assert classify(s3_error(server, "slow")) == "transient"  # 503 SlowDown
    assert classify(s3_error(server, "missing")) == "fatal"  # 404 NoSuchKey
    assert classify(s3_error(server, "denied")) == "fatal"  # 403 AccessDenied
    with pytest.raises(json.JSONDecodeError) as parse:
        json.loads("{not json")
    assert classify(parse.value) == "fatal"
    wrapped = DataError("shard x is unreadable")
    wrapped.__cause__ = refused.value  # the outermost error that says decides
    assert classify(wrapped) == "fatal"


def test_s3fs_translations_keep_their_cause(server):
    import s3fs

    fs = s3fs.S3FileSystem(
        key="k",
        secret="s",
        endpoint_url=server,
        client_kwargs={"region_name": "us-east-1"},
        config_kwargs={"retries": {"max_attempts": 1}},
        skip_instance_cache=True,
    )
    fs.retries = 1
    verdicts = {}
    for name in ("missing", "denied", "slow"):
        with pytest.raises(Exception) as caught:
            fs.cat_file(f"bucket/{name}")
        verdicts[name] = (type(caught.value).__name__, classify(caught.value))
    assert verdicts == {
        "missing": ("FileNotFoundError", "fatal"),
        "denied": ("PermissionError", "fatal"),
        "slow": ("OSError", "transient"),
    }


def test_dcp_per_rank_errors_decide_together():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def raised(error: BaseException) -> BaseException:
        try:
            raise error
        except BaseException as e:
            return e

    reset, missing = raised(ConnectionResetError(104, "reset")), raised(FileNotFoundError("__1_0.distcp"))
    assert classify(CheckpointException("save", {0: _wrap_exception(reset), 1: _wrap_exception(reset)})) == "transient"
    assert classify(CheckpointException("save", {0: _wrap_exception(reset), 1: _wrap_exception(missing)})) == "fatal"


def test_retrying_says_once_what_it_retries_and_gives_up_at_the_deadline(caplog, monkeypatch):
    monkeypatch.setattr(Episode, "FIRST_WAIT_S", 0.05)
    failures = iter([ConnectionResetError(104, "reset by peer")] * 3)

    def flaky():
        error = next(failures, None)
        if error is not None:
            raise error
        return "answer"

    with caplog.at_level(logging.WARNING, logger="rayllm.storage"):
        assert retrying(flaky, "reading x", deadline_s=30) == "answer"
    lines = [r.getMessage() for r in caplog.records if r.name == "rayllm.storage"]
    assert len(lines) == 1 and "reading x failed (ConnectionResetError" in lines[0], lines
    assert "Traceback" not in caplog.text

    def down():
        raise TimeoutError("read timed out")

    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match=r"reading y: storage did not answer for 0.5 s"):
        retrying(down, "reading y", deadline_s=0.5)
    assert time.monotonic() - started < 5
    with pytest.raises(FileNotFoundError):  # the user's to fix: at once, as it is
        retrying(lambda: open("/nonexistent/rayllm"), "reading z", deadline_s=30)


def test_resumable_gives_each_item_once_across_a_reset():
    opened = []

    def items_from(given: int):
        opened.append(given)
        for i in range(given, 10):
            if i == 6 and len(opened) == 1:
                raise ConnectionResetError(104, "reset")
            yield i

    assert list(resumable(items_from, "reading x", deadline_s=30)) == list(range(10))
    assert opened == [0, 6]


def test_a_shard_whose_connection_drops_half_way_is_read_whole_each_document_once(server):
    from rayllm.data.shards import iter_documents

    texts = list(iter_documents(f"{server}/shards/flaky.jsonl", "text", StorageSettings(retry_deadline_s=30)))
    assert texts == [d["text"] for d in DOCS]
    assert Handler.gets.count("/shards/flaky.jsonl") >= 2  # the first read was cut, the shard reopened


def test_a_blip_past_the_deadline_is_unavailable_not_a_bad_shard():
    from rayllm.data.shards import iter_documents

    shard = f"http://127.0.0.1:{free_port()}/part-0.jsonl"  # nothing listens
    with pytest.raises(StorageUnavailable, match="reading shard"):
        list(iter_documents(shard, "text", StorageSettings(retry_deadline_s=0.3)))


def test_a_dropped_connections_task_exception_is_not_printed(caplog):
    loop = asyncio.new_event_loop()
    quiet_loop_noise(loop)

    async def dropped():
        raise ConnectionResetError(104, "Connection reset by peer")

    async def broken():
        raise KeyError("a bug")

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for make in (dropped, broken):
            task = loop.create_task(make())
            loop.run_until_complete(asyncio.sleep(0.01))
            del task
            gc.collect()
    loop.close()
    never_retrieved = [r for r in caplog.records if "Task exception was never retrieved" in r.getMessage()]
    assert len(never_retrieved) == 1 and "a bug" in str(never_retrieved[0].exc_info or caplog.text)


def test_ray_trains_small_files_go_whole_and_large_ones_stream(monkeypatch):
    import fsspec

    from rayllm.io import storage

    fs, root = storage.pyarrow_filesystem("memory://rayllm-retry-test/run", StorageSettings())
    monkeypatch.setattr(storage._WholeIfSmall, "WHOLE_WRITE_BYTES", 10)
    with fs.open_output_stream(root + "/snapshot.json") as f:  # one put, retried as a whole
        f.write(b"12345")
    with fs.open_output_stream(root + "/shard.parquet") as f:  # past the bound: the filesystem's stream
        for part in (b"abcdef", b"ghijklmn", b"op"):
            f.write(part)
    memory = fsspec.filesystem("memory")
    assert memory.cat_file("/rayllm-retry-test/run/snapshot.json") == b"12345"
    assert memory.cat_file("/rayllm-retry-test/run/shard.parquet") == b"abcdefghijklmnop"


def test_a_retry_line_shows_no_password_of_the_endpoint(caplog, monkeypatch):
    monkeypatch.setattr(Episode, "FIRST_WAIT_S", 0.01)

    def down():
        raise ConnectionRefusedError(111, "Could not connect to http://admin:hunter2@127.0.0.1:9/bucket/x")

    with caplog.at_level(logging.WARNING, logger="rayllm.storage"):
        with pytest.raises(StorageUnavailable) as caught:
            retrying(down, "reading x", deadline_s=0.05)
    assert "hunter2" not in caplog.text and "hunter2" not in str(caught.value)
    assert "<redacted>@127.0.0.1:9" in caplog.text
