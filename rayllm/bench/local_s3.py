"""An S3 service on this machine, for the storage-outage benchmark and the tests: moto's S3 server
(``pip install "moto[server]"``, in the test extra) in a process of its own on 127.0.0.1, over HTTP.
Its state lives in that process, so a FaultProxy in front of it can take it off the network
without losing a byte."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from rayllm.errors import ConfigError, RayllmError


@contextlib.contextmanager
def moto_server(timeout_s: float = 30.0) -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1 for the duration; yields its endpoint URL."""
    try:
        import moto.server  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"moto's S3 server is not installed ({e}): pip install 'moto[server]' (or rayllm's test extra)"
        ) from e
    from rayllm.parallel.process_group import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, proc, timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RayllmError(f"moto's S3 server exited at start with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RayllmError(f"moto's S3 server did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")
