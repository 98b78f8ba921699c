"""Paths on local disk or object storage, through fsspec.

One helper turns a path or URI plus the config's storage settings into a filesystem,
so that s3:// on any S3-compatible endpoint, local paths and other fsspec schemes are
handled the same way everywhere (data shards, run files, Ray Train storage).
"""

from __future__ import annotations

import functools
import io
import os
import posixpath
from typing import Any

import fsspec

from rayllm.errors import DataError
from rayllm.io.redact import display_uri
from rayllm.io.retry import RetryingFileSystem
from rayllm.io.settings import StorageSettings

# Object stores and web servers: reached over the network, so their calls retry transient errors.
NETWORK_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://", "abfss://", "http://", "https://")
SHARD_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".parquet", ".txt")


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def storage_options(path: str, storage: StorageSettings) -> dict[str, Any]:
    """fsspec options for ``path``: only s3 takes the config's credentials and endpoint."""
    if not path.startswith(("s3://", "s3a://")):
        return {}
    options: dict[str, Any] = {}
    if storage.anon:
        options["anon"] = True
    secret = storage.credentials()  # from Ray's object store in a process handed sealed settings
    if secret.get("key"):
        options["key"] = secret["key"]
    if secret.get("secret"):
        options["secret"] = secret["secret"]
    if secret.get("session_token"):
        options["token"] = secret["session_token"]  # s3fs's name for the STS session token
    endpoint = secret.get("endpoint_url") or storage.endpoint_url
    if endpoint:
        options["endpoint_url"] = endpoint
    if storage.region:
        options["client_kwargs"] = {"region_name": storage.region}
    return options


def filesystem(path: str, storage: StorageSettings) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem holding ``path`` and the path as that filesystem names it.

    ``path`` may be shown (``<redacted>`` in place of a password or a signature): the settings
    give back the real one (StorageSettings.real_path), which only the returned path holds."""
    path = storage.real_path(path)
    if not is_remote(path):
        return fsspec.filesystem("file"), os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    try:
        fs, stripped = fsspec.core.url_to_fs(path, **storage_options(path, storage))
    except AttributeError as e:
        if "aiohttp" not in str(e):
            raise
        _forget_half_imported_async_http()
        fs, stripped = fsspec.core.url_to_fs(path, **storage_options(path, storage))
    if path.startswith(NETWORK_SCHEMES):  # whole-object calls retry a blip (rayllm.io.retry)
        fs = RetryingFileSystem(fs, storage.retry_deadline_s)
    return fs, stripped


def _forget_half_imported_async_http() -> None:
    """Drop aiohttp, aiobotocore and s3fs from ``sys.modules`` so the next import starts clean.

    Seen in CI: a reused Ray Data worker process whose ``aiohttp`` had lost its
    ``http_exceptions`` attribute, so every s3fs import there failed with "module aiohttp has
    no attribute http_exceptions" for the rest of the session. That is what an import of
    aiohttp cut short (a Ray task cancelled mid-import) leaves behind: the package is
    re-imported but its already-loaded submodules are not re-attached to it. Nothing in those
    libraries repairs it, so this does, once, on that exact error.
    """
    import sys

    prefixes = ("aiohttp", "aiobotocore", "s3fs")
    for name in [m for m in sys.modules if m.split(".")[0] in prefixes]:
        del sys.modules[name]


def full_uri(fs: fsspec.AbstractFileSystem, path: str) -> str:
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if protocol in ("file", "local"):
        return path
    return path if "://" in path else fs.unstrip_protocol(path)  # http keeps its URL whole


def _is_hidden(found: str, folder: str) -> bool:
    """Files or folders named ``_*`` or ``.*`` inside a shard folder are metadata, not shards
    (the convention of Spark, Hadoop and pyarrow datasets): ``_report.json``, ``_tokenizer.json``."""
    relative = found[len(folder.rstrip("/")) :].strip("/")
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


def _check_bucket(fs, path: str, item: str, what: str) -> None:
    """A missing bucket is named as such: "no shards found" would send the user to the wrong place."""
    bucket = path.split("/", 1)[0]
    try:
        exists = fs.exists(bucket)
    except PermissionError as e:
        raise DataError(f"{what}: access denied to {display_uri(item)!r} ({e}); check storage credentials") from None
    except Exception:
        return
    if not exists:
        raise DataError(
            f"{what}: bucket {bucket!r} of {display_uri(item)!r} does not exist (or these credentials cannot see it); "
            f"check the bucket name and storage.endpoint_url"
        )


def expand_shards(spec: str | list[str], storage: StorageSettings, what: str) -> list[str]:
    """Every shard named by a path, glob, folder or list of them, as sorted full URIs."""
    return [uri for uri, _ in list_shards(spec, storage, what)]


def list_shards(spec: str | list[str], storage: StorageSettings, what: str) -> list[tuple[str, int]]:
    """(full URI, bytes) of every shard named by a path, glob, folder or list of them, sorted.

    Sizes come from the listing itself (one call per folder or glob, not one per file),
    so 100,000 shards list in seconds.
    """
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise DataError(f"{what} names no paths; give a path, glob or folder of shards")
    shards: list[tuple[str, int]] = []
    for item in specs:
        fs, path = filesystem(item, storage)
        try:
            if any(ch in path for ch in "*?["):
                found = {p: i for p, i in fs.glob(path, detail=True).items() if i.get("type") == "file"}
            elif fs.isdir(path):
                found = {
                    p: i
                    for p, i in fs.find(path, detail=True).items()
                    if p.endswith(SHARD_SUFFIXES) and not _is_hidden(p, path)
                }
            elif fs.isfile(path):
                found = {path: fs.info(path)}
            else:
                found = {}
        except PermissionError as e:
            raise DataError(
                f"{what}: access denied to {display_uri(item)!r} ({e}); check storage credentials"
            ) from None
        except OSError as e:
            raise DataError(f"{what}: cannot list {display_uri(item)!r}: {display_uri(str(e))}") from None
        if not found and is_remote(item):
            _check_bucket(fs, path, item, what)
        if not found:
            raise DataError(
                f"{what}: no shards found at {display_uri(item)!r}. Check the path exists and holds files ending in "
                f"{', '.join(SHARD_SUFFIXES)} (or set data.demo_corpus: true with the default demo paths)"
            )
        shards.extend((full_uri(fs, p), int(found[p].get("size") or 0)) for p in sorted(found))
    return shards


def write_text(uri: str, text: str, storage: StorageSettings) -> None:
    fs, path = filesystem(uri, storage)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(text)


def read_text(uri: str, storage: StorageSettings) -> str | None:
    """The file's text, or None when it does not exist."""
    fs, path = filesystem(uri, storage)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return f.read()


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if is_remote(base) else os.path.join(base, *parts)


