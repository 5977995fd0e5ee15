"""The TCP server of one simulated member: a listener plus one thread per connection.

A connection that sends garbage is closed on its own; every other connection
keeps being served. :meth:`MemberServer.close_all` drops every connection of
the member at once (failover), :meth:`MemberServer.close` one of them.

A connection's thread ends, and closes its socket, as soon as the client
closes its end: between requests the read sees EOF; an operation that waits
(awaitable hello, a getMore waiting for events, failCommand's
``blockConnection``, waitForFailPoint) checks the client as mongod does and
ends with :class:`~changestream.testing.core.errors.ClientDisconnected`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from bson.errors import BSONError

from ..core.context import ConnectionInfo
from ..core.errors import CloseConnection, CommandError
from ..core.netstats import NetworkCounters
from ..core.topology import notify_topology_change
from . import wire
from .dispatch import Dispatcher

if TYPE_CHECKING:
    from ..storage.deployment import Deployment, Member

log = logging.getLogger(__name__)

MAX_REPLY_SIZE = 16 * 1024 * 1024 + 16 * 1024
"""mongod's BSONObjMaxInternalSize: the largest reply document it sends."""
_ACCEPT_POLL_SECONDS = 0.5


@dataclasses.dataclass(slots=True)
class _Connection:
    info: ConnectionInfo
    sock: socket.socket
    thread: threading.Thread | None = None


class MemberServer:
    """Serves ``member`` of ``deployment`` on ``host:port`` (port 0: a free port)."""

    def __init__(
        self, deployment: Deployment, member: Member, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.deployment = deployment
        self.member = member
        self.host = host
        self.port = port
        self.dispatcher = Dispatcher(deployment, member)
        self.total_created = 0
        self.network = NetworkCounters()
        self._connection_ids = itertools.count(1)
        """``connectionId`` of this member's connections (each mongod counts its own)."""
        self._request_ids = itertools.count(1)
        """``requestID`` of the messages this member sends."""
        self._lock = threading.Lock()
        self._conns: dict[int, _Connection] = {}
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> int:
        """Bind, start accepting, and return the bound port (also set on the member)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        listener.settimeout(_ACCEPT_POLL_SECONDS)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self.member.port = self.port
        self.member.server = self
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"sim-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()
        return self.port

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening, close every connection and join the threads (``timeout`` in all)."""
        deadline = time.monotonic() + timeout
        self._stopping.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        # No connection is registered after the accept loop ended: these are all of them.
        with self._lock:
            threads = [c.thread for c in self._conns.values() if c.thread is not None]
        self.close_all()
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.warning(
                "%s:%d stopped with connection threads still running: %s",
                self.host,
                self.port,
                ", ".join(alive),
            )
        if self.member.server is self:
            self.member.server = None

    # -- connections -------------------------------------------------------------------------
    @property
    def connection_count(self) -> int:
        with self._lock:
            return len(self._conns)

    def connection_ids(self) -> list[int]:
        with self._lock:
            return list(self._conns)

    def close(self, conn_id: int) -> bool:
        """Close one connection (its thread notices and exits); False if unknown."""
        with self._lock:
            conn = self._conns.get(conn_id)
        if conn is None:
            return False
        _shutdown(conn)
        self._wake_waiters()
        return True

    def close_all(self) -> int:
        """Close every connection of this member; return how many."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            _shutdown(conn)
        if conns:
            self._wake_waiters()
        return len(conns)

    def _wake_waiters(self) -> None:
        """Wake operations waiting on shared conditions: they find their connection closed."""
        notify_topology_change(self.deployment)
        self.deployment.oplog.notify()

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._stopping.is_set():
                    log.exception("accept failed on %s:%d", self.host, self.port)
                return
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            info = ConnectionInfo(id=next(self._connection_ids), peer=peer, sock=sock)
            conn = _Connection(info, sock)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"sim-conn-{conn.info.id}", daemon=True
            )
            conn.thread = thread
            with self._lock:
                if self._stopping.is_set():
                    sock.close()
                    return
                self._conns[conn.info.id] = conn
                self.total_created += 1
            thread.start()

    def _serve(self, conn: _Connection) -> None:
        try:
            while not conn.info.closed:
                request = wire.read_request(conn.sock, self.member.compressors)
                self.network.received(request.size, request.wire_size)
                self._handle(conn, request)
        except (wire.ConnectionClosed, CloseConnection, OSError):
            pass
        except wire.ProtocolError as exc:
            log.debug("closing connection %d: %s", conn.info.id, exc)
        except Exception:
            log.exception("connection %d failed", conn.info.id)
        finally:
            conn.info.close()
            with self._lock:
                self._conns.pop(conn.info.id, None)
            conn.sock.close()

    def _handle(self, conn: _Connection, request: wire.Request) -> None:
        """Run one request; keep replying while an exhaust stream continues."""
        reply = self.dispatcher.run(conn.info, request)
        if request.more_to_come:
            return
        if request.op_code == wire.OP_QUERY:
            self._send(conn, request, wire.encode_op_reply(self._new_request_id(), request.request_id, self._encode(reply)))
            return
        response_to = request.request_id
        while True:
            following = (
                self.dispatcher.exhaust_next(request.body, reply)
                if request.exhaust_allowed
                else None
            )
            reply_id = self._new_request_id()
            message = wire.encode_op_msg(
                reply_id,
                response_to,
                self._encode(reply),
                more_to_come=following is not None,
                checksum=request.checksum,
            )
            self._send(conn, request, message)
            if following is None or conn.info.closed or self._stopping.is_set():
                return
            request = dataclasses.replace(request, body=following)
            response_to = reply_id
            reply = self.dispatcher.run(conn.info, request)

    def _new_request_id(self) -> int:
        return next(self._request_ids) & 0x7FFFFFFF

    def _send(self, conn: _Connection, request: wire.Request, message: bytes) -> None:
        """Send a reply, compressed with the request's compressor when it came compressed."""
        physical = message
        codec = (
            self.member.compressors.codec(request.compressor_id)
            if request.compressor_id is not None
            else None
        )
        if codec is not None:
            physical = wire.compress_message(message, codec, self.member.compressors)
        conn.sock.sendall(physical)
        self.network.sent(len(message), len(physical))

    def _encode(self, reply: dict[str, Any]) -> bytes:
        """BSON for ``reply``, or for the error mongod sends when it cannot be sent."""
        try:
            payload = wire.encode_document(reply)
        except (BSONError, ValueError, TypeError, OverflowError) as exc:
            log.exception("reply could not be encoded")
            err = CommandError(1, f"reply could not be encoded: {exc}")
            return wire.encode_document(self.dispatcher.error_reply(None, err))
        if len(payload) > MAX_REPLY_SIZE:
            err = CommandError(
                10334,
                f"BSONObj size: {len(payload)} (0x{len(payload):X}) is invalid. "
                f"Size must be between 0 and {MAX_REPLY_SIZE}(16MB)",
            )
            return wire.encode_document(self.dispatcher.error_reply(None, err))
        return payload


def _shutdown(conn: _Connection) -> None:
    conn.info.close()
    with contextlib.suppress(OSError):
        conn.sock.shutdown(socket.SHUT_RDWR)
