"""A TCP proxy on 127.0.0.1 that can take a server off the network for a while, as an outage does
(for ``rayllm bench goodput --storage s3`` and the storage-outage tests):
while it is cut, every open connection is reset and every new one is reset on accept. Put it in
front of moto's S3 server (whose state lives in its own process, so moto itself is never restarted)
and point ``storage.endpoint_url`` at it."""

from __future__ import annotations

import socket
import struct
import threading
import time


def _reset(sock: socket.socket) -> None:
    """Close with an RST, as a dropped connection arrives (SO_LINGER 0), not a polite FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class FaultProxy:
    def __init__(self, target: str):
        host, port = target.rsplit("//", 1)[-1].rsplit(":", 1)
        self.target = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.resets = 0  # connections reset or refused during outages
        self._trigger: tuple[bytes, float] | None = None
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def cut(self, seconds: float) -> None:
        """From now on for ``seconds``: reset every connection, open or new."""
        self._down_until = time.monotonic() + seconds
        with self._lock:
            doomed, self._open = list(self._open), set()
        self.resets += len(doomed)
        for sock in doomed:
            _reset(sock)

    def cut_at(self, request: bytes, seconds: float) -> None:
        """Cut for ``seconds`` when the next request holding ``request`` (a key's path) passes:
        the outage then surely meets that read (HTTP to moto is plain text)."""
        self._trigger = (request, seconds)

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.down:
                self.resets += 1
                _reset(client)
                continue
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            return
        with self._lock:
            self._open |= {client, upstream}
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                trigger = self._trigger
                if trigger is not None and trigger[0] in data:
                    self._trigger, self.cuts = None, self.cuts + 1
                    self.cut(trigger[1])
                if self.down:
                    break
                sink.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open -= {source, sink}
        for sock in (source, sink):
            if self.down:
                _reset(sock)
            else:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
                except OSError:
                    pass