def pyarrow_filesystem(uri: str, storage: StorageSettings):
    """A pyarrow filesystem over fsspec for Ray Train's storage (None for local paths).

    It pickles as (uri as shown, storage) and opens its fsspec filesystem on first use in each
    process: a pickled s3fs filesystem would carry its key and secret inside Ray Train's actor
    arguments, and a URI with a password would carry it too (``storage`` knows the real one).
    """
    if not is_remote(uri):
        return None, os.path.abspath(os.path.expanduser(uri))
    import pyarrow.fs

    _, path = filesystem(uri, storage)
    shown = display_uri(uri)
    handled = shown if storage.real_path(shown) == storage.real_path(uri) else uri
    return pyarrow.fs.PyFileSystem(_lazy_handler_class()(handled, storage)), path


@functools.cache
def _lazy_handler_class():
    import pyarrow.fs

    class LazyFSSpecHandler(pyarrow.fs.FSSpecHandler):
        """pyarrow's fsspec handler, with the filesystem opened where it is used."""

        def __init__(self, uri: str, storage: StorageSettings):
            self._uri, self._storage, self._fs = uri, storage, None

        @property
        def fs(self):
            if self._fs is None:
                self._fs = filesystem(self._uri, self._storage)[0]
            return self._fs

        def __reduce__(self):
            return (_make_lazy_handler, (self._uri, self._storage))

        def open_output_stream(self, path, metadata):
            """A small file (Ray Train's run snapshot) is written whole at close, with retries
            (rayllm.io.retry), so a blip does not end Ray Train's controller; a large one (a
            prepared shard) streams as before, not held in memory."""
            return pyarrow.PythonFile(_WholeIfSmall(self.fs, path), mode="w")

    return LazyFSSpecHandler


class _WholeIfSmall:
    """A write stream kept in memory up to WHOLE_WRITE_BYTES and then put whole (``pipe_file``,
    retried); past that size it becomes the filesystem's own stream."""

    WHOLE_WRITE_BYTES = 64 << 20

    def __init__(self, fs, path: str):
        self._fs, self._path = fs, path
        self._buffer: io.BytesIO | None = io.BytesIO()
        self._stream = None
        self._written = 0
        self.closed = False

    def write(self, data) -> int:
        if self._stream is None and self._written + len(data) > self.WHOLE_WRITE_BYTES:
            self._stream = self._fs.open(self._path, "wb")
            self._stream.write(self._buffer.getvalue())
            self._buffer = None
        (self._stream or self._buffer).write(data)
        self._written += len(data)
        return len(data)

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._stream is not None:
            self._stream.close()
        else:
            self._fs.pipe_file(self._path, self._buffer.getvalue())


def _make_lazy_handler(uri: str, storage: StorageSettings):
    return _lazy_handler_class()(uri, storage)
