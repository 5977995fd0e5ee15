"""A TCP load balancer: each client connection goes to the next mongos, bytes copied both ways.

The mongos side listens on its load-balancer port (where real mongos expects
the PROXY-protocol header a load balancer sends), so it answers ``hello`` with
a ``serviceId`` and kills a connection's cursors when the connection closes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading

log = logging.getLogger(__name__)

_ACCEPT_POLL_SECONDS = 0.5
_CHUNK = 256 * 1024


class LoadBalancer:
    """Listens on ``host`` (a free port) and spreads connections over ``targets`` round-robin."""

    def __init__(self, host: str, targets: list[int]) -> None:
        if not targets:
            raise ValueError("a load balancer needs at least one mongos")
        self.host = host
        self.targets = list(targets)
        self.port = 0
        self._next = itertools.cycle(range(len(self.targets)))
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self.connections = 0
        """How many client connections it accepted."""

    def start(self) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(128)
        listener.settimeout(_ACCEPT_POLL_SECONDS)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"sim-lb-{self.port}", daemon=True
        )
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            socks = list(self._sockets)
        for sock in socks:
            _close(sock)

    def drop_connections(self) -> int:
        """Close every proxied connection (a network failure); return how many sockets."""
        with self._lock:
            socks = list(self._sockets)
        for sock in socks:
            _close(sock)
        return len(socks)

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                port = self.targets[next(self._next)]
                self.connections += 1
            try:
                upstream = socket.create_connection((self.host, port))
            except OSError:
                _close(client)
                continue
            for sock in (client, upstream):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(src, dst), name="sim-lb-pump", daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)
                with self._lock:
                    self._sockets.discard(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
