"""The server of one simulated member: commands served on a :class:`~.transport.Listener`.

The listener owns sockets and threads (one I/O thread, workers per request in
flight; see its docstring for why); this module turns each message into a
reply. A connection that sends garbage is closed on its own; every other
connection keeps being served. :meth:`MemberServer.close_all` drops every
connection of the member at once (failover), :meth:`MemberServer.close` one of
them, :meth:`MemberServer.crash` the whole member with no goodbye, and
:meth:`MemberServer.shutdown` ends it as mongod's shutdown does: operations in
flight fail with InterruptedAtShutdown, then the sockets close.

An operation that waits (awaitable hello, a getMore waiting for events,
failCommand's ``blockConnection``, waitForFailPoint) checks its client as
mongod does and ends with
:class:`~changestream.testing.core.errors.ClientDisconnected` when it left.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from bson.errors import BSONError

from ..core.context import ConnectionInfo
from ..core.errors import CloseConnection, CommandError
from ..core.netstats import NetworkCounters
from ..core.topology import notify_topology_change
from . import wire
from .dispatch import Dispatcher
from .transport import Connection, Listener

if TYPE_CHECKING:
    from ..storage.deployment import Deployment, Member

log = logging.getLogger(__name__)

MAX_REPLY_SIZE = 16 * 1024 * 1024 + 16 * 1024
"""mongod's BSONObjMaxInternalSize: the largest reply document it sends."""
INTERRUPTED_AT_SHUTDOWN = (11600, "interrupted at shutdown")
"""What an operation in flight gets when mongod shuts down (``setKillAllOperations``)."""
QUIESCE_MODE = (91, "The server is in quiesce mode and will shut down")
"""What a waiting awaitable hello gets when mongod enters quiesce mode (5.0+)."""


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
        self.network = NetworkCounters()
        self.listener = Listener(self, host, port, check_header=wire.check_header, name="sim")
        self._request_ids = itertools.count(1)
        """``requestID`` of the messages this member sends."""
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> int:
        """Bind, start accepting, and return the bound port (also set on the member)."""
        self.port = self.listener.start()
        self.member.port = self.port
        self.member.server = self
        return self.port

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening, close every connection and end the threads (``timeout`` in all)."""
        self._stopping = True
        for conn in self.listener.connections():
            _info(conn).close()
        self._wake_waiters()
        alive = self.listener.stop(timeout)
        if alive:
            log.warning(
                "%s:%d stopped with workers still running: %s",
                self.host,
                self.port,
                ", ".join(alive),
            )
        if self.member.server is self:
            self.member.server = None

    def shutdown(self, timeout: float = 5.0) -> None:
        """mongod's shutdown: stop accepting, fail operations in flight, then close sockets.

        Waiting operations end with InterruptedAtShutdown (11600), replied to
        with the labels mongod gives at this version; the sockets close once
        those replies are sent (or ``timeout`` passed).
        """
        deadline = time.monotonic() + timeout
        self.member.shutting_down = True
        self.listener.stop_accepting()
        for conn in self.listener.connections():
            _info(conn).interrupt(*INTERRUPTED_AT_SHUTDOWN)
        self._wake_waiters()
        self.listener.drain()
        self.listener.wait_idle(deadline)
        self.stop(max(0.0, deadline - time.monotonic()))

    def crash(self) -> None:
        """Die as a killed process does: no reply to anyone, every socket dropped at once."""
        self._stopping = True
        for conn in self.listener.connections():
            _info(conn).close()
        self.listener.close_all()
        self.listener.stop_accepting()
        self._wake_waiters()
        self.stop(5.0)

    # -- connections -------------------------------------------------------------------------
    @property
    def connection_count(self) -> int:
        return self.listener.connection_count

    @property
    def total_created(self) -> int:
        return self.listener.total_created

    def connection_ids(self) -> list[int]:
        return [c.id for c in self.listener.connections()]

    def close(self, conn_id: int) -> bool:
        """Close one connection (an operation it waits in ends); False if unknown."""
        for conn in self.listener.connections():
            if conn.id == conn_id:
                _info(conn).close()
                self.listener.close(conn_id)
                self._wake_waiters()
                return True
        return False

    def close_all(self) -> int:
        """Close every connection of this member; return how many."""
        conns = self.listener.connections()
        for conn in conns:
            _info(conn).close()
        self.listener.close_all()
        if conns:
            self._wake_waiters()
        return len(conns)

    def _wake_waiters(self) -> None:
        """Wake operations waiting on shared conditions: they find their connection closed."""
        notify_topology_change(self.deployment)
        self.deployment.oplog.notify()

    # -- the listener's handler ------------------------------------------------------------------
    def connection_made(self, conn: Connection) -> None:
        conn.context = ConnectionInfo(id=conn.id, peer=conn.peer, sock=conn.sock)

    def connection_lost(self, conn: Connection) -> None:
        _info(conn).close()

    def handle(self, conn: Connection, message: bytes) -> None:
        """Serve one message (on a worker); closing the connection is raising."""
        info = _info(conn)
        try:
            request = wire.parse_message(message, self.member.compressors)
        except wire.InvalidRequest as exc:
            self.network.received(exc.request.size, exc.request.wire_size)
            reply = self.dispatcher.error_reply(None, CommandError(exc.code, exc.errmsg))
            if not exc.request.more_to_come:
                self._reply(conn, exc.request, exc.request.request_id, reply)
            return
        self.network.received(request.size, request.wire_size)
        try:
            self._handle(conn, request)
        except CloseConnection:
            info.close()
            raise
        except wire.ProtocolError:
            raise

    def _handle(self, conn: Connection, request: wire.Request) -> None:
        """Run one request; keep replying while an exhaust stream continues."""
        info = _info(conn)
        reply = self.dispatcher.run(info, request)
        if request.more_to_come:
            return
        response_to = request.request_id
        while True:
            following = (
                self.dispatcher.exhaust_next(request.body, reply)
                if request.exhaust_allowed
                else None
            )
            response_to = self._reply(conn, request, response_to, reply, following is not None)
            if following is None or info.closed or self._stopping:
                return
            request = dataclasses.replace(request, body=following)
            reply = self.dispatcher.run(info, request)

    def _reply(
        self,
        conn: Connection,
        request: wire.Request,
        response_to: int,
        reply: dict[str, Any],
        more_to_come: bool = False,
    ) -> int:
        """Send ``reply`` in the request's format (OP_REPLY for OP_QUERY); return its id."""
        reply_id = next(self._request_ids) & 0x7FFFFFFF
        if request.op_code == wire.OP_QUERY:
            payload = self._encode(reply)
            self._send(conn, request, wire.encode_op_reply(reply_id, response_to, payload))
            return reply_id
        message = wire.encode_op_msg(
            reply_id,
            response_to,
            self._encode(reply),
            more_to_come=more_to_come,
            checksum=request.checksum,
        )
        self._send(conn, request, message)
        return reply_id

    def _send(self, conn: Connection, request: wire.Request, message: bytes) -> None:
        """Send a reply, compressed with the request's compressor when it came compressed."""
        physical = message
        codec = (
            self.member.compressors.codec(request.compressor_id)
            if request.compressor_id is not None
            else None
        )
        if codec is not None:
            physical = wire.compress_message(message, codec, self.member.compressors)
        if _info(conn).closed:
            raise CloseConnection  # dropped (failover, crash): the reply goes to no one
        conn.send(physical)
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


def _info(conn: Connection) -> ConnectionInfo:
    info = conn.context
    assert isinstance(info, ConnectionInfo)
    return info
